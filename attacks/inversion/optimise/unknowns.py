"""The fit of a forward model's unknown parameters with the images held fixed: what the forward check
(``attacks.inversion.forward_check``) does to judge the fitted model at the truth, where the attack fitted
parts the server does not hold (a private head after round 0) jointly with its images. L-BFGS with a
strong-Wolfe line search from each given start; the lowest objective kept."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .lbfgs import LBFGS, run_lbfgs

# L-BFGS steps of 10 inner iterations; a start's iterations are ``IMAGE_PASSES`` over the images one
# evaluation replays (the client's whole local training: a few on a textbook client, hundreds on a real
# one), between ``MIN_ITERATIONS`` and ``MAX_ITERATIONS``. A fit that falls short errs towards
# MIS-SPECIFIED (``attacks.inversion.forward_check``): measured on a FedPer client of 50 images at round 19
# (5 steps), 30 iterations per start left the truth's term above the reconstruction's, 200 below it
FIT = LBFGS(lr=1, max_iter=10, history_size=50, line_search="strong_wolfe", tolerance_grad=1e-12,
            tolerance_change=1e-15)
IMAGE_PASSES = 10_000
MIN_ITERATIONS, MAX_ITERATIONS = 20, 200


def iterations_for(images: int) -> int:
    """L-BFGS iterations per start for an objective that replays ``images`` images."""
    return int(min(MAX_ITERATIONS, max(MIN_ITERATIONS, IMAGE_PASSES // max(1, int(images)))))


def fit_unknowns(objective: Callable[[torch.Tensor], torch.Tensor], starts: Sequence[torch.Tensor],
                 iterations: int = MAX_ITERATIONS) -> tuple[torch.Tensor, float]:
    """(u, objective(u)) at the lowest objective reached from ``starts`` (each a flat tensor) by up to
    ``iterations`` L-BFGS iterations each; a start whose objective turns non-finite keeps its best
    iterate before it."""
    steps = max(1, -(-int(iterations) // FIT.max_iter))
    best_u, best = None, float("inf")
    for start in starts:
        u = start.detach().clone().requires_grad_(True)
        seen = {"value": float("inf"), "u": u.detach().clone()}

        def evaluate() -> torch.Tensor:
            value = objective(u)
            now = float(value.detach())
            if now == now and now < seen["value"]:  # NaN compares unequal to itself
                seen.update(value=now, u=u.detach().clone())
            return value

        with torch.enable_grad():
            run_lbfgs(FIT, [u], evaluate, steps=steps, after_step=lambda: not torch.isfinite(u).all(),
                      errors=(RuntimeError,))
        if seen["value"] < best:
            best_u, best = seen["u"], seen["value"]
    return (starts[0].detach().clone() if best_u is None else best_u), best
