"""A malicious server's crafted download: weights only, the architecture the client expects.

Pure functions of tensors: the honest download, a model of the federation's architecture (for
shapes and the layers before the crafted one) and public images the server holds.

Both crafts rewrite the first linear layer of the extractor (``extractor.fc`` of the CNNs, the
first layer of ``mlp``), leaving the layers before it as sent:

* ``binning`` (Fowl et al., "Robbing the Fed", ICLR 2022, weights only): every row is one direction
  w (the public inputs' first principal direction), scaled by ``alpha``; row i's bias is −alpha·q_i
  with q_0 < q_1 < … consecutive quantiles of w·a on the public images, so unit i is active for the
  inputs with w·a > q_i. The next layer (the classifier, where the method trains against the
  downloaded one) gets equal columns: every row then receives the same upstream gradient g_n of a
  sample, so ΔW_i − ΔW_{i+1} holds only the inputs whose w·a falls in (q_i, q_{i+1}] and the
  LeakyReLU's leak, equal in both rows, cancels. Over several local steps the rows stay one
  direction up to what earlier steps' bins added; the columns' scale keeps one sample's step at
  ``DRIFT`` of a bin's width (for lr/batch = ``REFERENCE_STEP``), so later samples still fall into
  one bin each, while the update stays far above float32 rounding.
* ``plain`` (Boenisch et al., "When the Curious Abandon Honesty", EuroS&P 2023): random rows, each
  bias at the public (1 − 1/32) quantile of its row's w_i·a, so each row fires for few inputs; the
  classifier is left as sent. Under LeakyReLU the inactive inputs leak in at 1 %: the ratio
  ΔW_i / Δb_i is approximately, not exactly, one input.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

CRAFTS = ("binning", "plain")
# the plain trap: each row fires for this share of the public inputs
PLAIN_FIRING = 1.0 / 32
# binning: the lowest and highest thresholds sit at these public quantiles (inputs below the lowest
# fire no row; above the highest only the top row, whose leak has no neighbour to cancel against)
BIN_EDGES = (0.002, 0.998)
# binning: one sample's SGD step may move a row's pre-activation of another input by this share of a
# bin's width, at a step size lr/batch of REFERENCE_STEP (the defaults 0.05/10)
DRIFT = 0.01
REFERENCE_STEP = 0.005
# ... but never so small that a bias update (≈ lr/batch·s) drowns in float32 rounding of the O(1) biases
PRECISION = 1e-4


@dataclass
class CraftRecord:
    """What the server crafted and sent one client: the craft, the crafted layer's parameter name
    (``extractor.fc``), the download as sent (``sent``), per row the sign σ_i of its classifier
    column (binning) and the thresholds in units of the row's projection."""

    craft: str
    layer: str
    sent: dict[str, torch.Tensor]
    signs: torch.Tensor
    thresholds: torch.Tensor
    next_equalised: bool = False
    notes: list[str] = field(default_factory=list)


def first_linear(model: nn.Module) -> str:
    """The parameter prefix of the extractor's first linear layer (``extractor.fc``)."""
    for name, module in model.extractor.named_modules():
        if isinstance(module, nn.Linear):
            return f"extractor.{name}"
    raise ValueError("the extractor has no linear layer to craft")


def next_linear(model: nn.Module, layer: str) -> str:
    """The parameter prefix of the linear layer that follows ``layer`` (in the extractor, else the
    classifier): the layer whose columns binning equalises."""
    names = [f"extractor.{n}" for n, m in model.extractor.named_modules() if isinstance(m, nn.Linear)]
    after = names[names.index(layer) + 1:]
    return after[0] if after else "classifier"


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


