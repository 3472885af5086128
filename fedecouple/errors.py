"""Errors that the CLI turns into one-line messages with exit status 2."""


class UserError(ValueError):
    """Bad input from a user: the message names the problem and the fix."""


# how every divergence error starts (a non-finite loss or upload), so that callers can tell it apart
DIVERGED = "training diverged"
