"""Attacks on what the channel carried.

Every attack is declared once, below: its name, where its spec lives (imported on first use) and the
facts the command line's help shows without importing torch (a one-line summary, its kind, its default
optimiser steps and starts, the earliest round it can attack). The spec, in the attack's own module, is
one of the types of ``attacks.registry`` by kind (``ClientAttackSpec``, ``MaliciousSpec``,
``RoundAttackSpec``, ``MaliciousRoundSpec``): its one-target function ``attack_one(observation, budget,
seed) -> AttackResult`` (see ``attacks.base``) or round function ``attack_round``, how it plans many
targets, which uploads it applies to and how its result is scored (``attacks.metrics``). ``get(name)``
returns the spec; ``names(kind)`` and ``ATTACKS.facts(name)`` read the declarations and import nothing.

Membership-inference attacks (``fedsec mia``) score records from a model's outputs instead; they are
declared alike (``declare_membership``, a ``MembershipSpec``).

The families are folders: ``attacks.inversion`` (a curious server rebuilds images or labels from an
upload), ``attacks.membership`` (membership inference and its scoring) and ``attacks.malicious`` (a
server that crafts the download), and ``attacks.secure`` (round-level attacks on what a server under
secure aggregation holds: each round's sum). Shared by all: ``base``, ``registry``, ``metrics``,
``statistics``, and the one harness that attacks a recorded run whatever the attack (``recorded``:
``RecordedRun``, ``ThreatModel``; ``harness``: ``attack_recorded``, per client or per round).

Adding an attack: one file in its family's folder that defines its functions and its spec
(``SPEC = ClientAttackSpec("name", attack_one=..., ...)``), plus its one ``declare`` statement here. An
attack module imports no other attack module; an inversion attack declares its objective, optimiser and
prior over the optimisation template (``attacks.inversion.optimise``).

Importing this package imports no torch: the public names whose modules do (``Budget``, ``Observation``,
``AttackResult``, ...) load on first use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Sequence

from .choices import AUGMENTATION_MODELS, MODES, STARTS
from .registry import (ATTACKS, KINDS, MEMBERSHIP, AttackSpec, ClientAttackSpec, CraftingSpec, MaliciousRoundSpec,
                       MaliciousSpec, MembershipSpec, RoundAttackSpec, declare, declare_membership, get, names,
                       register, unregister)

if TYPE_CHECKING:
    from .base import AttackResult, Budget, NotApplicable, Observation
    from .inversion.batching import Batch

# the declaration order is the registry's: the CLI's choices, a report's columns
declare("dlg", "attacks.inversion.dlg:DLG",
        "Deep Leakage from Gradients: image and soft label by L-BFGS gradient matching", "gradient", 300)
declare("idlg", "attacks.inversion.dlg:IDLG",
        "improved DLG: the label from the classifier's gradient, then DLG", "gradient", 300)
# three starts: on the tuning federation (seed 1) they took the method-aware IG from 14.3 to 16.8 dB on
# FedeCouple and 26.5 to 28.3 dB on FedPAC
declare("ig", "attacks.inversion.ig:SPEC",
        "Inverting Gradients: cosine gradient matching with a TV prior, signed Adam", "gradient", 1000,
        default_restarts=3)
declare("proto", "attacks.inversion.proto:SPEC",
        "prototype inversion: a class-typical image from each uploaded class prototype", "image", 300)
declare("labels", "attacks.inversion.labels:SPEC",
        "label-distribution inference from counts, statistics, prototype keys or the classifier's update", "labels",
        300)
# a malicious server's read-back: L-BFGS steps rebuilding each image from its recovered input
declare("trap", "attacks.malicious:TRAP",
        "malicious server: trap weights in the first linear layer (--craft binning: Fowl et al.'s bins, exact; "
        "plain: Boenisch et al.'s random rows)", "malicious", 300)
declare("binning", "attacks.malicious:BINNING",
        "malicious server: binning rows in the first linear layer (= trap --craft binning)", "malicious", 300)
# classifier fishing reads the client's earlier upload (its label counts pick the class): round 1 on
declare("fish", "attacks.malicious:FISH",
        "malicious server: classifier fishing (Wen et al.): the classifier sent isolates one image of the client's "
        "rarest class, rebuilt from the update", "malicious", 1000, first_round=1)
declare("fedavg-leak", "attacks.inversion.fedavg_leakage:SPEC",
        "Dimitrov et al. 2022: simulate the client's local epochs, label counts first, epoch copies tied by an "
        "order-invariant term, every image rebuilt", "gradient", 3000, default_restarts=2)
# L-BFGS steps rebuilding images from recovered inputs of a layer that does not see the pixels
declare("spear", "attacks.inversion.spear:SPEC",
        "SPEAR: every image of a one-step batch, exactly, from the update of a linear layer followed by ReLU (its "
        "sparse gradients), each certified by the ReLU's pattern", "gradient", 300)
# under secure aggregation: a malicious server's binning craft, sized to the protocol (its L-BFGS steps
# rebuild the images from the recovered inputs, as ``trap``'s do)
declare("sum-binning", "attacks.secure.sum_binning:SPEC",
        "malicious server under secure aggregation: the same binning rows for every client, sized to the protocol; "
        "a bin holding one image of the whole round reads it out of the sum (Robbing the Fed)", "aggregate", 300)
declare("inconsistency", "attacks.secure.inconsistency:SPEC",
        "malicious server under secure aggregation: model inconsistency (Eluding Secure Aggregation via Model "
        "Inconsistency) zeroes every other client's first-layer update; binning reads the target's from the sum",
        "aggregate", 300)
declare("sybil", "attacks.secure.sybil:SPEC",
        "malicious server under secure aggregation with sybils: every other participant is the server's, so it "
        "subtracts their updates from the sum and reads the target's binning (an upper bound)", "aggregate", 300)
declare("sum-fishing", "attacks.secure.sum_fishing:SPEC",
        "malicious server under secure aggregation: the same fishing classifier for every client (Wen et al.); the "
        "sum's mean update is the round's fished images', rebuilt", "aggregate", 1000, first_round=1)
declare("sum-labels", "attacks.secure.sum_labels:SPEC",
        "secure aggregation: the round's label histogram from the sum (class counts, or the summed classifier-bias "
        "update)", "aggregate", 1)
declare("sum-inversion", "attacks.secure.sum_inversion:SPEC",
        "secure aggregation: the round's sum inverted as one batch of every survivor's images (cosine gradient "
        "matching, TV prior)", "aggregate", 1000)
# L-BFGS iterations of each image's layer inversion
declare("sum-disaggregation", "attacks.secure.disaggregation:SPEC",
        "secure aggregation: per-client label counts and updates by least squares over many rounds' sums (gradient "
        "disaggregation), then iDLG and the closed form", "aggregate", 300)

declare_membership("lira", "attacks.membership.lira:SPEC", "online LiRA (Carlini et al. 2022) with a global variance")
declare_membership("loss", "attacks.membership.mia_threshold:LOSS",
                   "LOSS threshold (Yeom et al. 2018): low loss means member")
declare_membership("entropy", "attacks.membership.mia_threshold:ENTROPY", "modified entropy (Song & Mittal 2021)")
declare_membership("population", "attacks.membership.mia_threshold:POPULATION",
                   "Attack-P: the loss against the client's population losses")
declare_membership("rmia", "attacks.membership.rmia:SPEC",
                   "offline RMIA (Zarifzadeh et al. 2024): likelihood ratio against the population, OUT references")

# the public names whose modules import torch: each imported on first use (PEP 562)
_LAZY = {"AttackResult": "attacks.base", "Budget": "attacks.base", "LocalHyperparameters": "attacks.base",
         "NotApplicable": "attacks.base", "Observation": "attacks.base", "Batch": "attacks.inversion.batching",
         "plan_one_by_one": "attacks.inversion.batching", "run_plan": "attacks.inversion.batching"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def plan(name: str, observations: Sequence[Observation], budget: Budget, mode: str = "auto",
         batched: bool = True) -> tuple[list[Batch], dict[int, NotApplicable]]:
    """How ``attack_many`` runs ``observations``: ``(batches, failed)``. Each ``Batch`` is one
    optimisation (targets sharing a model, for the gradient attacks; one target otherwise) that a
    harness may run anywhere (e.g. as a Ray task) with the same numbers; ``failed`` maps the
    positions of targets with nothing to attack to their ``NotApplicable``."""
    from .inversion.batching import plan_one_by_one

    spec = get(name)
    if spec.plan is None:
        return plan_one_by_one(spec.attack_one, observations, budget)
    return spec.plan(observations, budget, mode, batched)


def attack_many(name: str, observations: Sequence[Observation], budget: Budget, seeds: Sequence[int],
                mode: str = "auto", batched: bool = True) -> list[AttackResult | NotApplicable]:
    """Attack ``name`` on every observation (seed i for observation i): one result per observation,
    or the ``NotApplicable`` it raised. ``batched`` lets the gradient attacks optimise the targets
    that share a model together (each evaluation equal to one by one to float rounding; a stalled
    optimisation can end in another local minimum)."""
    from .inversion.batching import run_plan

    batches, failed = plan(name, observations, budget, mode, batched)
    return run_plan(batches, failed, seeds, len(observations))


__all__ = ["ATTACKS", "AUGMENTATION_MODELS", "KINDS", "MEMBERSHIP", "MODES", "STARTS", "AttackResult", "AttackSpec",
           "Batch", "Budget", "ClientAttackSpec", "CraftingSpec", "LocalHyperparameters", "MaliciousRoundSpec",
           "MaliciousSpec", "MembershipSpec", "NotApplicable", "Observation", "RoundAttackSpec", "attack_many",
           "declare", "declare_membership", "get", "names", "plan", "plan_one_by_one", "register", "run_plan",
           "unregister"]
