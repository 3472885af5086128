"""The names ``--help`` lists, read without importing torch.

``fedsec --help`` and ``fedsec <command> --help`` must start in well under a second, so the command
line reads the choices it shows (attacks with their one-line summaries and defaults, methods, data
sets, partitions, architectures, defenses, threat-model choices) from here. Methods, data sets,
architectures and defenses are declared once, each in its package's light module
(``fedecouple.methods.METHODS``, ``fedecouple.data.DATASETS``, ``fedecouple.architectures.ARCHITECTURES``,
``defenses.DEFENSES``: ``fedecouple.plugins.Plugins``, whose names and facts import no implementation);
``METHODS``, ``DATASETS``, ``EMBEDDED_DATASETS``, ``ARCHITECTURES`` and ``DEFENSES`` here are their
names, read from the declarations each time they are read, so a plugin declared at run time (a user's
own method, a test's toy) is a choice of a command line built after it. ``PARTITIONS`` and the secure
aggregation's defaults are ``fedecouple``'s too (``fedecouple.data.SCHEMES``, ``fedecouple.secure_defaults``);
``REPORT_ATTACKS``, ``REPORT_METHODS`` and ``DEFEND_ATTACKS`` are the command line's own.

The attacks are declared once too, in ``attacks/__init__.py`` (``attacks.ATTACKS``, a ``Plugins``, and
``attacks.MEMBERSHIP``; the threat-model choices in ``attacks.choices``): importing ``attacks`` imports no
torch. ``ATTACKS``, ``attack_names``, ``attack_summaries`` and ``attack_defaults`` read the declarations
when read, so an attack declared or registered at run time (``attacks.declare``, ``attacks.register``: a
plugin, a test's toy) is a choice like the others.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import attacks
import defenses
from attacks.choices import AUGMENTATION_MODELS, MODES, STARTS  # noqa: F401  (the options' choices)
from fedecouple import architectures, methods
from fedecouple.data import registry as data
from fedecouple.secure_defaults import CLEAR_FIELDS, DEFAULTS


class AttackEntry(NamedTuple):
    """What the help shows of one declared attack (its facts: ``attacks.registry.declare``)."""

    summary: str
    kind: str
    default_iterations: int
    default_restarts: int
    first_round: int


class _AttackEntries(Mapping):
    """name → ``AttackEntry`` of every declared attack, in declaration order, read from
    ``attacks.ATTACKS`` when read (its specs stay unimported)."""

    def __getitem__(self, name: str) -> AttackEntry:
        facts = attacks.ATTACKS.facts(name)
        return AttackEntry(*(facts[f] for f in AttackEntry._fields))

    def __iter__(self) -> Iterator[str]:
        return iter(attacks.ATTACKS.names())

    def __len__(self) -> int:
        return len(attacks.ATTACKS)


ATTACKS: Mapping[str, AttackEntry] = _AttackEntries()
# fedecouple.secure_aggregation.SecureAggregation's defaults (Flower's SecAggPlusWorkflow's): the options' defaults
SECURE_AGGREGATION = DEFAULTS
SECURE_AGGREGATION_CLEAR_FIELDS = CLEAR_FIELDS
MEMBERSHIP_ATTACKS = attacks.MEMBERSHIP.names()  # the membership attacks, in declaration order
PARTITIONS = data.SCHEMES
# the attacks ``fedsec report`` runs unless --attacks is given (read by ``fedsec.jobs.report.settings``)
REPORT_ATTACKS = ("dlg", "ig", "proto", "labels", "sum-labels")
REPORT_METHODS = ("fedecouple", "fedper", "fedpac", "fedproto")  # the report's default methods
# the attacks ``fedsec defend`` runs against each value unless --attacks is given (``DefendSettings``)
DEFEND_ATTACKS = ("dlg", "ig", "labels")


def attack_names(kind: str | None = None) -> list[str]:
    """Declared attack names (of one kind), in declaration order."""
    return attacks.names(kind)


def attack_summaries() -> dict[str, str]:
    """{attack: its one-line summary}."""
    return attacks.ATTACKS.fact("summary")


def attack_defaults(field: str) -> dict[str, int]:
    """{attack: its declared ``default_iterations`` or ``default_restarts``}."""
    return attacks.ATTACKS.fact(field)


# the declared names, read when read: ``catalog.METHODS`` is ``fedecouple.methods.METHODS.names()`` now
_DECLARED = {"METHODS": lambda: methods.METHODS.names(), "DATASETS": lambda: data.DATASETS.names(),
             "EMBEDDED_DATASETS": lambda: data.DATASETS.names(embedded=True),
             "ARCHITECTURES": lambda: architectures.ARCHITECTURES.names(), "DEFENSES": lambda: defenses.DEFENSES.names()}
# the registry of each kind of plugin
REGISTRIES = {"method": methods.METHODS, "dataset": data.DATASETS, "architecture": architectures.ARCHITECTURES,
              "defense": defenses.DEFENSES, "attack": attacks.ATTACKS}


def __getattr__(name: str):
    """``METHODS``, ``DATASETS``, ``EMBEDDED_DATASETS``, ``ARCHITECTURES``, ``DEFENSES``: the declared names, in
    declaration order, as they are now (a tuple)."""
    if name in _DECLARED:
        return _DECLARED[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def summaries(kind: str) -> dict[str, str]:
    """{name: its declared one-line summary} of a ``kind`` in ``REGISTRIES`` (method, dataset, architecture,
    defense, attack)."""
    return REGISTRIES[kind].fact("summary")
