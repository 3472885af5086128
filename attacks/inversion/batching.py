"""Attacking many targets at once: the pieces the batched gradient attacks share.

Targets whose dummy quantity is the same function of (x, y) — same before-state, attacked
parameters, mode and hyperparameters (``GradientMatcher.shares_model_with``), e.g. every client
of round 0, or every client answering the same FedAvg download — are attacked in one optimisation
over a stacked batch of independent reconstructions. Each target's objective depends only on its
own variables, so ``torch.func.vmap`` over ``torch.func.grad_and_value`` of the one-target
objective gives every target's value and gradient in one call, numerically equal (to float
rounding) to computing them one by one.

How the optimiser is batched depends on the attack (the optimisers are the inversion template's,
``attacks.inversion.optimise``):

* Adam (Inverting Gradients) is element-wise: one Adam over the stacked variables *is* one Adam per
  target (``attacks.inversion.ig``).
* L-BFGS (DLG, iDLG) is not: its history and step size couple all the variables it optimises.
  ``BatchedLBFGS`` is torch's L-BFGS with one state per target and the arithmetic vectorised over
  the targets; every running target takes part in every batched evaluation (``attacks.inversion.dlg``).

Equal "to float rounding" is all one can promise: batched kernels round differently from
one-image kernels (≈1e-7 relative on the objective and its gradient). Where an optimisation
converges, the results agree; where it stalls (DLG on the ``cnn28`` model), rounding can steer it
to a different local minimum, so such runs differ target by target in both directions.
A run is reproducible: the same targets give the same batches.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..base import NotApplicable

# targets per batched optimisation: memory grows linearly with it, throughput stops improving
MAX_BATCH = 32


@dataclass
class Batch:
    """Targets attacked in one optimisation: their positions in the planned list, and the work.
    ``work(seeds)`` returns one result per target; it is a ``functools.partial`` of module-level
    functions over the targets' prepared setups, so a backend can ship it to another process."""

    indices: list[int]
    work: Callable[[list[int]], list]

    def run(self, seeds: Sequence[int]) -> list:
        return self.work(list(seeds))


def build_each(build: Callable[[object], object], observations: Sequence) -> list:
    """``build(obs)`` for every observation; where it raises ``NotApplicable``, the exception instead
    (so one target with nothing to attack does not stop the others)."""
    out = []
    for obs in observations:
        try:
            out.append(build(obs))
        except NotApplicable as exc:
            out.append(exc)
    return out


def group_by_model(matchers: Sequence, max_batch: int = MAX_BATCH, batched: bool = True) -> list[list[int]]:
    """Indices of ``matchers`` in groups that share a model (in order, at most ``max_batch`` each;
    one per group when ``batched`` is False). Entries that are ``None`` are left out. Candidates are
    bucketed by ``GradientMatcher.model_key`` first, so the tensors are compared only within a bucket."""
    groups: list[list[int]] = []
    buckets: dict[tuple, list[list[int]]] = {}
    for i, matcher in enumerate(matchers):
        if matcher is None:
            continue
        if not batched:
            groups.append([i])
            continue
        candidates = buckets.setdefault(matcher.model_key, [])
        for group in candidates:
            if len(group) < max_batch and matchers[group[0]].shares_model_with(matcher):
                group.append(i)
                break
        else:
            candidates.append([i])
            groups.append(candidates[-1])
    return groups


def plan_by_model(prepare: Callable[[object], object], optimise: Callable[[list, list[int]], list],
                  observations: Sequence, batched: bool = True) -> tuple[list[Batch], dict[int, NotApplicable]]:
    """The batched attacks' plan: ``prepare(obs)`` each target once (an object with a ``matcher``),
    group the targets that share a model (one per group unless ``batched``), one ``Batch`` per
    group running ``optimise(setups, seeds)``. Targets whose ``prepare`` raised ``NotApplicable``
    are returned apart, by position."""
    setups = build_each(prepare, observations)
    failed = {i: s for i, s in enumerate(setups) if isinstance(s, NotApplicable)}
    groups = group_by_model([None if i in failed else s.matcher for i, s in enumerate(setups)], batched=batched)
    # one stacked optimisation holds fixed labels or label logits, not both: targets of one model whose
    # labels were read (iDLG, counts) and targets whose labels are optimised run apart
    groups = [part for group in groups for part in
              ([i for i in sorted(group) if setups[i].labels is not None], [i for i in sorted(group) if setups[i].labels is None])
              if part]
    batches = [Batch(sorted(group), functools.partial(optimise, [setups[i] for i in sorted(group)])) for group in groups]
    return sorted(batches, key=lambda b: b.indices), failed


def _attack_alone(attack_one: Callable, observation, budget, seeds: list[int]) -> list:
    try:
        return [attack_one(observation, budget, seeds[0])]
    except NotApplicable as exc:
        return [exc]


def plan_one_by_one(attack_one: Callable, observations: Sequence, budget) -> tuple[list[Batch], dict]:
    """The plan of an attack without a batched form: one ``Batch`` per target (``NotApplicable``
    comes back as that target's result)."""
    return [Batch([i], functools.partial(_attack_alone, attack_one, obs, budget))
            for i, obs in enumerate(observations)], {}


def run_plan(batches: Sequence[Batch], failed: dict, seeds: Sequence[int], count: int) -> list:
    """Run every batch here, in order: one result (or ``NotApplicable``) per target."""
    results: list = [failed.get(i) for i in range(count)]
    for batch in batches:
        for i, result in zip(batch.indices, batch.run([seeds[i] for i in batch.indices])):
            results[i] = result
    return results


def stack_targets(targets: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Per-target lists of tensors → one list of stacked tensors (target along dim 0)."""
    return [torch.stack([t[j] for t in targets]) for j in range(len(targets[0]))]
