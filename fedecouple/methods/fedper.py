"""FedPer (Arivazhagan et al., 2019): a shared base and a personal head that never leaves the client.

Client i in round t receives the global base θ^t, sets its extractor to it, keeps its own head φ_i
(the last layer, kept on the client between rounds; initialised from the common initial model) and
trains base and head *jointly* on cross-entropy for ``local_epochs`` epochs. It uploads the base
θ_i and its training-set size n_i, never the head. Server: θ^{t+1} = Σ_i (n_i / Σ_j n_j) θ_i.

Personalised model for evaluation: the newest global base θ^{t+1} with the client's own head φ_i
(as in PFLlib, where clients receive the new base before they are evaluated). No data
augmentation. No hyperparameters beyond the shared training config.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..channel import Download, Upload
from ..models import SplitModel, get_params, set_params
from .averaging import by_client, sample_weighted_average, weighted_mean, weighted_summands
from .base import (SAMPLE_COUNT, ClientContext, Method, State, add_prefix, make_upload, model_fields, only_group,
                   strip_prefix)
from .facets import DPCoverage, DownloadReach, Replay, SecureSummation
from .replay import plain_replay
from .training import cross_entropy_loss, train_supervised


@dataclass
class FedPer(Method, Replay, DownloadReach, SecureSummation, DPCoverage):
    """FedPer: base (extractor) shared and sample-weight averaged, head (classifier) personal.
    Paper defaults: joint training of base and head each round; no extra hyperparameters."""

    name = "fedper"
    persistent_groups = ("classifier",)
    download_reaches = ("extractor",)  # trains the downloaded base; its own head
    plain_sgd = True
    closed_form = ("last-linear",)  # the private head enters the base update only through δ
    dp_per_sample = "cross-entropy on base and head jointly: per-sample."

    def manifest(self, model: SplitModel):
        return model_fields(model, "extractor") + [SAMPLE_COUNT]

    def init_server(self, model: SplitModel) -> State:
        return add_prefix(get_params(model, "extractor"), "global.")

    def init_client(self, model: SplitModel, client_id: int) -> State:
        return get_params(model, "classifier")

    def _start(self, ctx: ClientContext, state: State, download: Download) -> SplitModel:
        model = ctx.model
        set_params(model, only_group(state, "classifier"))
        set_params(model, only_group(download.tensors, "extractor"))
        return model

    def _finish(self, ctx: ClientContext, model: SplitModel) -> tuple[State, Upload]:
        return get_params(model, "classifier"), make_upload(ctx, get_params(model, "extractor"))

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        model = self._start(ctx, state, download)
        train_supervised(ctx, model.parameters(), ctx.config.local_epochs, "local", cross_entropy_loss(model))
        return self._finish(ctx, model)

    def replay(self, model, context, images, labels, copies):
        """Joint CE on base and head from the before-state (the private head: the server's stand-in)."""
        return plain_replay(model, context, images, labels, copies)

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        uploads = by_client(uploads)
        names = [k for k in uploads[0].tensors if k.startswith("extractor.")]
        return {**server, **add_prefix(sample_weighted_average(uploads, names), "global.")}

    # secure aggregation: the same sample-weighted average of the bases, from the sum of n_i·θ_i and n_i
    def secure_summands(self, upload: Upload, max_weight: float, num_classes: int):
        return weighted_summands(upload, [k for k in upload.tensors if k.startswith("extractor.")], max_weight)

    def secure_aggregate(self, server: State, total, round: int, max_weight: float) -> State:
        return {**server, **weighted_mean(total, server)}

    def personalized(self, ctx: ClientContext, server: State, state: State):
        return {**strip_prefix(server, "global."), **only_group(state, "classifier")}
