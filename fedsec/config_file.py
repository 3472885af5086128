"""Config files: ``--config FILE`` (TOML) and the ``config.toml`` every run writes.

A config file is one flat table of a command's settings, named as its flags (``attack-rounds = "0,9"``;
``attack_rounds`` is read too), with ``command`` naming the command that wrote it. Read with the
standard library's ``tomllib`` (``tomli`` on Python 3.10), written with ``tomli_w``. A run writes the
settings it ran with, fully resolved (the preset's and each attack's defaults filled in), so
``fedsec <command> --config <run>/config.toml --out other`` repeats it. Settings that only say where
and how to write (``--out``, ``--force``, ``--config``) are not recorded.
"""
from __future__ import annotations

import sys
from pathlib import Path

from fedecouple.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NOT_RECORDED = ("out", "force", "config", "resume", "show_partition")
FILE_NAME = "config.toml"


def command_name(command) -> str:
    """``attack``, or ``flower attack`` for a command of the flower group."""
    callback = getattr(command, "callback", None)
    module = getattr(callback, "__module__", "") or ""
    return f"flower {command.name}" if module.startswith("fedsec.flower") else command.name


def read_config(path: str | Path, command) -> dict:
    """The settings in ``path`` for ``command`` (a click command), by parameter name; unknown names and
    a file written for another command are one-line errors naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--config {path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"--config {path}: not valid TOML ({exc})") from None
    name = command_name(command)
    written_for = data.pop("command", name)
    if written_for != name:
        raise UserError(f"--config {path} holds settings of `fedsec {written_for}`, not `fedsec {name}`; "
                        f"run `fedsec {written_for} --config {path}`")
    params = {p.name: p for p in command.params}
    settings, unknown = {}, []
    for key, value in data.items():
        param = key.replace("-", "_")
        if param not in params or param in NOT_RECORDED:
            unknown.append(key)
            continue
        settings[param] = tuple(value) if isinstance(value, list) else value
    if unknown:
        known = ", ".join(sorted(p.replace("_", "-") for p in params if p not in NOT_RECORDED))
        raise UserError(f"--config {path}: fedsec {name} has no setting {', '.join(unknown)}; its settings: {known}")
    return settings


def toml_text(command: str, settings: dict) -> str:
    """The TOML of a run's resolved ``settings`` (flag names; None, i.e. unset, left out)."""
    import tomli_w

    table = {"command": command}
    for key, value in settings.items():
        if key in NOT_RECORDED or value is None:
            continue
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, Path):
            value = str(value)
        table[key.replace("_", "-")] = value
    return tomli_w.dumps(table)


def write_config(folder: str | Path, command: str, settings: dict) -> Path:
    """Write ``folder/config.toml`` atomically; returns its path."""
    from . import io

    path = Path(folder) / FILE_NAME
    io.write_text(path, toml_text(command, settings))
    return path
