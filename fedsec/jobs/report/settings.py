"""``fedsec report``'s settings: how every attack stage runs (``ReportSettings``), the report's cells,
the ``--preset audit`` plan and ``--iterations`` parsing."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import attacks
from fedecouple.errors import UserError

from ...catalog import REPORT_ATTACKS, REPORT_METHODS
from ..attack import AttackSettings
from ..compare import parse_list

DEFAULT_METHODS = REPORT_METHODS
# ``--preset audit``'s methods: FedAvg beside the four, the reference the FedeCouple paper's Fig. 10 ranks
# the others against (the report's "Fig. 10" section pairs each method with FedeCouple and with FedAvg)
AUDIT_METHODS = (*DEFAULT_METHODS, "fedavg")
DEFAULT_ATTACKS = REPORT_ATTACKS  # declared with the CLI's catalog (``--help`` loads no torch)
DEFAULT_TARGETS = 2
VICTIM_SETTINGS = ("textbook", "real")
# a real-training cell on clients of N training images: ``ig@real-n10``
SIZED_REAL = re.compile(r"real-n([1-9][0-9]*)")
# the malicious-server section: clients of these many training images, each with and without the
# client-side download check (defenses.download_check)
DEFAULT_MALICIOUS_SIZES = (10, 50)
CHECK_SETTINGS = (False, True)


def attack_of(key: str) -> str:
    """The registered attack of a report cell key (``ig``, ``ig@real`` or ``ig@real-n10``)."""
    return key.partition("@")[0]


def cell_setting(key: str) -> tuple[str, int | None]:
    """(victim setting, client size) of a report cell key: ``ig`` → ("", None), ``ig@textbook`` →
    ("textbook", None), ``ig@real`` → ("real", None: the federation's own clients), ``ig@real-n10`` →
    ("real", 10: clients of 10 training images)."""
    setting = key.partition("@")[2]
    sized = SIZED_REAL.fullmatch(setting)
    return ("real", int(sized.group(1))) if sized else (setting, None)


@dataclass(frozen=True)
class ReportSettings:
    """How every attack stage is run (the same for all methods). Each attack runs as ``fedsec
    attack`` does by default (its declared iterations and victim setting) unless overridden here.

    With ``victim_settings`` each gradient attack runs once per setting, as its own cell ``<attack>@
    <setting>``: ``textbook`` (each target trains one step on ``textbook_batch`` of its images) and
    ``real`` (its real local training); the other attacks read the real local training anyway.
    With ``real_sizes`` the ``real`` setting is one cell per size N, ``<attack>@real-n<N>``, on its
    own federation of clients of exactly N training images (``--train-images N``; leakage falls
    with the images a client trains on, so one size says little): without, one cell on the
    federation's own clients. ``iterations`` and ``targets_by`` may name a cell (``ig@real-n10``),
    its setting (``ig@real``, for every size) or an attack (``ig``). ``settings_by`` narrows an
    attack's cells to some of the victim settings (the preset: IG in the textbook setting, the
    attack built for real local training, ``fedavg-leak``, in the real one)."""

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
    real_sizes: tuple[int, ...] = ()  # the real-training cells' client sizes (empty: the federation's clients)
    settings_by: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per attack: its victim settings
    # per cell or attack: the textbook step's batch where it is not ``textbook_batch`` (an exact batch
    # attack is measured at the batch sizes clients train with)
    textbook_batch_by: dict[str, int] = field(default_factory=dict)
    mode: str = "auto"  # the gradient attacks' forward model (``AttackSettings.mode``)

    def keys(self, attack_names: Iterable[str]) -> list[str]:
        """The report's cells: one per attack, or one per attack and victim setting (gradient attacks).
        A malicious server's attacks have their own section (``malicious_cells``), not cells."""
        def settings(attack: str) -> list[str]:
            chosen = [v for v in self.victim_settings if v in self.settings_by.get(attack, self.victim_settings)]
            return [s for v in chosen
                    for s in ([f"real-n{n}" for n in self.real_sizes] if v == "real" and self.real_sizes else [v])]

        return [f"{a}@{v}" if v else a for a in attack_names if attacks.get(a).kind != "malicious"
                for v in (settings(a) if attacks.get(a).kind == "gradient" and self.victim_settings else [""])]

    def cell_size(self, key: str) -> int | None:
        """The training images of the clients a cell attacks (None: the federation's own)."""
        return cell_setting(key)[1]

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
                              victim_batch=0, download_check=bool(check), mode=self.mode)

    def attack_plan(self, keys: Iterable[str]) -> dict[str, AttackSettings]:
        """{cell: its AttackSettings}: each built once, read by every stage, estimate and the report's meta."""
        return {key: self.for_attack(key) for key in keys}

    def for_attack(self, key: str) -> AttackSettings:
        """The ``AttackSettings`` of one cell (``ig``, ``ig@real``, ``ig@real-n10``)."""
        attack, setting = attack_of(key), cell_setting(key)[0]
        spec = attacks.get(attack)
        family = f"{attack}@{setting}"  # a sized cell falls back on its setting's entry, then the attack's
        pick = lambda table, default: table.get(key, table.get(family, table.get(attack, default)))  # noqa: E731
        textbook = int(pick(self.textbook_batch_by, self.textbook_batch))
        # an attack's own setting: the textbook batch where it attacks the textbook setting by default
        own = textbook if spec.default_victim_batch > 0 else spec.default_victim_batch
        victim = {"": own, "real": 0, "textbook": textbook}[setting]
        # a round before the attack's first moves to it (fishing reads an earlier round's upload or sum)
        rounds = tuple(sorted({max(int(r), spec.first_round) for r in self.rounds}))
        return AttackSettings(attack=attack, rounds=rounds,
                              targets=int(pick(self.targets_by, self.targets)),
                              iterations=int(pick(self.iterations, spec.default_iterations)),
                              restarts=spec.default_restarts if self.restarts is None else int(self.restarts),
                              images=int(self.images) if victim == 0 else victim,  # the victim's batch
                              victim_batch=victim, victim_steps=1, mode=self.mode)


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


