"""``fedsec report``'s settings: how every attack stage runs (``ReportSettings``), the report's cells,
the ``--preset audit`` plan and ``--iterations`` parsing."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import attacks
from fedecouple.errors import UserError

from ..attack import AttackSettings
from ..compare import parse_list

DEFAULT_METHODS = ("fedecouple", "fedper", "fedpac", "fedproto")
DEFAULT_ATTACKS = ("dlg", "ig", "proto", "labels")
DEFAULT_TARGETS = 2
VICTIM_SETTINGS = ("textbook", "real")
# the malicious-server section: clients of these many training images, each with and without the
# client-side download check (fedsec.defenses.download_check)
DEFAULT_MALICIOUS_SIZES = (10, 50)
CHECK_SETTINGS = (False, True)


def attack_of(key: str) -> str:
    """The registered attack of a report cell key (``ig`` or ``ig@real``)."""
    return key.partition("@")[0]


@dataclass(frozen=True)
class ReportSettings:
    """How every attack stage is run (the same for all methods). Each attack runs as ``fedsec
    attack`` does by default (its declared iterations and victim setting) unless overridden here.

    With ``victim_settings`` each gradient attack runs once per setting, as its own cell ``<attack>@
    <setting>``: ``textbook`` (each target trains one step on ``textbook_batch`` of its images) and
    ``real`` (its real local training); the other attacks read the real local training anyway.
    ``iterations`` and ``targets_by`` may name a cell (``ig@real``) or an attack (``ig``)."""

    rounds: tuple[int, ...] = (0,)
    targets: int = DEFAULT_TARGETS
    iterations: dict[str, int] = field(default_factory=dict)  # per cell or attack; missing → the attack's default
    restarts: int | None = None  # None: each attack's declared restarts
    images: int = 1  # images rebuilt per target when the victim trains normally (proto, labels)
    victim_settings: tuple[str, ...] = ()
    textbook_batch: int = 1
    targets_by: dict[str, int] = field(default_factory=dict)  # per cell or attack; missing → targets
    malicious_sizes: tuple[int, ...] = DEFAULT_MALICIOUS_SIZES  # the section's clients' training images
    malicious_rounds: tuple[int, ...] | None = None  # the section's attacked rounds (None: ``rounds``)

    def keys(self, attack_names: Iterable[str]) -> list[str]:
        """The report's cells: one per attack, or one per attack and victim setting (gradient attacks).
        A malicious server's attacks have their own section (``malicious_cells``), not cells."""
        return [f"{a}@{v}" if v else a for a in attack_names if attacks.get(a).kind != "malicious"
                for v in (self.victim_settings if attacks.get(a).kind == "gradient" and self.victim_settings else [""])]

    def malicious_cells(self, attack_names: Iterable[str]) -> list["MaliciousCell"]:
        """The malicious-server section's cells: every requested attack of kind ``malicious``, at each
        of ``malicious_sizes``, without and with the client-side download check."""
        return [MaliciousCell(a, int(n), check, self.for_malicious(a, check))
                for a in attack_names if attacks.get(a).kind == "malicious"
                for n in self.malicious_sizes for check in CHECK_SETTINGS]

    def for_malicious(self, attack: str, check: bool) -> AttackSettings:
        """The ``AttackSettings`` of a malicious-server cell: the clients' real local training, the
        section's rounds (a round before the attack's ``first_round`` moves to it: classifier fishing
        reads the client's earlier upload, so it attacks round 1 where the others attack round 0),
        ``download_check`` on or off."""
        spec = attacks.get(attack)
        rounds = sorted({max(int(r), spec.first_round) for r in (self.malicious_rounds or self.rounds)})
        return AttackSettings(attack=attack, rounds=tuple(rounds),
                              targets=int(self.targets_by.get(attack, self.targets)),
                              iterations=int(self.iterations.get(attack, spec.default_iterations)),
                              restarts=spec.default_restarts if self.restarts is None else int(self.restarts),
                              victim_batch=0, download_check=bool(check))

    def attack_plan(self, keys: Iterable[str]) -> dict[str, AttackSettings]:
        """{cell: its AttackSettings}: each built once, read by every stage, estimate and the report's meta."""
        return {key: self.for_attack(key) for key in keys}

    def for_attack(self, key: str) -> AttackSettings:
        """The ``AttackSettings`` of one cell (``ig``, ``ig@real``)."""
        attack, _, setting = key.partition("@")
        spec = attacks.get(attack)
        victim = {"": spec.default_victim_batch, "real": 0, "textbook": self.textbook_batch}[setting]
        pick = lambda table, default: table.get(key, table.get(attack, default))  # noqa: E731
        return AttackSettings(attack=attack, rounds=tuple(int(r) for r in self.rounds),
                              targets=int(pick(self.targets_by, self.targets)),
                              iterations=int(pick(self.iterations, spec.default_iterations)),
                              restarts=spec.default_restarts if self.restarts is None else int(self.restarts),
                              images=int(self.images) if victim == 0 else victim,  # the victim's batch
                              victim_batch=victim, victim_steps=1)


