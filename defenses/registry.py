"""The registry of defenses: one ``DefenseSpec`` per choice of ``fedsec defend --defense``.

A spec says what its swept value means, where the defense acts, whether the value is a formal
guarantee (DP: an ε), how to read one value from the command line and how to build the defense for a
run (``DefendedRun``). Where it acts decides how the sweep installs what ``build`` returns:

* ``local training``: a ``DPConfig`` (the method is wrapped in ``DPMethod``);
* ``upload``: a channel interceptor on what leaves the client (an upload filter's ``FilterChain``);
* ``download``: a channel interceptor on what reaches the client (the ``DownloadCheck``, the
  ``ConsistencyCheck`` under secure aggregation).

Each defense's spec is bound to a name in its own module (``defenses.filters.CLIP``) and declared once in
``defenses/__init__.py`` (``DEFENSES``), which imports the module when the defense is first used.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fedecouple.errors import UserError

PLACES = ("local training", "upload", "download")


@dataclass(frozen=True)
class DefendedRun:
    """What building a defense may read of the run it defends."""

    method: Any  # the configured ``Method``: its manifest and persistent groups
    model: Callable[[], Any]  # a fresh model of the configured architecture (shapes, not weights)
    lr: float  # the clients' learning rate: the unit of the noise filter's value
    seed: int  # the federation's seed: the filters' noise
    images_of: Callable[[int], Any]  # a client's own training images (the download check runs on them)
    dp: Mapping[str, Any] = field(default_factory=dict)  # ``DPConfig``'s fields other than the noise multiplier
    secure: Any = None  # the run's ``SecureAggregation`` protocol (None: off); the consistency check needs its graph


@dataclass(frozen=True)
class DefenseSpec:
    """One defense: ``name`` is its ``--defense`` choice and its ``defense`` column in ``tradeoff.csv``.

    ``parse(item)`` turns one ``--values`` item into the value (``ValueError`` with the reason when it
    cannot); ``build(value, run)`` returns the defense at that value, refusing (``UserError``) what the
    run cannot take; ``report(built, clients)`` gives ``defense.json`` after training (its ``kind``
    included)."""

    name: str
    meaning: str  # what the swept value is, for tradeoff.md
    acts: str  # one of PLACES
    formal: bool  # the value gives a formal guarantee: the row has an ε
    parse: Callable[[str], Any]
    build: Callable[[Any, DefendedRun], Any]
    report: Callable[[Any, dict], dict]

    def __post_init__(self):
        if self.acts not in PLACES:
            raise ValueError(f"defense {self.name!r} acts on {self.acts!r}; one of: {', '.join(PLACES)}")

    def read(self, item: str):
        """One ``--values`` item as this defense's value; ``UserError`` naming the option when it is not one."""
        try:
            return self.parse(item)
        except ValueError as exc:
            raise UserError(f"--values for {self.name} {exc}") from None


def register(spec: DefenseSpec) -> DefenseSpec:
    """For a module that still builds its spec as ``register(DefenseSpec(...))`` instead of binding it to a
    name: binds ``spec`` in the module that defines its ``build``, under its name in capitals (``dp`` →
    ``defenses.dp:DP``), the target its declaration in ``defenses/__init__.py`` names."""
    setattr(sys.modules[spec.build.__module__], spec.name.upper().replace("-", "_"), spec)
    return spec


# value parsers shared by the defenses (the reason of a ValueError follows "--values for NAME")


def number(item: str, integer: bool = False) -> float | int:
    """``item`` as a finite number (an integer when ``integer``)."""
    try:
        value = int(item) if integer else float(item)
    except ValueError:
        raise ValueError(f"must be comma-separated numbers; {item!r} is not "
                         f"{'an integer' if integer else 'a number'}") from None
    if not math.isfinite(value):
        raise ValueError(f"must be finite, got {item!r}")
    return value


def non_negative(item: str) -> float:
    value = number(item)
    if value < 0:
        raise ValueError(f"must be >= 0, got {item}")
    return value
