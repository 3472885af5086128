"""Local training as a differentiable program: a method's client update, replayed from what the
server knows, as a function of the client's data.

A method's ``replay(model, context, images, labels, copies)`` returns what its client would upload
(model weights and, where it uploads them, statistics such as FedPAC's prototypes, ``h`` and ``V``)
after the local training ``context.steps`` describes, on ``images`` with ``labels`` (class ids, or
probability rows: an attacker optimises soft labels). Every step is written with ``torch.func``,
so the result is differentiable in the images and labels and can be evaluated for many targets at
once with ``torch.func.vmap``. Replayed on a client's true batches (and augmentation draws) it
reproduces the client's upload to float rounding (``tests/test_replay.py``).

Unlike the client's own loop, nothing here is detached from the data: where a client stops a
gradient (a frozen teacher's logits, features computed without gradient for a head-only phase),
the replay holds the *parameters* fixed inside that step's gradient, but the step's result stays a
function of the images, which is what an attacker differentiates.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

from ..models import SplitModel
from .base import strip_prefix

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Step:
    """One SGD step: its phase and the positions (in the client's training set, in batch order) of
    the images it uses. An augmented phase adds one copy of each image to the batch."""

    phase: str
    members: tuple[int, ...]


@dataclass
class ReplayContext:
    """What the server knows before a client's local training.

    ``before``: every model parameter at the start of local training as the server knows it (the
    download; for the parameters a client keeps across rounds, its previous upload of them; else the
    initial weights, see ``attacks.inversion.observation.update_target``). ``kept``: the client's own last
    model as the server knows it (its previous upload where it has one, else the initial weights),
    which FedeCouple's classifier phase runs on. ``download``: what the server sent (global
    prototypes, a personalised head, ...). ``steps``: the local SGD steps in order. ``copies``: how
    many times the client's image set appears among the replayed images (an attack on real local
    training gives every epoch its own copy): a statistic that counts images divides by it.
    ``uploaded``: the client's upload, for a method whose later phase runs on what an earlier phase
    uploaded (FedPAC's base steps on the uploaded head). ``outputs``: the fields the caller reads
    (None: the whole upload); the replay returns at least those. ``features_before``: the images'
    features under ``before``'s extractor, where the caller has them already."""

    before: Params
    kept: Params
    download: Params
    lr: float
    steps: list[Step]
    num_classes: int
    notes: list[str] = field(default_factory=list)
    copies: int = 1
    # the uploaded value of a group whose training ended before a later phase used it (FedPAC's head,
    # trained before the base and uploaded as it was): the later phase may use it instead of its replay
    uploaded: Params = field(default_factory=dict)
    # the upload fields the caller reads (None: all): a replay may leave out the others, and the work
    # only they need (an attack that matches the weights alone needs no statistics of them)
    outputs: frozenset[str] | None = None
    # the replayed images' features under ``before``'s extractor, where the caller has computed them
    # already (an attack that matches them too): the replay reuses them instead of a second pass
    features_before: torch.Tensor | None = None

    def wants(self, name: str) -> bool:
        """Whether the caller reads the upload field ``name``."""
        return self.outputs is None or name in self.outputs

    def phase(self, name: str) -> list[tuple[int, Step]]:
        """(position in ``steps``, step) for every step of one phase."""
        return [(i, s) for i, s in enumerate(self.steps) if s.phase == name]


def as_probabilities(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(n, C) rows: one-hot for class ids, unchanged for probability rows."""
    return F.one_hot(labels, num_classes).to(torch.get_default_dtype()) if labels.ndim == 1 else labels


def features(model: SplitModel, params: Params, x: torch.Tensor) -> torch.Tensor:
    """The extractor's features of ``x`` under ``params`` (names with the ``extractor.`` prefix)."""
    return functional_call(model.extractor, strip_prefix(params, "extractor."), (model.normalize(x),))


def head(model: SplitModel, params: Params, feats: torch.Tensor) -> torch.Tensor:
    """The classifier's logits for ``feats`` under ``params`` (names with the ``classifier.`` prefix)."""
    return functional_call(model.classifier, strip_prefix(params, "classifier."), (feats,))


def cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy against probability rows (for one-hot rows: ``F.cross_entropy``)."""
    return -(probs * F.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


_DIFFERENTIATED_OUTSIDE = threading.local()


@contextlib.contextmanager
def differentiated_outside():
    """Within it, ``parameter_gradients`` called outside any ``torch.func`` transform builds its graph
    with plain autograd (``create_graph``), for a caller that differentiates the result with plain
    autograd (an attack on one target: on a CPU the double backward is cheaper outside functorch's
    wrappers). Elsewhere it is ``torch.func.grad``, whose result carries no graph of its own."""
    previous = getattr(_DIFFERENTIATED_OUTSIDE, "on", False)
    _DIFFERENTIATED_OUTSIDE.on = True
    try:
        yield
    finally:
        _DIFFERENTIATED_OUTSIDE.on = previous


def parameter_gradients(loss: Callable[[Params], torch.Tensor], params: Params) -> Params:
    """∂loss/∂params, differentiable in whatever ``params`` and the loss's inputs depend on:
    ``torch.func.grad``, or within ``differentiated_outside`` and outside any ``torch.func``
    transform plain autograd with ``create_graph`` (the same values to float rounding)."""
    if not getattr(_DIFFERENTIATED_OUTSIDE, "on", False) or torch._C._functorch.maybe_current_level() is not None:
        return grad(loss)(params)
    with torch.enable_grad():
        leaves = {k: v if v.requires_grad else v.detach().requires_grad_(True) for k, v in params.items()}
        value = loss(leaves)
        found = torch.autograd.grad(value, list(leaves.values()), create_graph=True, allow_unused=True)
    return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), found)}


def sgd_step(params: Params, loss: Callable[[Params], torch.Tensor], lr: float) -> Params:
    """One plain SGD step on ``params`` (the trained ones only; the loss closes over the rest)."""
    gradients = parameter_gradients(loss, params)
    return {k: v - lr * gradients[k] for k, v in params.items()}


def momentum_step(params: Params, loss: Callable[[Params], torch.Tensor], lr: float, momentum: float,
                  weight_decay: float, buffer: Params | None) -> tuple[Params, Params]:
    """One step of ``torch.optim.SGD(lr, momentum, weight_decay)`` (no dampening, no Nesterov):
    d = ∇loss + weight_decay·θ, b = d on a phase's first step (``buffer`` None: a fresh optimiser)
    else momentum·b + d, θ − lr·b. Returns (parameters, buffer for the phase's next step)."""
    gradients = parameter_gradients(loss, params)
    step = {k: gradients[k] + weight_decay * v if weight_decay else gradients[k] for k, v in params.items()}
    if buffer is not None and momentum:
        step = {k: momentum * buffer[k] + d for k, d in step.items()}
    return {k: v - lr * step[k] for k, v in params.items()}, step


def class_sums(feats: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-class feature sums (C, d), per-class counts (C,)) with soft membership ``probs``."""
    return probs.transpose(0, 1) @ feats, probs.sum(dim=0)


def class_means(feats: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class mean features (absent classes: zero rows) and counts, as ``ClientContext.class_means``."""
    sums, counts = class_sums(feats, probs)
    return sums / counts.clamp_min(1).unsqueeze(1), counts


def batch(x: torch.Tensor, probs: torch.Tensor, step: Step, copies: torch.Tensor | None):
    """The step's images (and their augmented copies, when the phase is augmented) and label rows."""
    members = torch.tensor(step.members, dtype=torch.long)
    xb, yb = x[members], probs[members]
    if copies is None:
        return xb, yb
    return torch.cat([xb, copies]), torch.cat([yb, yb])


def plain_replay(model: SplitModel, rc: ReplayContext, x: torch.Tensor, labels: torch.Tensor,
                 copies: list, phase: str = "local") -> Params:
    """Cross-entropy SGD on every parameter, from ``rc.before`` (FedAvg, FedPer, Local)."""
    probs = as_probabilities(labels, rc.num_classes)
    params = dict(rc.before)
    for i, step in rc.phase(phase):
        xb, yb = batch(x, probs, step, copies[i])
        params = sgd_step(params, lambda p: cross_entropy(head(model, p, features(model, p, xb)), yb), rc.lr)
    return params
