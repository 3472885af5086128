"""Attacks on what the channel carried. Every attack is ``attack(observation, budget, seed) -> AttackResult``
(see ``attacks.base``); gradient attacks also take ``mode`` (auto, replay, scaled).

``ATTACKS`` maps the CLI names to the one-target functions. ``attack_many`` runs an attack on a
list of observations: the gradient attacks batch the targets that share a model
(``attacks.batching``), the others run one by one.
"""
from __future__ import annotations

from typing import Sequence

from . import dlg as _dlg, ig as _ig  # the submodules keep their names: attacks.dlg is the module
from .base import AttackResult, Budget, LocalHyperparameters, NotApplicable, Observation
from .batching import build_each, group_by_model
from .observation import GradientMatcher
from .labels import label_inference, score_label_distribution
from .proto import prototype_inversion

GRADIENT_ATTACKS = ("dlg", "idlg", "ig")

ATTACKS = {"dlg": _dlg.dlg, "idlg": _dlg.idlg, "ig": _ig.inverting_gradients, "proto": prototype_inversion,
           "labels": label_inference}
_MANY = {"dlg": _dlg.dlg_many, "idlg": _dlg.idlg_many, "ig": _ig.inverting_gradients_many}


def plan_batches(name: str, observations: Sequence[Observation], mode: str = "auto",
                 batched: bool = True) -> list[list[int]]:
    """How ``attack_many`` would group ``observations``: index lists, each attacked in one optimisation
    (targets sharing a model, for the gradient attacks; one each otherwise). A harness can hand each
    group to ``attack_many`` separately (e.g. as parallel tasks) and get the same numbers."""
    if name not in _MANY or not batched:
        return [[i] for i in range(len(observations))]
    matchers = build_each(lambda obs: GradientMatcher(obs, mode), observations)
    usable = [m if isinstance(m, GradientMatcher) else None for m in matchers]
    groups = group_by_model(usable) + [[i] for i, m in enumerate(usable) if m is None]
    return sorted(groups)


def attack_many(name: str, observations: Sequence[Observation], budget: Budget, seeds: Sequence[int],
                mode: str = "auto", batched: bool = True) -> list[AttackResult | NotApplicable]:
    """``ATTACKS[name]`` on every observation (seed i for observation i): one result per observation,
    or the ``NotApplicable`` it raised. ``batched`` lets the gradient attacks optimise the targets
    that share a model together (each evaluation equal to one by one to float rounding; a stalled
    optimisation can end in another local minimum)."""
    if name in _MANY:
        return _MANY[name](observations, budget, seeds, mode=mode, batched=batched)
    out: list[AttackResult | NotApplicable] = []
    for obs, seed in zip(observations, seeds):
        try:
            out.append(ATTACKS[name](obs, budget, seed))
        except NotApplicable as exc:
            out.append(exc)
    return out


__all__ = ["ATTACKS", "GRADIENT_ATTACKS", "AttackResult", "Budget", "LocalHyperparameters", "NotApplicable",
           "Observation", "attack_many", "plan_batches", "score_label_distribution"]
