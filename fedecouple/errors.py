"""Errors that a front end turns into one-line messages (the command line: exit status 2)."""
from __future__ import annotations


class UserError(ValueError):
    """Bad input from a user: the message names the problem and the fix.

    The engine is a library, so its messages name the fields and parameters its caller set
    (``rounds``, ``num_clients``, ``data_dir``), bare, and ``fields`` lists the ones a message names:
    a front end shows each under its own name (``fedsec.field_names``: the command line's flag, the
    Python API's keyword). ``str(exc)`` is the message as raised."""

    def __init__(self, *args, fields: tuple[str, ...] = ()) -> None:
        super().__init__(*args)
        # in the instance's __dict__, so a pickled error (a Ray task's) arrives with its fields
        self.fields = tuple(fields)


# how every divergence error starts (a non-finite loss or upload), so that callers can tell it apart
DIVERGED = "training diverged"
