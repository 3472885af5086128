"""Class prototypes (per-class mean features) as FedProto and FedPAC send and use them."""
from __future__ import annotations

import re

import torch

from ..models import SplitModel
from .base import ClientContext, FieldSpec

PROTOTYPE = "prototype.{k}"
CLASS_COUNT = "class_count.{k}"
_PROTO_RE = re.compile(r"^prototype\.(\d+)$")


def prototype_field(model: SplitModel) -> FieldSpec:
    return FieldSpec(PROTOTYPE, "prototype", (model.feature_dim,), per_class=True)


def prototypes_in(tensors) -> dict[int, torch.Tensor]:
    """{class: prototype} for every ``prototype.{k}`` in a message or state."""
    out = {}
    for name, value in tensors.items():
        m = _PROTO_RE.match(name)
        if m:
            out[int(m.group(1))] = value
    return out


def prototype_table(protos: dict[int, torch.Tensor], num_classes: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, d) table of targets and a (C,) mask of the classes that have one."""
    device = next(iter(protos.values())).device if protos else None  # where the client computes
    table = torch.zeros(num_classes, dim, device=device)
    has = torch.zeros(num_classes, dtype=torch.bool, device=device)
    for k, v in protos.items():
        if 0 <= k < num_classes:
            table[k] = v.to(table.dtype)
            has[k] = True
    return table, has


def prototype_loss(features: torch.Tensor, labels: torch.Tensor, table: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """MSE between each feature and its class's target, averaged over batch × feature elements;
    samples of classes without a target contribute zeros (they still count in the mean)."""
    diff = (features - table[labels]) * has[labels].unsqueeze(1).to(features.dtype)
    return diff.pow(2).mean()


def local_prototypes(ctx: ClientContext, model: SplitModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean feature of the client's (un-augmented) training images, and per-class counts
    (``ctx.class_means``: exact, or through a DP context's mechanism)."""
    return ctx.class_means(model)


def weighted_prototypes(per_client: list[tuple[dict[int, torch.Tensor], dict[int, float]]]) -> dict[int, torch.Tensor]:
    """Σ_i w_ik C_i(k) / Σ_i w_ik per class, over the clients that sent class k (clients in a fixed order)."""
    sums: dict[int, torch.Tensor] = {}
    weights: dict[int, float] = {}
    for protos, counts in per_client:
        for k, proto in protos.items():
            w = float(counts.get(k, 0.0))
            if w <= 0:
                continue
            sums[k] = sums.get(k, 0) + w * proto.to(torch.float32)
            weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sorted(sums)}
