"""Reading a crafted download's answer back: the inputs of the crafted layer, then the images.

Pure functions of tensors: the server's ``CraftRecord`` (what it sent) and the client's upload.

A linear layer z = W a + b trained by SGD from what was sent changes by ΔW_i = −η Σ_n δ_{n,i} a_nᵀ,
Δb_i = −η Σ_n δ_{n,i} (summed over the client's steps). Binning: with σ_i·δ_{n,i} equal across
rows for every input active in both, D = σ_iΔW_i − σ_jΔW_j for neighbouring rows i < j of one sign
holds only the inputs whose projection fell between their thresholds, so D / d (the same difference
of the biases) is that input exactly when it was alone there. Plain trap: ΔW_i / Δb_i per row (a weighted mean of the inputs that
row saw, mostly one, plus the 1 % leak of the others).
"""
from __future__ import annotations

import torch

from ..inversion.layer_inputs import (first_layer_sees_pixels, invert_layer_inputs, layer_inputs,
                                      layer_inputs_differentiable, load)
from .craft import CraftRecord

# a bin (or row) counts as holding an input when its bias change is above this share of the largest
ACTIVE_SHARE = 1e-4


def recover_inputs(record: CraftRecord, upload: dict[str, torch.Tensor]) -> torch.Tensor:
    """(m, d) candidate inputs of the crafted layer, one per bin (binning) or row (plain) that saw
    any input, in row order."""
    weight, bias = f"{record.layer}.weight", f"{record.layer}.bias"
    dw = (upload[weight].double() - record.sent[weight].double()) * record.signs.double()[:, None]
    db = (upload[bias].double() - record.sent[bias].double()) * record.signs.double()
    rows = torch.cat([dw, db[:, None]], dim=1)
    if record.craft == "binning":  # rows i and i + 2 share a sign (module docstring of craft)
        bins = rows[:-2] - rows[2:]
        rows = torch.cat([bins, _cells(bins)])
    keep = rows[:, -1].abs() > ACTIVE_SHARE * float(rows[:, -1].abs().max().clamp_min(1e-30))
    candidates = rows[keep, :-1] / rows[keep, -1:]
    return _distinct(candidates).float()


def _cells(bins: torch.Tensor) -> torch.Tensor:
    """The contents of the cells between consecutive thresholds, from the bins: bin m (rows m and
    m + 2, one sign) holds cells m and m + 1, so a chain B_m = c_m + c_{m+1}. An empty bin pins both
    its cells at zero; every other cell follows from its nearest pinned neighbour along the chain
    (an input alone in its cell, half a bin, is then exact too). Unreached cells are left out."""
    count = len(bins) + 1
    scale = ACTIVE_SHARE * float(bins[:, -1].abs().max().clamp_min(1e-30))
    empty = (bins[:, -1].abs() <= scale) & (bins[:, :-1].norm(dim=1) <= ACTIVE_SHARE * float(
        bins[:, :-1].norm(dim=1).max().clamp_min(1e-30)))
    cells: list[torch.Tensor | None] = [None] * count
    frontier = []
    for m in torch.nonzero(empty).flatten().tolist():
        for k in (m, m + 1):
            if cells[k] is None:
                cells[k] = torch.zeros_like(bins[0])
                frontier.append(k)
    while frontier:  # breadth first: each cell from its nearest pinned cell
        following = []
        for k in frontier:
            for m, other in ((k, k + 1), (k - 1, k - 1)):
                if 0 <= m < len(bins) and 0 <= other < count and cells[other] is None:
                    cells[other] = bins[m] - cells[k]
                    following.append(other)
        frontier = following
    found = [c for c in cells if c is not None]
    return torch.stack(found) if found else bins[:0]


def _distinct(candidates: torch.Tensor, tolerance: float = 1e-3) -> torch.Tensor:
    """Candidates with near-duplicates (relative distance ≤ ``tolerance``) dropped: plain trap rows
    that saw the same single input give it twice."""
    kept: list[torch.Tensor] = []
    for c in candidates:
        if all(float((c - k).norm()) > tolerance * float(k.norm().clamp_min(1e-12)) for k in kept):
            kept.append(c)
    return torch.stack(kept) if kept else candidates[:0]


def rebuild_images(model: torch.nn.Module, record: CraftRecord, inputs: torch.Tensor,
                   image_shape: tuple[int, int, int], iterations: int, seed: int) -> torch.Tensor:
    """(m, C, H, W) images in [0, 1] whose crafted-layer inputs are ``inputs``: in closed form when
    the layer sees the pixels (undo the normalisation), else by inverting the layers before it (as
    sent) from the exact input (``attacks.inversion.layer_inputs``, ``iterations`` L-BFGS steps from the
    public mean image)."""
    model = load(model, record.sent)
    if len(inputs) == 0:
        return torch.zeros(0, *image_shape)
    if first_layer_sees_pixels(model, record.layer):
        x = inputs.reshape(-1, *image_shape) * model.normalize.std + model.normalize.mean
        return x.clamp(0, 1).detach()
    start = record.public_mean if record.public_mean is not None else torch.full(image_shape, 0.5)
    return invert_layer_inputs(lambda x: layer_inputs_differentiable(model, record.layer, x), inputs, start,
                               iterations)


def true_inputs(model: torch.nn.Module, record: CraftRecord, images: torch.Tensor) -> torch.Tensor:
    """(n, d) the crafted layer's inputs of ``images`` under the download as sent (for scoring)."""
    return layer_inputs(load(model, record.sent), record.layer, images)
