"""The one Adam loop of the inversion attacks: Adam on the sign of the gradient (Geiping et al., 2020),
the learning rate × ``gamma`` at fixed fractions of the budget, the pixels projected onto [0, 1] after
every step.

``run_adam`` optimises one stack of variables (images first) that may hold several independent
targets, each with its own objective value: Adam and the sign act element-wise, so a stack is one
optimisation per target. With a ``stall_tolerance`` a target stops at a non-finite objective, or, once
the learning rate is at its last value, when its best objective improved by less than the tolerance
over a window of max(10, iterations / 20) steps (it stopped moving); a stopped target keeps the iterate
it stopped at while the others go on, and the loop ends when every target stopped.
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
    (every step of the budget is taken)."""

    lr: float
    stall_tolerance: float | None = None
    gamma: float = 0.1
    fractions: tuple[float, ...] = MILESTONES


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
    opt = torch.optim.Adam(variables, lr=adam.lr)
    marks = milestones(iterations, adam.fractions)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=marks, gamma=adam.gamma)
    watch = adam.stall_tolerance is not None
    window, last_phase = max(10, iterations // 20), marks[-1]
    run, stopped, best, checkpoint = AdamRun(0), None, None, None
    for it in range(iterations):
        values, grads = evaluate()
        if stopped is None:
            stopped = torch.zeros(values.shape, dtype=torch.bool, device=values.device)
            run.history = [[] for _ in range(len(values))]
            best = torch.full_like(values, float("inf"))
            checkpoint = best.clone()
        run.values = values
        if watch:
            newly = ~torch.isfinite(values) & ~stopped
            for j in torch.nonzero(newly).flatten().tolist():
                if on_nonfinite is not None:
                    on_nonfinite(j, it)
            stopped |= newly
            best = torch.minimum(best, torch.where(torch.isfinite(values), values, best))
            if it >= last_phase and (it - last_phase) % window == 0:
                stopped |= best > (1 - adam.stall_tolerance) * checkpoint  # no longer moving
                checkpoint = best.clone()
            if bool(stopped.all()):
                break
        run.steps = it + 1
        _step(opt, sched, variables, grads, stopped if watch and bool(stopped.any()) else None)
        if it % max(1, iterations // 50) == 0:
            for j, value in enumerate(values.tolist()):
                if not stopped[j]:
                    run.history[j].append(value)
    return run


def _step(opt: torch.optim.Optimizer, sched, variables: list[torch.Tensor], grads: list,
          stopped: torch.Tensor | None) -> None:
    """One signed step, the schedule's step, the projection; targets in ``stopped`` keep their iterate."""
    kept = [v.detach().clone() for v in variables] if stopped is not None else None
    for v, g in zip(variables, grads):
        if g is not None:
            v.grad = g.sign()
    opt.step()
    sched.step()
    project_(variables[0])
    if kept is not None:
        with torch.no_grad():
            for v, old in zip(variables, kept):
                v[stopped] = old[stopped]
