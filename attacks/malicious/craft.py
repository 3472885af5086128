"""A malicious server's crafted download: weights only, the architecture the client expects.

Pure functions of tensors: the honest download, a model of the federation's architecture (for
shapes and the layers before the crafted one) and public images the server holds.

Both crafts rewrite the first linear layer of the extractor (``extractor.fc`` of the CNNs, the
first layer of ``mlp``):

* ``binning`` (Fowl et al., "Robbing the Fed", ICLR 2022, weights only): every row is one direction
  w (the public inputs' first principal direction, made orthogonal to their mean so that the
  biases stay small), scaled by alpha; row i's bias is −alpha·q_i with q_0 < q_1 < … consecutive
  quantiles of w·a on the public images, so unit i is active for the inputs with w·a > q_i. The next
  layer (the classifier, where the method trains against the downloaded one) gets equal columns
  up to a sign σ_i = (−1)^i. Rows of one sign then receive the same upstream gradient g_n of a
  sample, so the difference of two neighbouring rows of one sign (i and i + 2) holds only the
  inputs whose w·a fell between their thresholds, and the LeakyReLU's leak, equal in both,
  cancels. The alternating sign makes the rows' contributions to the next layer cancel pairwise:
  the layers before the crafted one receive almost no gradient and barely drift over the client's
  steps, and each sign's rows drift together. The columns' scale puts one sample's bias update
  ``BIAS_ULPS`` float32 steps above the biases' rounding; the layer before the crafted one (a
  convolution) is scaled down by γ (exact: LeakyReLU and max-pooling are positively homogeneous) so
  that one sample's step moves another input's pre-activation by a fraction of a bin.
* ``plain`` (Boenisch et al., "When the Curious Abandon Honesty", EuroS&P 2023): random rows, each
  bias at the public (1 − 1/32) quantile of its row's w_i·a, so each row fires for few inputs; the
  rest is left as sent. Under LeakyReLU the inactive inputs leak in at 1 %: the ratio
  ΔW_i / Δb_i is approximately, not exactly, one input.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fedecouple.methods.facets import download_reach

from ..inversion.layer_inputs import layer_inputs, layer_module, load  # noqa: F401  (the crafts' own vocabulary)
from ..registry import CraftRequest

CRAFTS = ("binning", "plain")
# the plain trap: each row fires for this share of the public inputs
PLAIN_FIRING = 1.0 / 32
# binning: the lowest and highest thresholds sit at these public quantiles (inputs below the lowest
# fire no row; above the highest only the top row, whose leak has no neighbour to cancel against)
BIN_EDGES = (0.002, 0.998)
# binning: a sample's bias update is this many float32 rounding steps of the largest bias, at a
# step size lr/batch of REFERENCE_STEP (the defaults 0.05/10), within BIAS_ULPS, as far as one
# sample's step then moves another input's pre-activation by at most BIN_SHIFT of a bin ...
BIAS_ULPS = (1e3, 1e5)
BIN_SHIFT = 0.1
REFERENCE_STEP = 0.005
# ... the layer before is scaled so that the inputs' median ‖a‖² is at most this: one sample's step
# then moves another input's pre-activation by well under a bin ...
INPUT_SQUARED_NORM = 0.1
# ... and the rows' pre-activations span this much over the public range: the layers before the
# crafted one get a gradient (and drift) that shrinks with its square, while the rounding of the
# bias updates and the bins' distortion do not depend on it
PRE_ACTIVATION_SPAN = 1e-5


@dataclass
class CraftRecord:
    """What the server crafted and sent one client: the craft, the crafted layer's parameter name
    (``extractor.fc``), the download as sent (``sent``), per row the sign σ_i of its next-layer
    column (binning) and its threshold (in pre-activation units), whether the next layer was
    equalised, and the mean public image."""

    craft: str
    layer: str
    sent: dict[str, torch.Tensor]
    signs: torch.Tensor
    thresholds: torch.Tensor
    next_equalised: bool = False
    public_mean: torch.Tensor | None = None  # the mean of the server's public images (where a rebuild starts)
    notes: list[str] = field(default_factory=list)


def first_linear(model: nn.Module) -> str:
    """The parameter prefix of the extractor's first linear layer (``extractor.fc``)."""
    for name, module in model.extractor.named_modules():
        if isinstance(module, nn.Linear):
            return f"extractor.{name}"
    raise ValueError("the extractor has no linear layer to craft")


