"""FedProto (Tan et al., AAAI 2022): clients share class prototypes only, never weights.

Client i keeps its whole model {θ_i, φ_i} (initialised from the common initial model) and in round
t receives the global prototypes C̄_k of the classes any client reported last round. It trains the
whole model for ``local_epochs`` epochs on CE(g(f(x)), y) + λ·‖f(x) − C̄_y‖², the squared distance
taken as the mean over batch and feature elements (torch ``MSELoss``, as the reference code does);
a sample whose class has no global prototype yet adds 0 to the sum (the reference code's
convention), so round 0 trains on CE alone. After training it computes its prototypes
C_i(k) = mean of f(θ_i; x) over its training samples of class k (no augmentation) and uploads, for
each class k it holds, ``prototype.{k}`` and ``class_count.{k}`` = |D_{i,k}|. No weights and no
sample count leave the client.

Server (the paper's eq. 6): C̄_k = Σ_i |D_{i,k}| C_i(k) / Σ_i |D_{i,k}| over the clients that sent
class k this round; the global prototype set is replaced by this round's (as in the reference
code). Personalised model for evaluation: the client's own model (its classifier's output; the
paper's nearest-prototype inference is not used).

Defaults: λ = 1.0 (the paper's and reference code's ``ld``). No data augmentation.

Also holds the prototype helpers FedPAC reuses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..channel import Download, Upload
from ..models import SplitModel, get_params, set_params
from .base import (ClientContext, FieldSpec, Method, State, add_prefix, class_means, extract_features,
                   make_upload, train_supervised)
from .fedavg import by_client

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
    table = torch.zeros(num_classes, dim)
    has = torch.zeros(num_classes, dtype=torch.bool)
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
    """Per-class mean feature of the client's (un-augmented) training images, and per-class counts."""
    return class_means(extract_features(model, ctx.images), ctx.labels, ctx.num_classes)


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


@dataclass
class FedProto(Method):
    """FedProto: λ = 1.0 (paper / reference code) weights the prototype-alignment term."""

    lam: float = 1.0

    name = "fedproto"
    summary = "whole model local; uploads per-class prototypes and counts only (no weights)"
    persistent_groups = ("extractor", "classifier")

    def manifest(self, model: SplitModel):
        return [prototype_field(model), FieldSpec(CLASS_COUNT, "class_counts", (), per_class=True)]

    def init_server(self, model: SplitModel) -> State:
        return {}  # no global prototypes before the first round

    def init_client(self, model: SplitModel, client_id: int) -> State:
        return get_params(model)

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        model = ctx.model
        set_params(model, state)
        table, has = prototype_table(prototypes_in(download.tensors), ctx.num_classes, model.feature_dim)
        use_protos = bool(has.any()) and self.lam != 0

        def loss_fn(x, y):
            feats = model.features(x)
            loss = F.cross_entropy(model.classifier(feats), y)
            return loss + self.lam * prototype_loss(feats, y, table, has) if use_protos else loss

        train_supervised(ctx, model.parameters(), ctx.config.local_epochs, "local", loss_fn)
        protos, counts = local_prototypes(ctx, model)
        tensors = {}
        for k in torch.nonzero(counts).flatten().tolist():
            tensors[PROTOTYPE.format(k=k)] = protos[k].clone()
            tensors[CLASS_COUNT.format(k=k)] = counts[k].clone()
        return get_params(model), make_upload(ctx, tensors, sample_count=False)

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        per_client = []
        for u in by_client(uploads):
            protos = prototypes_in(u.tensors)
            counts = {k: float(u.tensors.get(CLASS_COUNT.format(k=k), torch.tensor(0))) for k in protos}
            per_client.append((protos, counts))
        merged = weighted_prototypes(per_client)
        return add_prefix({PROTOTYPE.format(k=k): v for k, v in merged.items()}, "global.")

    def personalized(self, ctx: ClientContext, server: State, state: State):
        return state