@dataclass(frozen=True)
class MaliciousCell:
    """One cell of the malicious-server section: ``attack`` against clients of ``size`` training
    images, the download check on or off (``settings.download_check``)."""

    attack: str
    size: int
    check: bool
    settings: AttackSettings

    @property
    def key(self) -> str:
        """The cell's name (its stage folder is ``attack-<key>``): ``trap@n10``, ``trap@n10+check``."""
        return f"{self.attack}@n{self.size}" + ("+check" if self.check else "")


def parse_sizes(text: str | Iterable[int] | None) -> tuple[int, ...]:
    """``--malicious-sizes "10,50"`` → (10, 50): training images per client, sorted, unique, each ≥ 1."""
    if text is None:
        return DEFAULT_MALICIOUS_SIZES
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t) for t in text]
    try:
        sizes = sorted({int(t) for t in items if t != ""})
    except ValueError:
        raise UserError(f"--malicious-sizes expects comma-separated image counts per client (e.g. 10,50), "
                        f"got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise UserError(f"--malicious-sizes needs image counts of at least 1 per client (e.g. 10,50), got {text!r}")
    return tuple(sizes)


def audit_preset(iterations: dict[str, int] | None = None) -> ReportSettings:
    """``--preset audit``'s attack plan (the federation is ``runner.AUDIT_FEDERATION``): attacks at
    round 0 and at the last round, IG in the textbook setting (16 clients, one step on 2 images each)
    and on the clients' real local training (2 clients, every image they trained on), prototype
    inversion on 11 clients (3 prototypes each) and label inference on all 20: at least 32 images per
    image cell. One start per reconstruction; IG's budget is cut on the real local training, where
    each step replays a whole epoch (or FedeCouple's three) on ~180 images. The malicious-server
    section (``trap``): 4 clients of 10 and of 50 training images at round 0, the check off and on."""
    return ReportSettings(rounds=AUDIT_ROUNDS, victim_settings=VICTIM_SETTINGS, textbook_batch=2, restarts=1,
                          targets_by={"ig@textbook": 16, "ig@real": 2, "proto": 11, "labels": 20,
                                      **{a: AUDIT_MALICIOUS_TARGETS for a in attacks.names("malicious")}},
                          malicious_sizes=DEFAULT_MALICIOUS_SIZES, malicious_rounds=(0,),
                          iterations={**{k: v for k, v in AUDIT_ITERATIONS.items()
                                         if k not in (iterations or {}) and attack_of(k) not in (iterations or {})},
                                      **(iterations or {})})


AUDIT_ATTACKS = ("ig", "proto", "labels", "trap")
AUDIT_MALICIOUS_TARGETS = 4
AUDIT_ROUNDS = (0, 19)
AUDIT_ITERATIONS = {"ig@textbook": 500, "ig@real": 100, "proto": 300}


def parse_iterations(text: str | None) -> dict[str, int]:
    """``"300"`` (every attack) or ``"dlg=300,ig=1000,ig@real=200"`` → {attack or cell: iterations}."""
    if text is None or str(text).strip() == "":
        return {}
    out: dict[str, int] = {}
    for item in parse_list(str(text), "iterations"):
        name, _, value = item.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise UserError(f"--iterations expects N or ATTACK=N,..., got {item!r}") from None
        if n < 1:
            raise UserError(f"--iterations must be at least 1, got {n}")
        names = [name] if name else list(attacks.ATTACKS)
        for a in names:
            attack, at, setting = a.partition("@")
            if attack not in attacks.ATTACKS:
                raise UserError(f"--iterations names unknown attack {attack!r}; choose from: {', '.join(attacks.ATTACKS)}")
            if at and setting not in VICTIM_SETTINGS:
                raise UserError(f"--iterations names unknown setting {a!r}; a cell is ATTACK@"
                                f"{'|'.join(VICTIM_SETTINGS)}")
            out[a] = n
    return out