def reached_groups(method) -> set[str]:
    """The parameter groups ``method``'s client trains from or against as sent (``DownloadReach``)."""
    return set(download_reach(method))


def nothing_reached(method) -> str | None:
    """Why no crafted download reaches ``method``'s update at all (None: some group is reached)."""
    if reached_groups(method):
        return None
    return (f"{method.name} trains nothing the server sends (its download holds no weights it trains from or "
            f"against): a crafted download cannot reach its update")


def not_reachable(method, model: nn.Module) -> str | None:
    """Why a crafted first linear layer cannot reach ``method``'s update (None: it can): the layer lies
    in the extractor, which the client must train from as sent."""
    reason = nothing_reached(method)
    if reason is not None:
        return reason
    layer, reached = first_linear(model), reached_groups(method)
    if layer.split(".", 1)[0] in reached:
        return None
    return (f"{method.name} trains only {', '.join(sorted(reached))} as sent, not {layer}: a crafted download "
            f"cannot reach that layer")


def next_linear(model: nn.Module, layer: str) -> str:
    """The parameter prefix of the linear layer that follows ``layer`` (in the extractor, else the
    classifier): the layer whose columns binning equalises."""
    names = [f"extractor.{n}" for n, m in model.extractor.named_modules() if isinstance(m, nn.Linear)]
    after = names[names.index(layer) + 1:]
    return after[0] if after else "classifier"


def craft(kind: str, download: dict[str, torch.Tensor], model: nn.Module, public: torch.Tensor,
          reached: tuple[str, ...], seed: int = 0) -> tuple[dict[str, torch.Tensor], CraftRecord]:
    """The crafted download for one client and the server's record of it. ``model`` is a model of
    the architecture (its weights are replaced by the download's where it has them); ``reached``:
    the parameter groups the client trains from or against as sent (``DownloadReach.download_reaches``):
    binning equalises the next layer's columns only where that layer is among them."""
    if kind not in CRAFTS:
        raise ValueError(f"unknown craft {kind!r}; one of {CRAFTS}")
    model = load(model, download)
    layer = first_linear(model)
    sent = {k: v.detach().clone() for k, v in download.items()}
    if kind == "binning":
        sent.update(_shrink_inputs(model, layer, public))
    inputs = layer_inputs(model, layer, public).double()
    generator = torch.Generator().manual_seed(int(seed))
    if kind == "binning":
        weight, bias, thresholds, signs = _binning_rows(inputs, layer_module(model, layer).out_features)
    else:
        weight, bias, thresholds = _plain_rows(inputs, layer_module(model, layer).out_features, generator)
        signs = torch.ones(len(bias), dtype=torch.float64)
    sent[f"{layer}.weight"], sent[f"{layer}.bias"] = weight.float(), bias.float()
    following = next_linear(model, layer)
    equalised = kind == "binning" and following.split(".", 1)[0] in reached
    if equalised:
        sent.update(_equal_columns(layer_module(model, following), following, signs, weight, bias, inputs))
    record = CraftRecord(kind, layer, sent, signs.float(), thresholds.float(), equalised, public.mean(0))
    if kind == "binning" and not equalised:
        record.notes.append(f"the client trains against its own {following}: the rows' upstream gradients differ, "
                            f"so the leak of the inputs outside a bin does not cancel exactly")
    return {k: v.clone() for k, v in sent.items()}, record


def craft_request(request: CraftRequest) -> tuple[dict[str, torch.Tensor], CraftRecord]:
    """The server's craft (``MaliciousSpec.craft_download``): ``craft`` of the craft ``request`` names."""
    return craft(request.craft, dict(request.download), request.make_model(), request.public, request.reached,
                 seed=request.seed)


