"""FedPer (Arivazhagan et al., 2019): a shared base and a personal head that never leaves the client.

Client i in round t receives the global base θ^t, sets its extractor to it, keeps its own head φ_i
(the last layer, kept on the client between rounds; initialised from the common initial model) and
trains base and head *jointly* on cross-entropy for ``local_epochs`` epochs. It uploads the base
θ_i and its training-set size n_i, never the head. Server: θ^{t+1} = Σ_i (n_i / Σ_j n_j) θ_i.

Personalised model for evaluation: the newest global base θ^{t+1} with the client's own head φ_i
(as in PFLlib, where clients receive the new base before they are evaluated). No data
augmentation. No hyperparameters beyond the shared training config.

Also holds the small training helpers FedRep and FedPAC reuse (``frozen``, ``train_head``,
``train_extractor``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..channel import Download, Upload
from ..models import SplitModel, get_params, set_params
from .base import (SAMPLE_COUNT, ClientContext, Method, State, add_prefix, cross_entropy_loss, make_upload,
                   model_fields, sample_weighted_average, strip_prefix, train_supervised)
from .fedavg import by_client


@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """Temporarily stop gradients to ``module``'s parameters (restored even on error)."""
    saved = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def only_group(tensors, group: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.startswith(group + ".")}


def train_head(ctx: ClientContext, model: SplitModel, epochs: int, phase: str = "classifier") -> float:
    """``epochs`` of cross-entropy on the classifier alone; the extractor is frozen (features are
    computed without gradient)."""
    def loss_fn(x, y):
        with torch.no_grad():
            feats = model.features(x)
        return F.cross_entropy(model.classifier(feats), y)

    return train_supervised(ctx, model.classifier.parameters(), epochs, phase, loss_fn)


def train_extractor(ctx: ClientContext, model: SplitModel, epochs: int, phase: str = "extractor",
                    extra: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> float:
    """``epochs`` on the extractor alone with the classifier frozen: CE (+ ``extra(features, y)``)."""
    def loss_fn(x, y):
        feats = model.features(x)
        loss = F.cross_entropy(model.classifier(feats), y)
        return loss if extra is None else loss + extra(feats, y)

    with frozen(model.classifier):
        return train_supervised(ctx, model.extractor.parameters(), epochs, phase, loss_fn)


@dataclass
class FedPer(Method):
    """FedPer: base (extractor) shared and sample-weight averaged, head (classifier) personal.
    Paper defaults: joint training of base and head each round; no extra hyperparameters."""

    name = "fedper"
    summary = "shared base averaged by sample count; personal head trained jointly, never uploaded"
    persistent_groups = ("classifier",)

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

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        uploads = by_client(uploads)
        names = [k for k in uploads[0].tensors if k.startswith("extractor.")]
        return {**server, **add_prefix(sample_weighted_average(uploads, names), "global.")}

    def personalized(self, ctx: ClientContext, server: State, state: State):
        return {**strip_prefix(server, "global."), **only_group(state, "classifier")}
