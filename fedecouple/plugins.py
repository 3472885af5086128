"""Declared plugins: a name, light facts and a lazy reference to the implementation.

A ``Plugins`` registry holds one kind of plugin (methods, data sets, architectures, attacks, defenses).
Each is declared once, with ``declare(name, "package.module:attribute", **facts)``: the facts (a one-line
summary, defaults, a kind) are plain values the command line's help reads without importing the
implementation (and so without torch); the implementation is imported on first use (``registry[name]``).
The declaration order is the registry's (the command line's choices, a report's columns).

A plugin declared at run time (a user's own method, a test's toy) is a registry entry like any other:
it appears in the choices, the help, the reports and the estimate.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass(frozen=True)
class Declaration:
    """One plugin: its name, where its implementation lives (``"module:attribute"``) and its facts."""

    name: str
    target: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, sep, attribute = self.target.partition(":")
        if not sep or not module or not attribute:
            raise ValueError(f"plugin {self.name!r}: target {self.target!r} is not 'package.module:attribute'")

    def load(self) -> Any:
        module, _, attribute = self.target.partition(":")
        value: Any = importlib.import_module(module)
        for part in attribute.split("."):
            value = getattr(value, part)
        return value


class Plugins(Mapping):
    """name → implementation, in declaration order; ``facts(name)`` and ``names()`` import nothing."""

    def __init__(self, kind: str):
        self.kind = kind  # in words, for messages ("method", "data set")
        self._declared: dict[str, Declaration] = {}
        self._loaded: dict[str, Any] = {}

    def declare(self, name: str, target: str, **facts) -> Declaration:
        """Declare ``name`` (a name declared again is replaced: a plugin may override a built-in)."""
        declaration = Declaration(name, target, facts)
        self._declared[name] = declaration
        self._loaded.pop(name, None)
        return declaration

    def remove(self, name: str) -> None:
        """Forget ``name`` (a test's toy, once its test ends)."""
        self._declared.pop(name, None)
        self._loaded.pop(name, None)

    def names(self, **where) -> tuple[str, ...]:
        """The declared names, in order; ``where``: only those whose facts have these values."""
        return tuple(n for n, d in self._declared.items()
                     if all(d.facts.get(k) == v for k, v in where.items()))

    def facts(self, name: str) -> Mapping[str, Any]:
        return self._declared[name].facts

    def fact(self, field_name: str) -> dict[str, Any]:
        """{name: its fact ``field_name``} for every plugin declaring it."""
        return {n: d.facts[field_name] for n, d in self._declared.items() if field_name in d.facts}

    def declaration(self, name: str) -> Declaration:
        return self._declared[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            self._loaded[name] = self._declared[name].load()  # KeyError for an undeclared name
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return name in self._declared

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._declared))

    def __len__(self) -> int:
        return len(self._declared)

    def __repr__(self) -> str:
        return f"Plugins({self.kind!r}: {', '.join(self._declared)})"