def layer_before(model: nn.Module, layer: str) -> tuple[str, nn.Module] | None:
    """(name, module) of the last direct child of the extractor with parameters before ``layer`` (None:
    none has any, e.g. only a flatten)."""
    found = None
    for name, module in model.extractor.named_children():
        if f"extractor.{name}" == layer:
            break
        if any(True for _ in module.parameters(recurse=False)):
            found = (f"extractor.{name}", module)
    return found


def _shrink_inputs(model: nn.Module, layer: str, public: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scale the parametrised layer just before ``layer`` (weight and bias, in ``model`` too) by γ so
    that the median ‖a‖² ≤ ``INPUT_SQUARED_NORM``; {} when none comes before it (``mlp``)."""
    before = layer_before(model, layer)
    if before is None:
        return {}
    inputs = layer_inputs(model, layer, public).double()
    gamma = min(1.0, (INPUT_SQUARED_NORM / float((inputs ** 2).sum(1).median().clamp_min(1e-12))) ** 0.5)
    name, module = before
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.mul_(gamma)
    return {f"{name}.{k}": p.detach().clone() for k, p in module.named_parameters(recurse=False)}


def _direction(inputs: torch.Tensor) -> torch.Tensor:
    """The inputs' first principal direction, made orthogonal to their mean (so w·a is centred)."""
    mean = inputs.mean(0)
    direction = torch.linalg.svd(inputs - mean, full_matrices=False).Vh[0]
    direction = direction - (direction @ mean) / (mean @ mean).clamp_min(1e-12) * mean
    return direction / direction.norm().clamp_min(1e-12)


def _binning_rows(inputs: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
    direction = _direction(inputs)
    projections = inputs @ direction
    levels = torch.linspace(BIN_EDGES[0], BIN_EDGES[1], rows, dtype=torch.float64)
    thresholds = torch.quantile(projections, levels)
    alpha = PRE_ACTIVATION_SPAN / float((thresholds[-1] - thresholds[0]).clamp_min(1e-12))
    weight = alpha * direction.expand(rows, -1).clone()
    signs = torch.tensor([(-1.0) ** i for i in range(rows)], dtype=torch.float64)
    return weight, -alpha * thresholds, alpha * thresholds, signs


def _plain_rows(inputs: torch.Tensor, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    directions = torch.randn(rows, inputs.shape[1], generator=generator, dtype=torch.float64)
    directions = directions / directions.norm(dim=1, keepdim=True)
    thresholds = torch.quantile(inputs @ directions.T, 1.0 - PLAIN_FIRING, dim=0)
    return directions, -thresholds, thresholds


def _equal_columns(following: nn.Linear, name: str, signs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The next layer for binning: column i = σ_i·v with v_j = s·(−1)^j (for the classifier: every
    class's sample gets an upstream gradient of the same size), zero bias; s puts a sample's bias
    update ``BIAS_ULPS`` float32 steps above the largest bias (module docstring), its outputs O(1)."""
    outputs = following.out_features
    hidden = torch.nn.functional.leaky_relu(inputs @ weight.T + bias, 0.01) @ signs
    bin_width = float((bias[:-1] - bias[1:]).abs().median())
    shift_per_ulp = 2.0 ** -23 * float(bias.abs().max()) * float((inputs ** 2).sum(1).median()) / bin_width
    ulps = min(max(BIN_SHIFT / shift_per_ulp, BIAS_ULPS[0]), BIAS_ULPS[1])
    scale = ulps * 2.0 ** -23 * float(bias.abs().max()) / REFERENCE_STEP
    scale = min(scale, 1.0 / float(hidden.abs().max().clamp_min(1e-12)))
    v = scale * torch.tensor([(-1.0) ** j for j in range(outputs)], dtype=torch.float64)
    columns = v[:, None] * signs[None, :]
    return {f"{name}.weight": columns.float(), f"{name}.bias": torch.zeros(outputs)}
