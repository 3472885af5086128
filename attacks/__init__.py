"""Attacks on what the channel carried.

Every attack is declared once as an ``AttackSpec`` in the registry (``attacks.registry``): its
one-target function ``attack(observation, budget, seed) -> AttackResult`` (see ``attacks.base``),
how it plans many targets, its kind and defaults, which uploads it applies to and how its result
is scored (``attacks.metrics``). Importing this package registers the attacks below.

Membership-inference attacks (``fedsec mia``) score records from a model's outputs instead; they
register a ``MembershipSpec`` (``register_membership``) the same way.

The families are folders: ``attacks.inversion`` (a curious server rebuilds images or labels from an
upload), ``attacks.membership`` (membership inference and its scoring) and ``attacks.malicious`` (a
server that crafts the download), and ``attacks.secure`` (round-level attacks on what a server under
secure aggregation holds: each round's sum, run by ``attacks.secure.harness``). Shared by all: ``base``,
``registry``, ``metrics``, ``statistics``, and the harness that attacks a recorded run (``recorded``:
``RecordedRun``, ``ThreatModel``; ``harness``: ``attack_recorded``).

Adding an attack: one file in its family's folder that defines its functions and calls
``register(AttackSpec(...))`` (or ``register_membership``), plus one import line here. An attack module
imports no other attack module; an inversion attack declares its objective, optimiser, prior and budget
over the optimisation template (``attacks.inversion.optimise``).
"""
from __future__ import annotations

from typing import Sequence

# each module registers its attacks on import. No attack module imports another (what a family shares
# lives in modules named for what it does, e.g. ``attacks.inversion.optimise``), so any order imports;
# the order here is only the one the registry lists them in (the CLI's choices, a report's columns)
from .inversion import dlg, ig, proto, labels  # noqa: F401
from . import malicious  # noqa: F401
from .membership import lira, mia_threshold, rmia  # noqa: F401
from .inversion import fedavg_leakage  # noqa: F401
from .inversion import spear  # noqa: F401
from .secure import sum_binning, inconsistency, sybil, sum_fishing, sum_labels, sum_inversion, disaggregation  # noqa: F401  (secure aggregation)
from .base import AttackResult, Budget, LocalHyperparameters, NotApplicable, Observation
from .inversion.batching import Batch, plan_one_by_one, run_plan
from .registry import ATTACKS, MEMBERSHIP, AttackSpec, MembershipSpec, get, names, register, unregister


def plan(name: str, observations: Sequence[Observation], budget: Budget, mode: str = "auto",
         batched: bool = True) -> tuple[list[Batch], dict[int, NotApplicable]]:
    """How ``attack_many`` runs ``observations``: ``(batches, failed)``. Each ``Batch`` is one
    optimisation (targets sharing a model, for the gradient attacks; one target otherwise) that a
    harness may run anywhere (e.g. as a Ray task) with the same numbers; ``failed`` maps the
    positions of targets with nothing to attack to their ``NotApplicable``."""
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
    batches, failed = plan(name, observations, budget, mode, batched)
    return run_plan(batches, failed, seeds, len(observations))


__all__ = ["ATTACKS", "MEMBERSHIP", "MembershipSpec", "AttackResult", "AttackSpec", "Batch", "Budget", "LocalHyperparameters", "NotApplicable",
           "Observation", "attack_many", "get", "names", "plan", "register", "unregister"]
