"""The attack registry: every attack declares itself once, as an ``AttackSpec``.

Everything around the attacks reads this declaration instead of repeating facts about them: the
CLI's choices and defaults (``fedsec attack``, ``report --attacks``, ``defend --attacks``), the
applicability check made before anything trains, which scoring applies to a result, the report's
columns and stages, the time estimate's rate, and for a malicious server's attack the download it
crafts (``CraftRequest``), how its read-back is scored and summed up, and the lines it prints.
Adding an attack is one file that defines its functions and calls ``register`` at import, plus the
line in ``attacks/__init__.py`` that imports that file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# what an attack rebuilds, and so how its result is scored (``attacks.metrics.score_images``, called by ``attacks.harness``)
# "aggregate": a round-level attack on what a server under secure aggregation holds (``attacks.secure``)
KINDS = ("gradient", "image", "labels", "malicious", "aggregate")
SCORINGS = ("images", "class-images", "labels")
WEIGHT_KINDS = frozenset({"extractor", "classifier"})
ESTIMATE_PER = ("image", "target")
_UPLOAD_WORDS = {"prototype": "class prototypes", "class_counts": "class counts", "statistic": "statistics",
                 "sample_count": "its sample count", "extractor": "the extractor", "classifier": "the classifier"}


@dataclass(frozen=True)
class AttackSpec:
    """One attack, declared once.

    ``attack_one(observation, budget, seed, **options)`` attacks one target;
    ``plan(observations, budget, mode, batched)`` prepares many at once and returns
    ``(batches, failed)`` (``attacks.inversion.batching``: each ``Batch`` one optimisation, ``failed`` the
    targets with nothing to attack); ``None``: one by one. ``applies_to`` holds the upload field kinds (``fedecouple.methods.base.KINDS``) the attack
    can use: it applies to a method that uploads any of them (a round-level attack: that sums any of
    them). ``default_victim_batch`` is the
    victim setting ``fedsec attack`` uses by default (1: one image, the textbook setting; 0: the
    method's real local training). ``needs`` and ``hint`` make the sentence shown where it does
    not apply.

    A round-level attack (kind ``"aggregate"``) attacks a whole round under secure aggregation instead
    of one client's upload: ``attack_round(observation, budget, seed) -> AttackResult`` with an
    ``attacks.secure.observation.RoundObservation`` (the decoded sum, who took part, the downloads, the
    earlier rounds' sums); its ``attack_one`` and ``plan`` are None. ``attacks.secure.harness`` runs it
    and scores it against the union of the round's survivors' training images. A malicious server's
    round-level attack declares ``crafts``, ``craft_download`` and ``unreachable`` (its crafts reach
    every participant of an attacked round); ``score_target`` is not needed (the round's scoring is the
    harness's)."""

    name: str
    kind: str
    summary: str
    attack_one: Callable | None
    plan: Callable | None
    default_iterations: int
    default_victim_batch: int
    applies_to: frozenset[str]
    scoring: str
    needs: str  # what it needs, in words ("model weights")
    hint: str = ""  # what to do instead, with {method} and {attack} placeholders
    matching: str | None = None  # its data-matching term ("l2", "cosine"): the forward-model check
    default_restarts: int = 1  # independent starts, the lowest objective kept
    # a malicious-server attack: the downloads it can craft (``attacks.malicious``; the first is the
    # default); empty: the attack reads an honest server's record
    crafts: tuple[str, ...] = ()
    # columns its attack.csv rows carry beyond ``attacks.harness.IMAGE_COLUMNS`` (classifier fishing's)
    extra_columns: tuple[str, ...] = ()
    # the earliest round it can attack (classifier fishing: 1, it reads the client's earlier upload)
    first_round: int = 0
    # a malicious server's side, which the harness calls (the attack itself only reads the record):
    # ``craft_download(request: CraftRequest) -> (tensors, record)``, the download sent to one attacked
    # client and the server's record of it (the attack's ``Observation.crafted``)
    craft_download: Callable | None = None
    # ``unreachable(method, model) -> str | None``: why its crafted download cannot reach the method's
    # update, from ``Method.download_reaches`` (None: it can), checked before anything trains
    unreachable: Callable | None = None
    # ``score_target(make_model, record, result, truths, truth_labels, prior) -> rows``: its read-back
    # (record: the server's craft record, None for an honest server's attack that scores its own rows)
    # scored against the images the client trained on, one dict per scored image: ``truth_index``,
    # ``reconstruction`` (the result's image, -1: none) and the values of ``attacks.harness.IMAGE_COLUMNS``
    # (psnr, ssim, prior_psnr, label_true; label_pred, input_error where it has them) and ``extra_columns``
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
    # a round-level attack's function (kind "aggregate"): ``attack_round(RoundObservation, budget, seed)``
    attack_round: Callable | None = None
    # a round-level attack's forward-model check: ``truth_objective(RoundObservation, images, labels) -> float``,
    # its data term at the round's true images, set beside its result's ``trace["data_term"]`` (None: no check)
    truth_objective: Callable | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"attack {self.name}: unknown kind {self.kind!r}; one of {KINDS}")
        if (self.kind == "aggregate") != (self.attack_round is not None) or \
                (self.attack_round is None) == (self.attack_one is None):
            raise ValueError(f"attack {self.name}: a round-level attack is of kind 'aggregate' and declares "
                             f"attack_round instead of attack_one; every other declares attack_one")
        if self.scoring not in SCORINGS:
            raise ValueError(f"attack {self.name}: unknown scoring {self.scoring!r}; one of {SCORINGS}")
        needed = (self.craft_download, self.unreachable) + (() if self.round_level else (self.score_target,))
        if self.crafts and None in needed:
            raise ValueError(f"attack {self.name}: a malicious server's attack declares craft_download, "
                             f"unreachable and score_target")
        if self.estimate_per not in ESTIMATE_PER:
            raise ValueError(f"attack {self.name}: unknown estimate_per {self.estimate_per!r}; one of {ESTIMATE_PER}")

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


@dataclass(frozen=True)
class CraftRequest:
    """What a malicious server holds when it crafts one attacked client's download
    (``AttackSpec.craft_download``): the craft chosen (``--craft``), the round and client, the honest
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


ATTACKS: dict[str, AttackSpec] = {}


def register(spec: AttackSpec) -> AttackSpec:
    """Add ``spec`` to the registry (a second registration of a name replaces the first)."""
    ATTACKS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove an attack (tests that register a toy attack clean up with this)."""
    ATTACKS.pop(name, None)


def names(kind: str | None = None) -> list[str]:
    """Registered attack names (of one kind), in registration order."""
    return [n for n, s in ATTACKS.items() if kind is None or s.kind == kind]


def get(name: str) -> AttackSpec:
    """The spec of ``name``; ``KeyError`` names the choices."""
    try:
        return ATTACKS[name]
    except KeyError:
        raise KeyError(f"unknown attack {name!r}; choose one of: {', '.join(ATTACKS)}") from None


GRADIENT_HINT = ("there is no gradient for {attack} to invert; use `fedsec attack proto --method {method}` "
                 "(prototype inversion) or `fedsec attack labels --method {method}`")


# ------------------------------------------------------------------------------------------------
# membership inference: scores per record from a model's outputs (``fedsec mia``)


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
    """One membership-inference attack, declared once: ``score(inputs) -> (n,)`` scores, higher
    meaning more likely a member; ``references`` says whether it needs reference models."""

    name: str
    summary: str
    score: Callable
    references: bool


MEMBERSHIP: dict[str, MembershipSpec] = {}


def register_membership(spec: MembershipSpec) -> MembershipSpec:
    MEMBERSHIP[spec.name] = spec
    return spec
