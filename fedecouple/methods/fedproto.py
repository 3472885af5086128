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

The prototype helpers it shares with FedPAC are in ``prototypes.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..channel import Download, Upload
from ..models import SplitModel, get_params, set_params
from ..errors import UserError
from .averaging import by_client
from .base import ClientContext, FieldSpec, Method, State, add_prefix, make_upload
from .facets import DPCoverage, SecureSummation
from .prototypes import (CLASS_COUNT, PROTOTYPE, local_prototypes, prototype_field, prototype_loss, prototype_table,
                         prototypes_in, weighted_prototypes)
from .training import train_supervised

@dataclass
class FedProto(Method, SecureSummation, DPCoverage):
    """FedProto: λ = 1.0 (paper / reference code) weights the prototype-alignment term."""

    lam: float = 1.0

    name = "fedproto"
    persistent_groups = ("extractor", "classifier")
    dp_per_sample = "CE + λ·prototype alignment to the global prototypes on the whole model: per-sample."
    dp_statistics = ("one per round, after training: the uploaded prototypes and class counts (class means of the "
                     "trained model's features).")

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

    # secure aggregation: eq. 6 from sums. Every client sends n_k·C(k) and n_k for every class (zeros
    # for the classes it lacks), scaled by 1/max_weight, so the sums have one layout and reveal only the
    # round's per-class totals; the global prototype is Σ n_k·C(k) / Σ n_k, as in ``aggregate``.
    secure_variant_note = ("each client sends count-weighted prototype sums and counts for every class (zeros for "
                           "classes it lacks); the server divides the sums: the same eq. 6 average")

    def secure_summands(self, upload: Upload, max_weight: float, num_classes: int):
        protos = prototypes_in(upload.tensors)
        if not protos:
            raise UserError(f"client {upload.client_id} sent no prototype in round {upload.round}: a FedProto client "
                            f"with no training images cannot take part in secure aggregation")
        dim = next(iter(protos.values())).shape
        out = {}
        for k in range(num_classes):
            count = float(upload.tensors.get(CLASS_COUNT.format(k=k), torch.tensor(0.0))) if k in protos else 0.0
            proto = protos[k].to(torch.float64) if k in protos else torch.zeros(dim, dtype=torch.float64)
            out[PROTOTYPE.format(k=k)] = proto * (count / max_weight)
            out[CLASS_COUNT.format(k=k)] = torch.tensor(count / max_weight, dtype=torch.float64)
        return out

    def secure_aggregate(self, server: State, total, round: int, max_weight: float) -> State:
        merged = {}
        for k in prototypes_in(total):
            count = round_count(float(total[CLASS_COUNT.format(k=k)]) * max_weight)
            if count > 0:
                merged[PROTOTYPE.format(k=k)] = (total[PROTOTYPE.format(k=k)] * max_weight / count).to(torch.float32)
        return add_prefix(merged, "global.")

    def personalized(self, ctx: ClientContext, server: State, state: State):
        return state


def round_count(value: float) -> int:
    """A class count decoded from a secure sum (off by far less than 0.5 at any sane quantisation)."""
    return int(value + 0.5) if value > 0 else 0