def craft(kind: str, download: dict[str, torch.Tensor], model: nn.Module, public: torch.Tensor,
          reached: tuple[str, ...], seed: int = 0) -> tuple[dict[str, torch.Tensor], CraftRecord]:
    """The crafted download for one client and the server's record of it. ``model`` is a model of
    the architecture (its weights are replaced by the download's where it has them); ``reached``:
    the parameter groups the client trains from or against as sent (``Method.download_reaches``):
    binning equalises the next layer's columns only where that layer is among them."""
    if kind not in CRAFTS:
        raise ValueError(f"unknown craft {kind!r}; one of {CRAFTS}")
    model = load(model, download)
    layer = first_linear(model)
    inputs = layer_inputs(model, layer, public).double()
    generator = torch.Generator().manual_seed(int(seed))
    if kind == "binning":
        weight, bias, thresholds, signs = _binning_rows(inputs, layer_module(model, layer).out_features)
    else:
        weight, bias, thresholds = _plain_rows(inputs, layer_module(model, layer).out_features, generator)
        signs = torch.ones(len(bias), dtype=torch.float64)
    sent = {k: v.detach().clone() for k, v in download.items()}
    sent[f"{layer}.weight"], sent[f"{layer}.bias"] = weight.float(), bias.float()
    following = next_linear(model, layer)
    equalised = kind == "binning" and following.split(".", 1)[0] in reached
    if equalised:
        sent.update(_equal_columns(layer_module(model, following), following, signs, weight, bias, inputs))
    record = CraftRecord(kind, layer, sent, signs.float(), thresholds.float(), equalised)
    if kind == "binning" and not equalised:
        record.notes.append(f"the client trains against its own {following}: the rows' upstream gradients differ, "
                            f"so the leak of the inputs outside a bin does not cancel exactly")
    return {k: v.clone() for k, v in sent.items()}, record


def _binning_rows(inputs: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    centred = inputs - inputs.mean(0)
    direction = torch.linalg.svd(centred, full_matrices=False).Vh[0]
    projections = inputs @ direction
    if projections.mean() < 0:  # orient it so that larger projections are the common case's tail
        direction, projections = -direction, -projections
    levels = torch.linspace(BIN_EDGES[0], BIN_EDGES[1], rows, dtype=torch.float64)
    thresholds = torch.quantile(projections, levels)
    # rows scaled so that a unit's pre-activation stays O(1) over the public range
    alpha = 1.0 / float((thresholds[-1] - thresholds[0]).clamp_min(1e-12))
    weight = alpha * direction.expand(rows, -1).clone()
    signs = torch.ones(rows, dtype=torch.float64)
    return weight, -alpha * thresholds, alpha * thresholds, signs


def _plain_rows(inputs: torch.Tensor, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    directions = torch.randn(rows, inputs.shape[1], generator=generator, dtype=torch.float64)
    directions = directions / directions.norm(dim=1, keepdim=True)
    thresholds = torch.quantile(inputs @ directions.T, 1.0 - PLAIN_FIRING, dim=0)
    return directions, -thresholds, thresholds


def _equal_columns(following: nn.Linear, name: str, signs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The next layer for binning: column i = σ_i·v with v_j = s·(−1)^j (for the classifier: every
    class's sample gets an upstream gradient of the same size), zero bias; s keeps its outputs O(1)
    and one sample's step at ``DRIFT`` of a bin (module docstring)."""
    outputs = following.out_features
    hidden = torch.nn.functional.leaky_relu(inputs @ weight.T + bias, 0.01) @ signs
    bin_width = float((bias[:-1] - bias[1:]).abs().median())
    squared_norm = float((inputs ** 2).sum(1).median())
    scale = max(min(1.0 / float(hidden.abs().max().clamp_min(1.0)),
                    DRIFT * bin_width / (REFERENCE_STEP * squared_norm)), PRECISION / REFERENCE_STEP)
    v = scale * torch.tensor([(-1.0) ** j for j in range(outputs)], dtype=torch.float64)
    columns = v[:, None] * signs[None, :]
    return {f"{name}.weight": columns.float(), f"{name}.bias": torch.zeros(outputs)}
