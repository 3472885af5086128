"""The attack registry: what every attack is, declared once.

An attack is two things, each written once:

* its declaration, one statement in ``attacks/__init__.py`` (``declare``): its name, where its spec lives
  (``"package.module:ATTRIBUTE"``, imported on first use) and the facts the command line's help shows
  without importing torch: a one-line ``summary``, its ``kind``, ``default_iterations``,
  ``default_restarts`` and ``first_round``. ``ATTACKS`` (a ``fedecouple.plugins.Plugins``) holds them, in
  declaration order: the CLI's choices, a report's columns;
* its spec, in its own module: one of the types below, by kind, holding its functions and what the
  harnesses and ``fedsec`` read of it (which uploads it applies to, how its result is scored, the
  report's extra columns, the time estimate's rate, a malicious server's crafted download). A spec does
  not repeat its declaration: ``spec.summary``, ``spec.kind`` and the defaults read it.

The types: ``ClientAttackSpec`` (kinds ``gradient``, ``image``, ``labels``: one client's upload, one
target at a time or planned in batches), ``MaliciousSpec`` (kind ``malicious``: one client's answer to a
download the server crafted), ``RoundAttackSpec`` (kind ``aggregate``: a whole round's secure sum) and
``MaliciousRoundSpec`` (kind ``aggregate``, with the download a malicious server crafts for every
participant). Each requires the functions its kind needs.

Adding an attack: one file in its family's folder that defines its functions and its spec
(``SPEC = ClientAttackSpec("name", attack_one=..., ...)``), plus one ``declare(...)`` line in
``attacks/__init__.py``. An attack built at run time (a test's toy) is ``register(spec, summary=...,
kind=..., default_iterations=...)``, which declares it; a plugin package declares its own with
``declare``. Membership-inference attacks are declared alike (``declare_membership``, ``MembershipSpec``).
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable, ClassVar

from fedecouple.errors import UserError
from fedecouple.plugins import Plugins

# what an attack rebuilds, and so how its result is scored (``attacks.metrics.score_images``, called by ``attacks.harness``)
# "aggregate": a round-level attack on what a server under secure aggregation holds (``attacks.secure``)
KINDS = ("gradient", "image", "labels", "malicious", "aggregate")
SCORINGS = ("images", "class-images", "labels")
WEIGHT_KINDS = frozenset({"extractor", "classifier"})
ESTIMATE_PER = ("image", "target")
_UPLOAD_WORDS = {"prototype": "class prototypes", "class_counts": "class counts", "statistic": "statistics",
                 "sample_count": "its sample count", "extractor": "the extractor", "classifier": "the classifier"}

# name -> its declaration: where its spec lives and the facts the help reads (``declare``), in declaration order
ATTACKS = Plugins("attack")
# the specs ``register`` was handed, as attributes: what their declarations name ("attacks.registry:
# BUILT_AT_RUN_TIME.<name>"), so that they load as every declared attack does
BUILT_AT_RUN_TIME = types.SimpleNamespace()


def declare(name: str, target: str, summary: str, kind: str, default_iterations: int, default_restarts: int = 1,
            first_round: int = 0) -> None:
    """Declare attack ``name``: its spec at ``target`` (``"package.module:ATTRIBUTE"``, imported on first use)
    and what the help shows of it without importing torch: a one-line ``summary``, its ``kind`` (one of
    ``KINDS``), the optimiser steps and independent starts it runs by default, and the earliest round it
    can attack (classifier fishing: 1, it reads the client's earlier upload). A name declared again
    replaces the earlier declaration (a plugin may override a built-in)."""
    if kind not in KINDS:
        raise ValueError(f"attack {name}: unknown kind {kind!r}; one of {KINDS}")
    ATTACKS.declare(name, target, summary=summary, kind=kind, default_iterations=int(default_iterations),
                    default_restarts=int(default_restarts), first_round=int(first_round))


@dataclass(frozen=True)
class AttackSpec:
    """What every attack declares beside its functions; an attack's spec is one of the types below, by
    kind (this one and ``CraftingSpec`` are their shared parts, never a spec themselves).

    Its declaration's facts (``declare``) are read, never repeated: ``summary``, ``kind`` (which its
    type admits: ``KINDS``), ``default_iterations``, ``default_restarts``, ``first_round``.

    ``applies_to`` holds the upload field kinds (``fedecouple.methods.base.KINDS``) the attack can use:
    it applies to a method that uploads any of them (a round-level attack: that sums any of them).
    ``needs`` and ``hint`` make the sentence shown where it does not apply. ``default_victim_batch`` is
    the victim setting ``fedsec attack`` uses by default (1: one image, the textbook setting; 0: the
    method's real local training)."""

    name: str
    _: KW_ONLY
    applies_to: frozenset[str]
    scoring: str
    needs: str  # what it needs, in words ("model weights")
    default_victim_batch: int
    hint: str = ""  # what to do instead, with {method} and {attack} placeholders
    # columns its attack.csv rows carry beyond ``attacks.harness.IMAGE_COLUMNS`` (classifier fishing's)
    extra_columns: tuple[str, ...] = ()
    # ``score_target(make_model, record, result, truths, truth_labels, prior) -> rows``: its read-back
    # (record: the server's craft record, None for an honest server's attack that scores its own rows)
    # scored against the images the client trained on, one dict per scored image: ``truth_index``,
    # ``reconstruction`` (the result's image, -1: none) and the values of ``attacks.harness.IMAGE_COLUMNS``
    # (psnr, ssim, prior_psnr, label_true; label_pred, input_error where it has them) and ``extra_columns``;
    # None: the harness scores its images (``attacks.metrics.score_images``)
    score_target: Callable | None = None
    # ``statistics(rows, seed) -> dict``: what its summary adds to the leakage statistics
    statistics: Callable | None = None
    # ``summary_lines(summary) -> list[str]``: what the terminal shows of those under the headline
    summary_lines: Callable | None = None
    # ``fedsec.estimate``: seconds per optimiser step of one target on the reference machine (2 cores,
    # one torch thread), times the target's images ("image": those it trained on, or rebuilds in the
    # textbook setting) or once per target ("target"); None: the estimate's rates for its kind and method
    estimate_rate: float | None = None
    estimate_per: str = "image"
    # with the kind's rates: the cost of one of its optimiser steps in Adam steps (an L-BFGS step runs
    # several evaluations)
    estimate_step_factor: float = 1.0
    # ``estimate_starts(restarts, iterations)``: what its ``restarts`` starts cost in one-start runs (None:
    # ``restarts`` times one; an attack that races its starts costs less)
    estimate_starts: Callable | None = None
    # the downloads a malicious server's attack can craft (``CraftingSpec``; the first is the default);
    # empty: the attack reads an honest server's record
    crafts: tuple[str, ...] = field(default=(), init=False)

    KINDS: ClassVar[tuple[str, ...]] = ()  # the kinds a spec of this type may be declared with

    def __post_init__(self) -> None:
        if not self.KINDS:
            raise TypeError(f"attack {self.name}: its spec is a ClientAttackSpec, MaliciousSpec, RoundAttackSpec "
                            f"or MaliciousRoundSpec, not a {type(self).__name__}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"attack {self.name}: unknown scoring {self.scoring!r}; one of {SCORINGS}")
        if self.estimate_per not in ESTIMATE_PER:
            raise ValueError(f"attack {self.name}: unknown estimate_per {self.estimate_per!r}; one of {ESTIMATE_PER}")

    def _require(self, *functions: str) -> None:
        missing = [f for f in functions if not callable(getattr(self, f))]
        if missing:
            raise TypeError(f"attack {self.name}: a {type(self).__name__} declares {', '.join(missing)}")

    @property
    def facts(self) -> Mapping[str, Any]:
        """Its declaration's facts (``declare``, or ``register`` for a spec built at run time)."""
        if self.name not in ATTACKS:
            raise LookupError(f"attack {self.name!r} is not declared: declare it (attacks.declare) or register its "
                              f"spec with its facts (attacks.register)")
        return ATTACKS.facts(self.name)

    @property
    def summary(self) -> str:
        return self.facts["summary"]

    @property
    def kind(self) -> str:
        kind = self.facts["kind"]
        if kind not in self.KINDS:
            raise TypeError(f"attack {self.name} is declared of kind {kind!r}, but its spec is a "
                            f"{type(self).__name__} (kind {' or '.join(self.KINDS)})")
        return kind

    @property
    def default_iterations(self) -> int:
        return self.facts["default_iterations"]

    @property
    def default_restarts(self) -> int:
        return self.facts["default_restarts"]

    @property
    def first_round(self) -> int:
        return self.facts["first_round"]

    @property
    def malicious(self) -> bool:
        return bool(self.crafts)

    @property
    def round_level(self) -> bool:
        """Whether it attacks a round's secure sum (kind ``"aggregate"``) rather than one client's upload."""
        return self.kind == "aggregate"

    @property
    def rebuilds_images(self) -> bool:
        return self.scoring != "labels"

    def not_applicable(self, method_name: str, upload_kinds: set[str]) -> str | None:
        """Why this attack has nothing to work on in a method that uploads ``upload_kinds`` (None:
        it applies). Known before any training, from the method's manifest."""
        if upload_kinds & self.applies_to:
            return None
        if not upload_kinds:
            return f"{method_name} never communicates with the server: there is nothing to attack"
        sent = ", ".join(sorted(_UPLOAD_WORDS.get(k, k) for k in upload_kinds))
        hint = self.hint.format(method=method_name, attack=self.name) if self.hint else \
            f"{self.name} has nothing to work on"
        return f"{method_name} uploads no {self.needs}: it sends only {sent}; {hint}"


@dataclass(frozen=True, kw_only=True)
class ClientAttackSpec(AttackSpec):
    """An attack on one client's upload (kinds ``gradient``, ``image``, ``labels``), run by
    ``attacks.harness.attack_recorded``.

    ``attack_one(observation, budget, seed, **options) -> AttackResult`` attacks one target
    (``attacks.base``); ``plan(observations, budget, mode, batched)`` prepares many at once and returns
    ``(batches, failed)`` (``attacks.inversion.batching``: each ``Batch`` one optimisation, ``failed`` the
    targets with nothing to attack); ``None``: one by one. ``matching`` is its data-matching term
    (``"l2"``, ``"cosine"``) for the forward-model check (``attacks.inversion.forward_check``); None: it
    matches no gradient (prototype inversion checks its own way; labels are not checked)."""

    attack_one: Callable
    plan: Callable | None = None
    matching: str | None = None

    KINDS: ClassVar[tuple[str, ...]] = ("gradient", "image", "labels")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require("attack_one")


@dataclass(frozen=True, kw_only=True)
class RoundAttackSpec(AttackSpec):
    """A round-level attack (kind ``"aggregate"``): it attacks a whole round under secure aggregation
    instead of one client's upload, and ``attacks.harness.rounds`` runs it and scores it against the
    union of the round's survivors' training images.

    ``attack_round(observation, budget, seed) -> AttackResult`` with an
    ``attacks.secure.observation.RoundObservation`` (the decoded sum, who took part, the downloads, the
    earlier rounds' sums); ``truth_objective(observation, images, labels) -> float`` its forward-model
    check: its data term at the round's true images, set beside its result's ``trace["data_term"]``
    (None: no check)."""

    attack_round: Callable
    truth_objective: Callable | None = None

    KINDS: ClassVar[tuple[str, ...]] = ("aggregate",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require("attack_round")


@dataclass(frozen=True, kw_only=True)
class CraftingSpec(AttackSpec):
    """What a malicious server's attack adds: the server's side, which the harness calls (the attack
    itself only reads the record).

    ``crafts``: the downloads it can craft (``--craft``; the first is the default).
    ``craft_download(request: CraftRequest) -> (tensors, record)``: the download sent to one attacked
    client and the server's record of it (the attack's ``Observation.crafted``).
    ``unreachable(method, model) -> str | None``: why its crafted download cannot reach the method's
    update, from ``Method.download_reaches`` (None: it can), checked before anything trains."""

    crafts: tuple[str, ...] = field()
    craft_download: Callable
    unreachable: Callable

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require("craft_download", "unreachable")
        if not self.crafts:
            raise ValueError(f"attack {self.name}: a malicious server's attack names the downloads it crafts")


@dataclass(frozen=True, kw_only=True)
class MaliciousSpec(CraftingSpec, ClientAttackSpec):
    """A malicious server's attack on one client (kind ``"malicious"``): the server crafts the attacked
    clients' downloads, and ``attack_one`` reads one client's answer back; ``score_target`` scores that
    read-back (an honest server's record has no crafted layer to score against)."""

    score_target: Callable = field()

    KINDS: ClassVar[tuple[str, ...]] = ("malicious",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require("score_target")


@dataclass(frozen=True, kw_only=True)
class MaliciousRoundSpec(CraftingSpec, RoundAttackSpec):
    """A malicious server's round-level attack (kind ``"aggregate"``): its crafts reach every participant
    of an attacked round, and ``attack_round`` reads the round's sum (``score_target``, where it has one,
    scores a read-back of crafted-layer inputs)."""

    KINDS: ClassVar[tuple[str, ...]] = ("aggregate",)


@dataclass(frozen=True)
class CraftRequest:
    """What a malicious server holds when it crafts one attacked client's download
    (``CraftingSpec.craft_download``): the craft chosen (``--craft``), the round and client, the honest
    download, ``make_model`` (a fresh model of the architecture at its initial weights), the public
    images it holds (in [0, 1]) and their labels, the parameter groups the client trains from or
    against as sent (``Method.download_reaches``), a seed of its own for this round and client, the
    client's latest exchange it saw before this one ((round, download as sent, upload or None); None:
    none), and the federation's method and local training settings (None where unknown). For a
    round-level attack also the secure-aggregation protocol the server runs (``secure``; None: unknown)
    and every client whose download it crafts in this round (``round_clients``: a craft that treats
    one participant apart from the others, as model inconsistency does, chooses it from them)."""

    craft: str
    round: int
    client: int
    download: dict
    make_model: Callable
    public: object
    public_labels: object | None
    reached: tuple[str, ...]
    seed: int
    earlier: tuple | None = None
    method: object = None
    train: object = None
    secure: object = None
    round_clients: tuple = ()


def register(spec: AttackSpec, *, summary: str, default_iterations: int, kind: str | None = None,
             default_restarts: int = 1, first_round: int = 0) -> AttackSpec:
    """Declare ``spec``, an attack built at run time (a test's toy), with its facts (``declare``'s);
    ``kind`` may be left out where the spec's type admits one kind. A name registered again replaces
    the earlier attack."""
    if "." in spec.name:
        raise ValueError(f"attack {spec.name!r}: an attack's name has no '.'")
    if kind is None and len(spec.KINDS) != 1:
        raise ValueError(f"attack {spec.name}: a {type(spec).__name__} is of kind {' or '.join(spec.KINDS)}: "
                         f"say which")
    setattr(BUILT_AT_RUN_TIME, spec.name, spec)
    declare(spec.name, f"{__name__}:BUILT_AT_RUN_TIME.{spec.name}", summary, kind or spec.KINDS[0],
            default_iterations, default_restarts, first_round)
    return get(spec.name)


def unregister(name: str) -> None:
    """Remove an attack (tests that register a toy attack clean up with this)."""
    ATTACKS.remove(name)
    vars(BUILT_AT_RUN_TIME).pop(name, None)


def names(kind: str | None = None) -> list[str]:
    """Declared attack names (of one kind), in declaration order; imports no attack."""
    return list(ATTACKS.names() if kind is None else ATTACKS.names(kind=kind))


def get(name: str) -> AttackSpec:
    """The spec of attack ``name``, its module imported on first use; for a name not declared, a
    ``UserError`` that names the choices."""
    if name not in ATTACKS:
        raise UserError(f"unknown attack {name!r}; choose one of: {', '.join(ATTACKS)}")
    spec = ATTACKS[name]
    if not isinstance(spec, AttackSpec) or spec.name != name:
        raise TypeError(f"attack {name}: its declaration names {ATTACKS.declaration(name).target}, "
                        f"which is not its spec ({spec!r})")
    return spec


GRADIENT_HINT = ("there is no gradient for {attack} to invert; use `fedsec attack proto --method {method}` "
                 "(prototype inversion) or `fedsec attack labels --method {method}`")


# ------------------------------------------------------------------------------------------------
# membership inference: scores per record from a model's outputs (``fedsec mia``)

# name -> its declaration: where its ``MembershipSpec`` lives and its one-line ``summary``, in order
MEMBERSHIP = Plugins("membership attack")


def declare_membership(name: str, target: str, summary: str) -> None:
    """Declare membership attack ``name``: its ``MembershipSpec`` at ``target`` (imported on first use)
    and its one-line summary."""
    MEMBERSHIP.declare(name, target, summary=summary)


@dataclass
class MembershipInputs:
    """What a membership attack sees of one target model, for n audited records: the target's logits
    (n, C), the records' labels and owners (clients), which records are known population data (the
    clients' own held-out records: non-members by construction), the reference models' logits
    (R, n, C) and which records each reference trained on (n, R), and the attack options
    (``gamma``, ``temperature``, ``a``)."""

    logits: object
    labels: object
    owner: object
    population: object
    reference_logits: object
    reference_in: object
    options: dict

    def per_record(self, values, trained: bool):
        """(n, k) rows of ``values`` (n, R): for each record, its values under the k references that
        trained on it (``trained``) or did not (every record is IN and OUT of equally many)."""
        import numpy as np

        mask = np.asarray(self.reference_in) if trained else ~np.asarray(self.reference_in)
        counts = mask.sum(axis=1)
        if len(counts) and counts.min() != counts.max():
            raise ValueError("every record needs the same number of selected reference runs")
        return np.asarray(values)[mask].reshape(len(values), -1)


@dataclass(frozen=True)
class MembershipSpec:
    """One membership-inference attack: ``score(inputs) -> (n,)`` scores, higher meaning more likely a
    member; ``references`` says whether it needs reference models. Its summary is its declaration's
    (``declare_membership``)."""

    name: str
    score: Callable
    references: bool

    @property
    def summary(self) -> str:
        return MEMBERSHIP.facts(self.name)["summary"]
