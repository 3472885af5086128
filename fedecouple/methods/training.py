"""A client's local training loops: SGD over ``ClientContext.batches`` with a divergence check, on the
whole model or on one group with the other frozen, and the optimizer hook DP-SGD wraps them with."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
from torch import nn
import torch.nn.functional as F

from ..models import SplitModel
from .base import ClientContext, TrainConfig


# Optional wrapper around every optimizer a method builds with ``sgd`` (e.g. DP-SGD: per-sample
# clipping and noise, see defenses.dp). Set only for the duration of one client update.
_OPTIMIZER_HOOK: ContextVar[Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None] = \
    ContextVar("fedecouple_optimizer_hook", default=None)


@contextmanager
def optimizer_hook(hook: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]) -> Iterator[None]:
    """While active, ``sgd`` returns ``hook(torch.optim.SGD(...))`` instead of the plain optimizer."""
    token = _OPTIMIZER_HOOK.set(hook)
    try:
        yield
    finally:
        _OPTIMIZER_HOOK.reset(token)


def sgd(params, config: TrainConfig) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    hook = _OPTIMIZER_HOOK.get()
    return opt if hook is None else hook(opt)


def train_supervised(ctx: ClientContext, module_params, epochs: int, phase: str,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], augment: bool = False,
                     optimiser: TrainConfig | None = None) -> float:
    """Run SGD on ``module_params`` minimising ``loss_fn(x, y)`` over ``epochs``; returns mean loss.
    ``optimiser``: the SGD settings of this phase where a method's differ from the shared ones."""
    params = list(module_params)
    opt = sgd(params, optimiser or ctx.config)
    total, count = 0.0, 0
    for x, y in ctx.batches(epochs, phase, augment):
        loss = loss_fn(x, y)
        ctx.check_finite(loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
        count += 1
    return total / max(count, 1)


def cross_entropy_loss(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda x, y: F.cross_entropy(model(x), y)


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


def train_head(ctx: ClientContext, model: SplitModel, epochs: int, phase: str = "classifier",
               optimiser: TrainConfig | None = None) -> float:
    """``epochs`` of cross-entropy on the classifier alone; the extractor is frozen (features are
    computed without gradient). ``optimiser``: as ``train_supervised``'s."""
    def loss_fn(x, y):
        with torch.no_grad():
            feats = model.features(x)
        return F.cross_entropy(model.classifier(feats), y)

    return train_supervised(ctx, model.classifier.parameters(), epochs, phase, loss_fn, optimiser=optimiser)


def train_extractor(ctx: ClientContext, model: SplitModel, epochs: int, phase: str = "extractor",
                    extra: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                    optimiser: TrainConfig | None = None) -> float:
    """``epochs`` on the extractor alone with the classifier frozen: CE (+ ``extra(features, y)``);
    ``optimiser``: as ``train_supervised``'s."""
    def loss_fn(x, y):
        feats = model.features(x)
        loss = F.cross_entropy(model.classifier(feats), y)
        return loss if extra is None else loss + extra(feats, y)

    with frozen(model.classifier):
        return train_supervised(ctx, model.extractor.parameters(), epochs, phase, loss_fn, optimiser=optimiser)
