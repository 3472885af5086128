"""FedAvg (McMahan et al., AISTATS 2017) and FT-FedAvg (FedAvg + local fine-tuning).

FedAvg. Client i in round t receives the global model ω^t = {θ^t, φ^t}, trains *all* its
parameters with mini-batch SGD on cross-entropy for ``local_epochs`` epochs and uploads the whole
model ω_i plus its training-set size n_i. Server: ω^{t+1} = Σ_i (n_i / Σ_j n_j) ω_i. Nothing is kept
on the client between rounds; the personalised model used for evaluation is the global model.

FT-FedAvg (``ft-fedavg``). Identical training and uploads. Before evaluation each client copies the
current global model and fine-tunes all of it on its own training data for ``finetune_epochs``
epochs (default 1) with the same SGD settings; the fine-tuned copy is evaluated and thrown away
(it is never uploaded and never kept), so FT-FedAvg's channel is exactly FedAvg's.

Neither uses data augmentation (their papers do not): DA is one of FedeCouple's components.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..channel import Download, Upload
from ..errors import UserError
from ..models import SplitModel, get_params, set_params
from .averaging import by_client, sample_weighted_average, weighted_mean, weighted_summands
from .base import SAMPLE_COUNT, ClientContext, Method, State, add_prefix, make_upload, model_fields, strip_prefix
from .facets import DPCoverage, DownloadReach, Replay, SecureSummation
from .replay import plain_replay
from .training import cross_entropy_loss, train_supervised


@dataclass
class FedAvg(Method, Replay, DownloadReach, SecureSummation, DPCoverage):
    """FedAvg: no hyperparameters beyond the shared training config (lr, batch size, local epochs)."""

    name = "fedavg"
    plain_sgd = True
    download_reaches = ("extractor", "classifier")  # trains the whole download
    dp_per_sample = "cross-entropy only: per-sample."

    def manifest(self, model: SplitModel):
        return model_fields(model, "extractor") + model_fields(model, "classifier") + [SAMPLE_COUNT]

    # init_server / download: the base class's global model ("global." + parameter name)

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        model = ctx.model
        set_params(model, dict(download.tensors))
        train_supervised(ctx, model.parameters(), ctx.config.local_epochs, "local", cross_entropy_loss(model))
        return {}, make_upload(ctx, get_params(model))

    def replay(self, model, context, images, labels, copies):
        return plain_replay(model, context, images, labels, copies)

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        uploads = by_client(uploads)
        names = [k for k in uploads[0].tensors if k != "sample_count"]
        return {**server, **add_prefix(sample_weighted_average(uploads, names), "global.")}

    # secure aggregation: the same sample-weighted average, formed from the sum of n_i·ω_i and n_i
    def secure_summands(self, upload: Upload, max_weight: float, num_classes: int):
        return weighted_summands(upload, [k for k in upload.tensors if k != "sample_count"], max_weight)

    def secure_aggregate(self, server: State, total, round: int, max_weight: float) -> State:
        return {**server, **weighted_mean(total, server)}

    def personalized(self, ctx: ClientContext, server: State, state: State):
        return strip_prefix(server, "global.")


@dataclass
class FTFedAvg(FedAvg):
    """FT-FedAvg: FedAvg, then ``finetune_epochs`` (default 1) epochs of local fine-tuning of the
    global model before evaluation. The fine-tuned model never leaves the client and is not kept."""

    finetune_epochs: int = 1

    name = "ft-fedavg"
    dp_per_sample = ("cross-entropy only: per-sample (the fine-tuning before evaluation is never uploaded and runs "
                     "outside DP-SGD).")

    def __post_init__(self) -> None:
        if self.finetune_epochs < 0:
            raise UserError(f"finetune_epochs must be >= 0, got {self.finetune_epochs}", fields=("finetune_epochs",))

    def personalized(self, ctx: ClientContext, server: State, state: State):
        model = ctx.model
        set_params(model, strip_prefix(server, "global."))
        if self.finetune_epochs:
            train_supervised(ctx, model.parameters(), self.finetune_epochs, "finetune", cross_entropy_loss(model))
        return get_params(model)
