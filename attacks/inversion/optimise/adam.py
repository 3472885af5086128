"""The one Adam loop of the inversion attacks: Adam on the sign of the gradient (Geiping et al., 2020),
the learning rate × ``gamma`` at fixed fractions of the budget, the pixels projected onto [0, 1] after
every step.

``run_adam`` optimises one stack of variables (images first) that may hold several independent
targets, each with its own objective value: Adam and the sign act element-wise, so a stack is one
optimisation per target. With a ``stall_tolerance`` a target stops at a non-finite objective; and
once the learning rate has dropped ``stall_after_drops`` times (default: every drop, its last value),
a target whose best objective improved by less than the tolerance over a window of max(10,
iterations / 20) steps (it stopped moving) takes its next drop there, or, in the last phase, stops.
Each target thus has its own learning rate (torch's Adam arithmetic, per target). A stopped target
keeps the iterate it stopped at while the others go on, and the loop ends when every target stopped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .priors import project_

MILESTONES = (3 / 8, 5 / 8, 7 / 8)


def milestones(iterations: int, fractions: tuple[float, ...] = MILESTONES) -> list[int]:
    """The steps after which the learning rate drops."""
    return sorted({max(1, int(iterations * f)) for f in fractions})


@dataclass(frozen=True)
class SignedAdam:
    """An attack's Adam: learning rate ``lr`` (in pixel units), × ``gamma`` after each milestone
    (``fractions`` of the budget), on the sign of the gradient; ``stall_tolerance`` None: no stop rule
    (every step of the budget is taken); ``stall_after_drops``: the learning-rate drops after which the
    stop rule watches (None: all of them)."""

    lr: float
    stall_tolerance: float | None = None
    gamma: float = 0.1
    fractions: tuple[float, ...] = MILESTONES
    stall_after_drops: int | None = None


# Inverting Gradients' optimiser as the paper gives it (lr 0.1; classifier fishing takes it too)
IG_ADAM = SignedAdam(lr=0.1)


@dataclass
class AdamRun:
    """What ``run_adam`` did: the steps taken, each target's objective every iterations / 50 steps while
    it ran, and the values of the last evaluation (None: no evaluation)."""

    steps: int
    history: list[list[float]] = field(default_factory=list)
    values: torch.Tensor | None = None


Evaluate = Callable[[], tuple[torch.Tensor, list]]


def run_adam(adam: SignedAdam, variables: list[torch.Tensor], evaluate: Evaluate, iterations: int,
             on_nonfinite: Callable[[int, int], None] | None = None) -> AdamRun:
    """Optimise ``variables`` (leaves; the first holds the pixels, projected onto [0, 1]) for up to
    ``iterations`` steps. ``evaluate()`` gives (the targets' objective values (m,), the gradient of each
    variable or None where it has none); ``on_nonfinite(target, step)`` hears of a target stopped by a
    non-finite value (module docstring)."""
    opt = _StackedAdam(variables)
    marks = milestones(iterations, adam.fractions)
    watch = adam.stall_tolerance is not None
    drops = len(marks) if adam.stall_after_drops is None else max(1, min(len(marks), adam.stall_after_drops))
    window = max(10, iterations // 20)
    rates = [adam.lr]  # each phase's learning rate, multiplied out as torch's MultiStepLR does
    for _ in marks:
        rates.append(rates[-1] * adam.gamma)
    run, stopped, best, checkpoint = AdamRun(0), None, None, None
    phase = since = None  # per target: learning-rate drops taken, the step its phase began at
    for it in range(iterations):
        values, grads = evaluate()
        if stopped is None:
            stopped = torch.zeros(values.shape, dtype=torch.bool, device=values.device)
            run.history = [[] for _ in range(len(values))]
            best = torch.full_like(values, float("inf"))
            checkpoint = best.clone()
            phase, since = [0] * len(values), [0] * len(values)
        run.values = values
        scheduled = sum(1 for m in marks if m <= it)
        for j in range(len(phase)):
            if phase[j] < scheduled:
                phase[j], since[j] = scheduled, it
        if watch:
            newly = ~torch.isfinite(values) & ~stopped
            for j in torch.nonzero(newly).flatten().tolist():
                if on_nonfinite is not None:
                    on_nonfinite(j, it)
            stopped |= newly
            best = torch.minimum(best, torch.where(torch.isfinite(values), values, best))
            _watch_stalls(adam, best, checkpoint, stopped, phase, since, it, window, drops, len(marks))
            if bool(stopped.all()):
                break
        run.steps = it + 1
        for v, g in zip(variables, grads):
            if g is not None:
                v.grad = g.sign()
        opt.step([rates[p] for p in phase], stopped if watch and bool(stopped.any()) else None)
        project_(variables[0])
        if it % max(1, iterations // 50) == 0:
            for j, value in enumerate(values.tolist()):
                if not stopped[j]:
                    run.history[j].append(value)
    return run


def _watch_stalls(adam: SignedAdam, best: torch.Tensor, checkpoint: torch.Tensor, stopped: torch.Tensor,
                  phase: list[int], since: list[int], it: int, window: int, drops: int, last: int) -> None:
    """Every ``window`` steps into a target's phase (from its ``drops``-th drop on): a target whose best
    objective improved by less than the tolerance since the last look takes its next drop now, or, in
    the last phase, stops; the look's best becomes the next checkpoint (in place)."""
    for j in range(len(phase)):
        if stopped[j] or phase[j] < drops or (it - since[j]) % window:
            continue
        if it > since[j] and bool(best[j] > (1 - adam.stall_tolerance) * checkpoint[j]):  # no longer moving
            if phase[j] < last:
                phase[j], since[j] = phase[j] + 1, it
            else:
                stopped[j] = True
        checkpoint[j] = best[j]


class _StackedAdam:
    """torch's Adam (its defaults: betas 0.9, 0.999, eps 1e-8; its arithmetic) over variables that
    stack independent targets along their first dimension, with a learning rate per target; a target
    in ``stopped`` keeps its iterate and moments."""

    def __init__(self, variables: list[torch.Tensor], betas=(0.9, 0.999), eps: float = 1e-8):
        self.variables, self.betas, self.eps, self.steps = variables, betas, eps, 0
        self.moments = [(torch.zeros_like(v), torch.zeros_like(v)) for v in variables]

    @torch.no_grad()
    def step(self, lrs: list[float], stopped: torch.Tensor | None) -> None:
        self.steps += 1
        b1, b2 = self.betas
        correction1, correction2 = 1 - b1 ** self.steps, (1 - b2 ** self.steps) ** 0.5
        same = all(lr == lrs[0] for lr in lrs)
        for v, (m, s) in zip(self.variables, self.moments):
            if v.grad is None:
                continue
            kept = None if stopped is None else (v[stopped].clone(), m[stopped].clone(), s[stopped].clone())
            m.lerp_(v.grad, 1 - b1)
            s.mul_(b2).addcmul_(v.grad, v.grad, value=1 - b2)
            denom = (s.sqrt() / correction2).add_(self.eps)
            if same:
                v.addcdiv_(m, denom, value=-lrs[0] / correction1)
            else:
                size = torch.tensor(lrs, dtype=v.dtype, device=v.device).view(-1, *[1] * (v.dim() - 1))
                v.sub_(size / correction1 * m / denom)
            if kept is not None:
                v[stopped], m[stopped], s[stopped] = kept
