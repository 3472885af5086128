"""The polish of the inversion attacks (IG's final stage, ``attacks.inversion.ig``; fedavg-leak's): the
data term alone, from each target's kept start, with scipy's bounded quasi-Newton method (L-BFGS-B) and
a continuation over the model's kinks.

Why: the first stage (signed Adam with a TV prior) ends near the truth but not at it. The TV prior
pulls away from the truth along the directions the cosine barely sees (the image's contrast), and
the data term (the replayed update against the observed one) jumps where an activation's slope or a
max-pool's winner changes, so a local method from there stops at the edge of its piece (an L-BFGS
polish of the exact data term from IG's end points barely moved it).

What: for ``temperature`` in ``TEMPERATURES``, the data term with the model's kinks smoothed at that
temperature (``attacks.inversion.smoothing``; 0 = the exact model) is minimised by scipy's L-BFGS-B
within the pixel bounds [0, 1] (most of a digit's pixels sit on the bound 0, which a bound-aware
method keeps exactly), from the current images, for at most ``iterations`` iterations or until the
objective stops falling (``ftol``); a target whose data term is at the forward check's floor takes
no further temperature. The targets are one separable problem: the sum of their data
terms, each divided by its value at the temperature's start, so that every target counts alike. A
target takes the new images only where its **exact** data term fell: the stage never raises it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy.optimize import minimize

from ..smoothing import smoothed

# the continuation, chosen on the tuning federation (seed 1, FedPAC round 0, 8
# targets): with 25 iterations each, (0.003, 0.001, exact) took 1 of 8 data terms to ≤ 1e-6 and
# (0.003, 0.001, 0.0003, exact) 2; starting at 0.1 moved far from the first stage's images (≈ 28 dB at
# data terms of 1e-5); the exact model alone (L-BFGS-B) left 8 of 8 where they were
TEMPERATURES = (0.003, 0.001, 0.0003, 0.0)
# L-BFGS-B iterations per temperature = the first stage's iterations / ITERATION_SHARE (1000 → 25)
ITERATION_SHARE = 40
STOP_TOLERANCE = 1e-12  # scipy's ftol: the weighted sum's relative fall below which a temperature ends


@dataclass
class FinalStage:
    """The stage's outcome for the stacked targets: their images, data terms before and after
    (per target), and the evaluations it took (of all targets at once)."""

    images: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor
    evaluations: int


Evaluate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def polish(evaluate: Evaluate, model: torch.nn.Module, images: torch.Tensor, iterations: int,
           temperatures=TEMPERATURES, floor: float = 0.0) -> FinalStage:
    """The final stage (module docstring). ``evaluate(x, rows)`` gives (data terms (m,), their gradients
    in x) for the stacked images x (m, ...) of the targets ``rows`` (indices into ``images``), through
    ``model`` (whose kinks are smoothed in place). A target whose data term is at or below ``floor``
    (the forward check's: float rounding) takes no further temperature."""
    counter = [0]
    every = torch.arange(images.shape[0], device=images.device)
    before = evaluate(images, every)[0].detach()
    counter[0] += 1
    x, kept = images.detach().clone(), before.clone()
    for temperature in temperatures:
        rows = every[kept > floor]
        if len(rows) == 0:
            break
        with smoothed(model, temperature):
            candidate = _minimise(lambda v: evaluate(v, rows), x[rows], iterations, counter)
        value = evaluate(candidate, rows)[0].detach()
        counter[0] += 1
        better = torch.isfinite(value) & (value < kept[rows])
        x[rows] = torch.where(better.view(-1, *[1] * (x.dim() - 1)), candidate, x[rows])
        kept[rows] = torch.where(better, value, kept[rows])
    return FinalStage(x, before, kept, counter[0])


def _minimise(evaluate: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
              iterations: int, counter: list[int]) -> torch.Tensor:
    """L-BFGS-B on Σ_j f_j(x_j) / f_j(x⁰_j) within [0, 1], from x⁰ = ``x``."""
    start = evaluate(x)[0].detach()
    counter[0] += 1
    weights = torch.where(torch.isfinite(start) & (start > 0), 1.0 / start.clamp_min(1e-30), torch.zeros_like(start))
    shape, like = x.shape, {"dtype": x.dtype, "device": x.device}
    view = (-1, *[1] * (x.dim() - 1))

    def value_and_gradient(flat: np.ndarray):
        counter[0] += 1
        values, gradients = evaluate(torch.as_tensor(flat, **like).reshape(shape))
        total = float((weights * values).sum())
        if not np.isfinite(total):  # a step into a non-finite region: the line search backs off
            return float("inf"), np.zeros_like(flat)
        return total, (weights.view(view) * gradients).detach().double().cpu().numpy().ravel()

    result = minimize(value_and_gradient, x.detach().double().cpu().numpy().ravel(), jac=True, method="L-BFGS-B",
                      bounds=[(0.0, 1.0)] * x.numel(),
                      options={"maxiter": iterations, "maxfun": 2 * iterations + 5, "maxcor": 20,
                               "ftol": STOP_TOLERANCE, "gtol": 0.0})
    return torch.as_tensor(result.x, **like).reshape(shape)