def parse_sizes(text: str | Iterable[int] | None, flag: str = "--malicious-sizes",
                default: tuple[int, ...] = DEFAULT_MALICIOUS_SIZES) -> tuple[int, ...]:
    """``"10,50"`` (``--malicious-sizes``, ``--real-sizes``) → (10, 50): training images per client,
    sorted, unique, each ≥ 1; None → ``default``."""
    if text is None:
        return default
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t) for t in text]
    try:
        sizes = sorted({int(t) for t in items if t != ""})
    except ValueError:
        raise UserError(f"{flag} expects comma-separated image counts per client (e.g. 10,50), got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise UserError(f"{flag} needs image counts of at least 1 per client (e.g. 10,50), got {text!r}")
    return tuple(sizes)


def audit_preset(iterations: dict[str, int] | None = None) -> ReportSettings:
    """``--preset audit``'s attack plan (the federation is ``runner.AUDIT_FEDERATION``): attacks at
    round 0 and at the last round, IG in the textbook setting (16 clients, one step on 2 images each),
    the attack built for real local training (``fedavg-leak``: Dimitrov et al., with the layer-input
    solve where it applies) on clients of 4, 10 and 50 training images (``AUDIT_REAL_SIZES``: 8, 4
    and 2 clients, every image they trained on; a federation of its own per size), the exact batch
    attack (``spear``) on 4 clients, each one SGD step on a batch of 8 of its images, prototype
    inversion on 11 clients (3 prototypes each) and label inference on all 20: at least 32 images per
    image cell. One start per reconstruction; the budget is cut where each step replays several
    local steps (50 images: five, FedeCouple's phases each). The malicious-server section (``trap``):
    4 clients of 10 and of 50 training images at round 0, the check off and on. ``iterations`` (the
    user's ``--iterations``) win over the preset's for every cell they name or cover."""
    user = iterations or {}
    kept = {k: v for k, v in AUDIT_ITERATIONS.items() if not any(_covers(u, k) for u in user)}
    sized = {f"{a}@real-n{n}": t for a in ("ig", REAL_TRAINING_ATTACK) for n, t in AUDIT_REAL_TARGETS.items()}
    return ReportSettings(rounds=AUDIT_ROUNDS, victim_settings=VICTIM_SETTINGS, textbook_batch=2, restarts=1,
                          textbook_batch_by={EXACT_BATCH_ATTACK: AUDIT_EXACT_BATCH},
                          targets_by={"ig@textbook": 16, "ig@real": 2, f"{REAL_TRAINING_ATTACK}@real": 2, **sized,
                                      f"{EXACT_BATCH_ATTACK}@textbook": 4,
                                      "proto": 11, "labels": 20,
                                      **{a: AUDIT_MALICIOUS_TARGETS for a in attacks.names("malicious")}},
                          malicious_sizes=DEFAULT_MALICIOUS_SIZES, malicious_rounds=(0,), real_sizes=AUDIT_REAL_SIZES,
                          settings_by={"ig": ("textbook",), REAL_TRAINING_ATTACK: ("real",),
                                       EXACT_BATCH_ATTACK: ("textbook",)},
                          iterations={**kept, **user})


def _covers(given: str, key: str) -> bool:
    """Whether an ``--iterations`` entry ``given`` (an attack, a setting, a cell) applies to ``key``."""
    return given in (key, attack_of(key), f"{attack_of(key)}@{cell_setting(key)[0]}")


# the attack built for the clients' real local training (several steps, every image): the preset's
# real-training cells, where IG keeps the textbook one
REAL_TRAINING_ATTACK = "fedavg-leak"
# the exact batch attack: one step on a batch of this many images, as clients train (SPEAR)
EXACT_BATCH_ATTACK, AUDIT_EXACT_BATCH = "spear", 8
AUDIT_ATTACKS = ("ig", REAL_TRAINING_ATTACK, EXACT_BATCH_ATTACK, "proto", "labels", "trap", "sum-labels")
AUDIT_MALICIOUS_TARGETS = 4
AUDIT_ROUNDS = (0, 19)
# ig@real: the federation's own clients (~180 images), as ``fedsec attack ig --preset audit`` runs it
# the preset's client sizes on the curve of real local training: 4 (one step of 4 images with batches of
# 10: the curve's start), 10 (one step of 10) and 50 (five steps); the attacked clients per size (at
# least 32 images per round; 50: ``@real``'s 2)
AUDIT_REAL_SIZES = (4, 10, 50)
AUDIT_REAL_TARGETS = {4: 8, 10: 4}
AUDIT_ITERATIONS = {"ig@textbook": 500, "ig@real": 100, "proto": 300, f"{REAL_TRAINING_ATTACK}@real": 100,
                    **{f"{a}@real-n{n}": 500 for a in ("ig", REAL_TRAINING_ATTACK) for n in AUDIT_REAL_TARGETS}}


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
            if at and cell_setting(a)[0] not in VICTIM_SETTINGS:
                raise UserError(f"--iterations names unknown setting {a!r}; a cell is ATTACK@"
                                f"{'|'.join(VICTIM_SETTINGS)} or ATTACK@real-nN (clients of N images)")
            out[a] = n
    return out
