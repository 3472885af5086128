"""A linear layer's inputs: reading them off a model, matching recovered ones to the truth, and the images
behind exact ones. Shared by every attack that first recovers a layer's input in closed form (a malicious
server's trap or binning readout, SPEAR, the closed-form stage of the gradient attacks, gradient
disaggregation) and then has to go back through the layers below it.

``invert_layer_inputs``: L-BFGS with a strong-Wolfe line search on the images' logits (so the pixels stay in
(0, 1)) from a start image, the squared relative error of each image's layer input plus ``TV_WEIGHT`` × total
variation (its summed form). (The weight was chosen on the data set's first 8 images through the default
CNN: 19.5 dB against the mean image's 10.4 dB, where Adam with the same budget reached 11-13 dB.) The
L-BFGS run and the prior are the inversion template's (``attacks.inversion.optimise``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from .optimise import LBFGS, TotalVariation, run_lbfgs

TV_WEIGHT = 3e-4
PRIOR = TotalVariation(TV_WEIGHT, "sum")
# one L-BFGS step whose inner iterations are the budget's
OPTIMISER = LBFGS(lr=1, history_size=50, line_search="strong_wolfe")


def invert_layer_inputs(layer_inputs: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                        start: torch.Tensor, iterations: int) -> torch.Tensor:
    """(m, C, H, W) images in [0, 1] whose layer inputs ``layer_inputs(x)`` (m, d) approach ``targets``
    (m, d), from ``start`` (C, H, W) for every image, ``iterations`` L-BFGS iterations."""
    logits = torch.logit(start.clamp(0.02, 0.98)).expand(len(targets), *start.shape).clone().requires_grad_(True)
    target = targets.detach()
    scale = target.norm(dim=1).clamp_min(1e-12)

    def objective() -> torch.Tensor:
        x = torch.sigmoid(logits)
        got = layer_inputs(x)
        return (((got - target).norm(dim=1) / scale) ** 2).sum() + PRIOR(x)

    run_lbfgs(OPTIMISER, [logits], objective, max_iter=iterations)
    return torch.sigmoid(logits).detach()


def layer_module(model: nn.Module, layer: str) -> nn.Linear:
    return model.get_submodule(layer)


def layer_inputs(model: nn.Module, layer: str, images: torch.Tensor) -> torch.Tensor:
    """(n, d) inputs of ``layer`` for ``images`` (in [0, 1]) under ``model``'s current weights."""
    seen: list[torch.Tensor] = []
    handle = layer_module(model, layer).register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model.features(images)
    finally:
        handle.remove()
    return seen[0].reshape(len(images), -1)


def load(model: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """``model`` with every parameter named in ``tensors`` set to it (in place)."""
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            if name in own:
                own[name].copy_(value)
    return model


def relative_errors(candidates: torch.Tensor, truths: torch.Tensor) -> torch.Tensor:
    """(m, n) ‖candidate − truth‖ / ‖truth‖."""
    return torch.cdist(candidates.double(), truths.double()) / truths.double().norm(dim=1).clamp_min(1e-12)[None, :]


def match_inputs(candidates: torch.Tensor, truths: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """For each truth (n, d): the index of its matched candidate (−1: none left) and its relative
    error (inf where unmatched), one-to-one by ``linear_sum_assignment`` on the relative errors."""
    n = len(truths)
    chosen, errors = np.full(n, -1), np.full(n, np.inf)
    if len(candidates) == 0 or n == 0:
        return chosen, errors
    cost = relative_errors(candidates, truths).numpy()
    rows, cols = linear_sum_assignment(cost)
    chosen[cols], errors[cols] = rows, cost[rows, cols]
    return chosen, errors


def first_layer_sees_pixels(model: torch.nn.Module, layer: str) -> bool:
    """True when only a flatten comes before ``layer``: its input is the normalised image."""
    before = []
    for name, module in model.extractor.named_children():
        if f"extractor.{name}" == layer:
            break
        before.append(module)
    return all(isinstance(m, torch.nn.Flatten) for m in before)


def layer_inputs_differentiable(model: torch.nn.Module, layer: str, images: torch.Tensor) -> torch.Tensor:
    """``layer_inputs`` with the graph kept (the layers before ``layer``, applied in order)."""
    x = model.normalize(images)
    for name, module in model.extractor.named_children():
        if f"extractor.{name}" == layer:
            return x.reshape(len(images), -1)
        x = module(x)
    raise ValueError(f"{layer} is not a direct child of the extractor")
