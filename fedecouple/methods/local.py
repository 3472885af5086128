"""Local training: every client trains its own model on its own data and never communicates (the
lower reference of the comparison).

Each client keeps its whole model (initialised from the common initial model) and trains it on
cross-entropy for ``local_epochs`` epochs per round. ``communicates = False`` tells the engine to
skip the channel entirely for this method: no download is sent, the (empty) upload that
``client_update`` returns is never sent, and ``aggregate`` is never called. The manifest is empty.
No data augmentation; no hyperparameters.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..channel import Download, Upload
from ..models import SplitModel, get_params, set_params
from .base import ClientContext, Method, State, make_upload
from .facets import DPCoverage
from .training import cross_entropy_loss, train_supervised


@dataclass
class Local(Method, DPCoverage):
    """Local: no communication at all."""

    name = "local"
    persistent_groups = ("extractor", "classifier")
    communicates = False
    dp_per_sample = "cross-entropy only: per-sample (nothing is uploaded)."

    def manifest(self, model: SplitModel):
        return []

    def init_server(self, model: SplitModel) -> State:
        return {}

    def init_client(self, model: SplitModel, client_id: int) -> State:
        return get_params(model)

    def download(self, server: State, client_id: int, round: int):
        return {}

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        model = ctx.model
        set_params(model, state)
        train_supervised(ctx, model.parameters(), ctx.config.local_epochs, "local", cross_entropy_loss(model))
        return get_params(model), make_upload(ctx, {}, sample_count=False)

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        return server

    def personalized(self, ctx: ClientContext, server: State, state: State):
        return state
