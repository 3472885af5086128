"""Attacking many targets at once: the pieces the batched gradient attacks share.

Targets whose dummy quantity is the same function of (x, y) — same before-state, attacked
parameters, mode and hyperparameters (``GradientMatcher.shares_model_with``), e.g. every client
of round 0, or every client answering the same FedAvg download — are attacked in one optimisation
over a stacked batch of independent reconstructions. Each target's objective depends only on its
own variables, so ``torch.func.vmap`` over ``torch.func.grad_and_value`` of the one-target
objective gives every target's value and gradient in one call, numerically equal (to float
rounding) to computing them one by one.

How the optimiser is batched depends on the attack:

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


class BatchedLBFGS:
    """torch.optim.LBFGS (``line_search_fn=None``) run on K independent problems at once.

    torch's L-BFGS couples every variable it is given (one history, one step size), so K
    reconstructions cannot share one torch optimiser. This class keeps torch's algorithm and its
    defaults (``max_iter`` 20 inner iterations per step, ``max_eval`` = max_iter·5/4, ``tolerance_grad``
    1e-7, ``tolerance_change`` 1e-9, ``history_size`` 100, curvature pairs kept when yᵀs > 1e-10, first
    step length min(1, 1/‖g‖₁)·lr), with one state per problem and the two-loop recursion vectorised
    over the problems (a problem with a shorter history meets all-zero pairs, exact no-ops). Each
    problem is driven by its own evaluations, so every problem follows the iterates torch's optimiser
    would give it alone (to float rounding); the tests check this against torch on smooth problems.

    Protocol: ``start(k, x0)`` (re)starts problem k; ``pending()`` lists the running problems, each
    waiting for the objective and gradient at its ``x[k]``; ``tell(ks, losses, grads)`` hands them over
    and returns the problems whose *step* (one ``opt.step(closure)`` of torch) ended with it; the
    caller decides whether such a problem goes on (it then needs the next evaluation, as torch's next
    step starts with one) or ``stop(k)``.
    """

    def __init__(self, problems: int, size: int, lr: float = 1.0, max_iter: int = 20, max_eval: int | None = None,
                 tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9, history_size: int = 100,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        k, n = int(problems), int(size)
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.lr, self.max_iter = float(lr), int(max_iter)
        self.max_eval = int(max_eval) if max_eval is not None else self.max_iter * 5 // 4
        self.tolerance_grad, self.tolerance_change, self.history_size = tolerance_grad, tolerance_change, history_size
        self.x = zeros(k, n)
        self._g, self._prev_g, self._d = zeros(k, n), zeros(k, n), zeros(k, n)
        self._y, self._s = zeros(k, history_size, n), zeros(k, history_size, n)
        self._ro, self._h = zeros(k, history_size), torch.ones(k, dtype=dtype, device=device)
        self._length = [0] * k
        self._t = [0.0] * k
        self._loss, self._prev_loss = [0.0] * k, [0.0] * k
        self._running = [False] * k
        self._in_step = [False] * k  # False: the next evaluation opens a step (torch's orig_loss)
        self._n_iter, self._total_iter, self._evals = [0] * k, [0] * k, [0] * k

    def start(self, k: int, x0: torch.Tensor) -> None:
        self.x[k] = x0.reshape(-1)
        self._length[k], self._total_iter[k] = 0, 0
        # unused history slots stay exactly zero: the two-loop recursion then needs no mask
        self._y[k].zero_()
        self._s[k].zero_()
        self._ro[k].zero_()
        self._running[k], self._in_step[k] = True, False

    def stop(self, k: int) -> None:
        self._running[k] = False

    def pending(self) -> list[int]:
        return [k for k, running in enumerate(self._running) if running]

    def tell(self, ks: list[int], losses: list[float], grads: torch.Tensor) -> list[int]:
        ended: list[int] = []
        iterate: list[int] = []
        for j, k in enumerate(ks):
            self._g[k] = grads[j]
            self._loss[k] = float(losses[j])
            converged = float(grads[j].abs().max()) <= self.tolerance_grad
            if not self._in_step[k]:  # the evaluation that opens a step
                self._evals[k], self._n_iter[k] = 1, 0
                if converged:
                    ended.append(k)
                    continue
                self._in_step[k] = True
                iterate.append(k)
                continue
            self._evals[k] += 1
            if (self._evals[k] >= self.max_eval or converged
                    or float((self._d[k] * self._t[k]).abs().max()) <= self.tolerance_change
                    or abs(self._loss[k] - self._prev_loss[k]) < self.tolerance_change):
                self._in_step[k] = False
                ended.append(k)
                continue
            iterate.append(k)
        if iterate:
            ended += self._iterate(iterate)
        return sorted(ended)

    def _iterate(self, ks: list[int]) -> list[int]:
        """One inner iteration of torch's step for each of ``ks``: direction, step length, move."""
        for k in ks:
            self._n_iter[k] += 1
            self._total_iter[k] += 1
        first = [k for k in ks if self._total_iter[k] == 1]
        rest = [k for k in ks if self._total_iter[k] > 1]
        for k in first:
            self._d[k] = -self._g[k]
            self._length[k], self._h[k] = 0, 1.0
        if rest:
            self._direction(rest)
        ended = []
        for k in ks:
            self._prev_g[k] = self._g[k]
            self._prev_loss[k] = self._loss[k]
            if self._total_iter[k] == 1:
                self._t[k] = min(1.0, 1.0 / float(self._g[k].abs().sum())) * self.lr
            else:
                self._t[k] = self.lr
            if float(self._g[k].dot(self._d[k])) > -self.tolerance_change:
                self._in_step[k] = False
                ended.append(k)
                continue
            self.x[k] += self._t[k] * self._d[k]
            if self._n_iter[k] == self.max_iter:  # torch moves but does not evaluate, and ends the step
                self._in_step[k] = False
                ended.append(k)
        return ended

    def _direction(self, ks: list[int]) -> None:
        index = torch.tensor(ks, device=self._g.device)
        g = self._g[index]
        y = g - self._prev_g[index]
        s = self._d[index] * torch.tensor([self._t[k] for k in ks], dtype=self._d.dtype,
                                          device=self._d.device).unsqueeze(1)
        ys = (y * s).sum(dim=1)
        yy = (y * y).sum(dim=1)
        for j, k in enumerate(ks):
            if float(ys[j]) > 1e-10:  # keep the curvature pair, dropping the oldest when full
                n = self._length[k]
                if n == self.history_size:
                    self._y[k, :-1] = self._y[k, 1:].clone()
                    self._s[k, :-1] = self._s[k, 1:].clone()
                    self._ro[k, :-1] = self._ro[k, 1:].clone()
                    n -= 1
                self._y[k, n], self._s[k, n], self._ro[k, n] = y[j], s[j], 1.0 / ys[j]
                self._length[k] = n + 1
                self._h[k] = ys[j] / yy[j]
        longest = max(self._length[k] for k in ks)
        ys_, ss_, ro = self._y[index, :longest], self._s[index, :longest], self._ro[index, :longest]
        # a problem with fewer pairs meets zero pairs (y = s = 0, ρ = 0): its α and β are exactly 0
        q = -g
        alphas: list[torch.Tensor] = [None] * longest  # type: ignore[list-item]
        for i in range(longest - 1, -1, -1):  # newest pair first
            alphas[i] = torch.linalg.vecdot(ss_[:, i], q) * ro[:, i]
            q = torch.addcmul(q, alphas[i].unsqueeze(1), ys_[:, i], value=-1.0)
        r = q * self._h[index].unsqueeze(1)
        for i in range(longest):  # oldest pair first
            beta = torch.linalg.vecdot(ys_[:, i], r) * ro[:, i]
            r = torch.addcmul(r, (alphas[i] - beta).unsqueeze(1), ss_[:, i])
        self._d[index] = r
