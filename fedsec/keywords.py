"""The Python API's keywords as a ``Request`` (``fedsec.invocation``): the command line's other front end.

Each keyword is converted and checked by the type of the flag of the same name (``fedsec.commands``
declares them once, for both front ends), so a bad value is the flag's own one-line ``UserError``; no
command line is parsed and no click context is made. ``config`` reads a settings file first (keywords
override it), as ``--config`` does.
"""
from __future__ import annotations

from typing import Any, Mapping

import click

from fedecouple.errors import UserError

from .invocation import Request

_NO_DEFAULT = getattr(click.core, "UNSET", None)  # click's marker of a flag without a default

# what a keyword may carry that its flag's type does not convert: ``config`` is read here, not by a callback
READ_HERE = ("config",)


def request(name: str, options: Mapping[str, Any]) -> Request:
    """``fedsec.<name>(**options)`` as the request ``fedsec <name>`` with those flags makes."""
    from .commands import command_of

    command = command_of(name)
    params = [p for p in command.params if p.name and p.expose_value]
    known = {p.name for p in params}
    unknown = sorted(set(options) - known)
    if unknown:
        shown = ", ".join(sorted(p.name for p in params if not getattr(p, "hidden", False)))
        raise UserError(f"fedsec.{name}() has no keyword {', '.join(unknown)}; its keywords (the flags of "
                        f"`fedsec {name}`): {shown}")
    keywords = {k: v for k, v in options.items() if not (k == "config" and v is None)}
    from_file: dict = {}
    if keywords.get("config") is not None:
        from .config_file import read_config

        from_file = read_config(keywords["config"], command)
    values = {}
    for param in params:
        if param.name in keywords:
            raw = keywords[param.name]
        elif param.name in from_file:
            raw = from_file[param.name]
        else:
            raw = _default(param)
        values[param.name] = _converted(param, raw)
    return Request(name, values, frozenset(keywords) | frozenset(from_file), tuple(p.name for p in params))


def _default(param: click.Parameter):
    value = param.default
    if callable(value):
        value = value()
    if value is None or value is _NO_DEFAULT:
        if getattr(param, "is_flag", False) and not getattr(param, "secondary_opts", None):
            return False  # click's default for a flag without one
        return () if param.multiple or param.nargs == -1 else None
    return value


def _converted(param: click.Parameter, raw):
    if param.callback is not None and param.name not in READ_HERE:
        raise TypeError(f"{param.name}: a flag with a callback cannot be read from a keyword; give it a type")
    try:
        value = param.type_cast_value(None, raw)
    except click.exceptions.BadParameter as exc:
        raise UserError(exc.format_message()) from None
    if param.required and value in (None, ()):
        raise UserError(click.MissingParameter(param=param).format_message())
    return value
