"""The ``fedsec`` command line: the command tree of ``fedsec.commands`` (every flag declared once),
each command's body in ``fedsec.bodies`` (the same bodies a Python user's call runs). This module adds the
entry point: user errors become one line on stderr and exit status 2, never a traceback."""
from __future__ import annotations

import sys
import warnings

import click

from fedecouple.errors import UserError

from . import field_names
from .commands import cli

__all__ = ["cli", "main"]


def main(argv=None) -> None:
    """Entry point: user errors become one line on stderr and exit status 2, never a traceback (an
    engine error's fields named by their flags: ``fedsec.field_names``). Deprecation warnings (an old
    flag's spelling) are printed as ``warning:`` lines once the command has run, so an error stays one line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        try:
            cli.main(args=argv, prog_name="fedsec", standalone_mode=False)
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        except click.exceptions.ClickException as exc:  # a bad flag or choice: one line too, no usage block
            where = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) is not None else ""
            click.echo(f"error: {exc.format_message()}{where}", err=True)
            sys.exit(2)
        except UserError as exc:  # the engine names its own fields: the user gave their flags
            click.echo(f"error: {field_names.for_cli(exc)}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted; completed rounds are checkpointed (rerun the same command to resume)", err=True)
            sys.exit(130)
    for w in caught:
        if issubclass(w.category, FutureWarning) and str(w.message).startswith("--"):
            click.echo(f"warning: {w.message}", err=True)


if __name__ == "__main__":
    main()
