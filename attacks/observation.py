"""What the server saw of one client in one round, and the update target the attacks invert.

``observe`` builds an ``Observation`` from the channel ``Recorder``: the download as the server
sent it, the upload as the server received it, and the client's previous upload (the server's
memory of parts the client keeps across rounds). Nothing else: the harness's ground truth never
enters an Observation.

``make_model()`` returns a fresh model of the federation's architecture **at the federation's
initial weights ω^0**. The server built that model, so it knows it; this is how the observation
carries "the initial head as the server knows it" for methods whose download holds no classifier
(FedPer, FedRep, FedPAC in round 0) and the initial extractor for FedProto.

``update_target`` turns an observation into what gradient-inversion attacks match:

* per uploaded model parameter, the **before-state**: the download; for the method's
  ``persistent_groups`` (parts the client keeps between rounds, e.g. FedeCouple's personal
  classifier) the client's previous upload of it, falling back to the download when the server
  has none (with a note), and to the initial weights when the download does not carry it either;
* **Δ = after − before** (the upload minus the before-state);
* for the parameters the client trains but does not upload (a private head), the forward model
  uses the last global head if the download has one, else the initial head, and says so.

Two ways to compare a dummy batch with Δ (``GradientMatcher``), named in every output:

* ``scaled-gradient``: the target is g = −Δ/(lr·steps) (one big step on the batch); with unknown
  hyperparameters g = −Δ/‖Δ‖ (the scale is unknown: cosine objectives ignore it, DLG fits it);
  the dummy's quantity is the loss gradient at the before-state.
* ``replay``: needs the hyperparameters (lr, steps, batch size): T plain cross-entropy SGD steps
  are replayed differentiably from the before-state on the dummy batch, and the resulting
  Δ̂ is compared with Δ (both divided by −lr·steps, so they read as gradients). This is exact for
  FedAvg-style local training; for methods that train in phases or with extra losses
  (FedeCouple, FedRep, FedPAC, ...) it is an approximation, and the notes say so.

``mode="auto"`` replays when the hyperparameters are known and the client took more than one
step; with one step replay and scaled gradient are the same computation, and it is named
``scaled-gradient``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

from fedecouple.models import SplitModel, group_of

from .base import LocalHyperparameters, NotApplicable, Observation

MODES = ("auto", "replay", "scaled")
CLASSIFIER_WEIGHT = "classifier.weight"


def observe(recorder, round: int, client_id: int, *, method, make_model: Callable[[], SplitModel],
            image_shape: tuple[int, int, int], num_classes: int,
            known_hyperparameters: LocalHyperparameters | None = None, head_known: bool = True) -> Observation:
    """The server's view of ``client_id`` in ``round``: download as sent, upload as received,
    previous upload (the recorder's tensors, not copies). ``method`` is the Method object whose
    protocol the client follows."""
    exchange = recorder.get(round, client_id)
    if exchange is None:
        raise ValueError(f"round {round} of client {client_id} was not recorded (the recorder keeps "
                         f"rounds {sorted(recorder.rounds) if recorder.rounds is not None else 'all'})")
    if exchange.upload is None:
        raise ValueError(f"client {client_id} sent no upload in round {round} (dropped by the channel)")
    previous = recorder.previous_upload(client_id, round)
    return Observation(
        method=method, round=round, client_id=client_id, download=dict(exchange.download.tensors),
        upload=dict(exchange.upload.tensors), previous_upload=None if previous is None else dict(previous.tensors),
        make_model=make_model, image_shape=tuple(image_shape), num_classes=int(num_classes),
        known_hyperparameters=known_hyperparameters, head_known=head_known)


@dataclass
class UpdateTarget:
    """The update an attack inverts, derived from an observation only."""

    before: dict[str, torch.Tensor]  # every model parameter at the start of local training, as the server knows it
    delta: dict[str, torch.Tensor]  # after − before, for the attacked parameters
    names: list[str]  # attacked parameters (uploaded model weights, minus the head when it is "unknown")
    classifier_update: bool  # whether the classifier's update is among the attacked parameters
    notes: list[str] = field(default_factory=list)


_GROUP_WORDS = {"classifier": "classifier", "extractor": "extractor"}


def _describe(name: str, persistent: bool) -> str:
    group = group_of(name)
    word = _GROUP_WORDS.get(group, group)
    return f"personal {word}" if persistent else word


def update_target(obs: Observation) -> UpdateTarget:
    """Before-state, Δ and attacked names for ``obs`` (see the module docstring for the rules)."""
    model = obs.make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    uploaded = [n for n in initial if n in obs.upload]
    if not uploaded:
        sent = ", ".join(sorted(obs.upload)) or "nothing"
        raise NotApplicable(f"{obs.method.name} uploads no model weights (it sent: {sent}), so there is no gradient "
                            f"to invert; use the `proto` attack on its prototypes (or `labels`)")
    notes: list[str] = []
    noted: set[tuple[str, str]] = set()

    def note_once(group: str, text: str) -> None:
        if (group, text) not in noted:
            noted.add((group, text))
            notes.append(text)

    before: dict[str, torch.Tensor] = {}
    previous = obs.previous_upload or {}
    for name, init in initial.items():
        group = group_of(name)
        persistent = group in obs.method.persistent_groups
        what = _describe(name, persistent)
        if name in obs.upload:
            if persistent and name in previous:
                before[name] = previous[name]
            elif persistent and name in obs.download:
                before[name] = obs.download[name]
                note_once(group, f"no previous upload of the {what}: its update is measured against the global {group} "
                                 f"of the download")
            elif name in obs.download:
                before[name] = obs.download[name]
            elif name in previous:
                before[name] = previous[name]
                note_once(group, f"the download carried no {group}: its update is measured against the client's "
                                 f"previous upload of it")
            else:
                before[name] = init
                note_once(group, f"the download carried no {group} and there is no previous upload of it: its update "
                                 f"is measured against the initial {group} (round-0 weights, known to the server)")
        else:  # trained locally but kept private: the forward model needs a stand-in
            if name in obs.download:
                before[name], stand_in = obs.download[name], f"the last global {group} from the download"
            else:
                before[name], stand_in = init, f"the initial {group} (round-0 weights, known to the server)"
            note_once(group, f"the client's {group} is not uploaded (kept private): the attack uses {stand_in} "
                             f"in its place")
    names = list(uploaded)
    if not obs.head_known and any(group_of(n) == "classifier" for n in names):
        names = [n for n in names if group_of(n) != "classifier"]
        notes.append("threat model 'head unknown': the classifier's update is not used")
    if not names:
        raise NotApplicable(f"{obs.method.name}'s upload holds only the classifier and the threat model excludes it")
    delta = {n: (obs.upload[n].to(torch.float32) - before[n].to(torch.float32)) for n in names}
    if all(float(d.abs().max()) == 0.0 for d in delta.values()):
        notes.append("the uploaded weights equal the before-state: the client's update is zero")
    return UpdateTarget(before={k: v.detach().to(torch.float32) for k, v in before.items()}, delta=delta,
                        names=names, classifier_update=any(group_of(n) == "classifier" for n in names), notes=notes)


def resolve_mode(obs: Observation, mode: str = "auto") -> str:
    """``replay`` or ``scaled-gradient`` for the requested ``mode`` (auto, replay, scaled)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    hp = obs.known_hyperparameters
    if mode == "replay":
        if hp is None:
            raise ValueError("replay needs the client's local hyperparameters (lr, steps, batch size): "
                             "use the 'hyperparameters known' threat model or the scaled mode")
        return "replay"
    if mode == "scaled":
        return "scaled-gradient"
    return "replay" if hp is not None and hp.steps > 1 else "scaled-gradient"


def scaled_gradient(target: UpdateTarget, hyperparameters: LocalHyperparameters | None) -> dict[str, torch.Tensor]:
    """g = −Δ/(lr·steps), or −Δ/‖Δ‖ when the hyperparameters are unknown."""
    if hyperparameters is not None:
        scale = 1.0 / (hyperparameters.lr * max(hyperparameters.steps, 1))
    else:
        norm = math.sqrt(sum(float(d.pow(2).sum()) for d in target.delta.values()))
        scale = 1.0 / norm if norm > 0 else 1.0
    return {n: -scale * d for n, d in target.delta.items()}


def soft_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for hard labels (B,) or probability rows (B, C)."""
    if labels.ndim == 1:
        return F.cross_entropy(logits, labels)
    return torch.sum(-labels * F.log_softmax(logits, dim=-1), dim=-1).mean()


class GradientMatcher:
    """Computes, for a dummy batch, the quantity comparable with the observed update.

    ``target`` is the list of observed tensors (as gradients: g = −Δ/(lr·steps), or −Δ/‖Δ‖), and
    ``dummy(x, y)`` the dummy's counterpart (same order, differentiable in x and y). ``scale_known``
    is False when only the direction of the update is known.
    """

    def __init__(self, obs: Observation, mode: str = "auto"):
        self.observation = obs
        self.update = update_target(obs)
        self.mode = resolve_mode(obs, mode)
        self.hyperparameters = obs.known_hyperparameters
        self.scale_known = self.hyperparameters is not None
        self.model = obs.make_model()
        self.model.requires_grad_(False)
        self.model.eval()
        self.names = self.update.names
        gradient = scaled_gradient(self.update, self.hyperparameters)
        self.target = [gradient[n] for n in self.names]
        self.notes = list(self.update.notes)
        hp = self.hyperparameters
        if self.mode == "replay":
            self.notes.append(f"replay mode: {hp.steps} plain cross-entropy SGD step(s) with lr {hp.lr:g} on "
                              f"batches of {hp.batch_size} are replayed from the before-state and matched to the upload")
            if not obs.method.plain_sgd:
                self.notes.append(f"{obs.method.name} does not train with plain cross-entropy SGD on all parameters "
                                  f"(phases, extra losses or augmentation): the replay is an approximation")
        else:
            if hp is None:
                self.notes.append("scaled-gradient mode with unknown hyperparameters: the update is used as "
                                  "g = -delta/||delta|| (direction only)")
            else:
                self.notes.append(f"scaled-gradient mode: the update is used as g = -delta/(lr*steps) "
                                  f"with lr {hp.lr:g}, {hp.steps} step(s)")
                if not obs.method.plain_sgd:
                    self.notes.append(f"{obs.method.name}'s local update is not one cross-entropy gradient step "
                                      f"(phases, extra losses or augmentation): matching it as one is an approximation")

    # -- the dummy's side ---------------------------------------------------------------------
    # Written with torch.func so that the same code serves one target (ordinary autograd on x and y
    # differentiates through torch.func.grad) and a batch of targets (torch.func.vmap over x, y).
    def _loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return soft_cross_entropy(functional_call(self.model, params, (x,)), y)

    def _gradient(self, params: dict[str, torch.Tensor], names: list[str], x: torch.Tensor,
                  y: torch.Tensor) -> dict[str, torch.Tensor]:
        def loss(trained: dict[str, torch.Tensor]) -> torch.Tensor:
            return self._loss({**params, **trained}, x, y)

        return grad(loss)({n: params[n] for n in names})

    def dummy(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The dummy batch's gradient-like quantity for every attacked parameter, differentiable in x
        and y (one target: x (B, C, H, W); under ``torch.func.vmap`` one target per batch row)."""
        if self.mode == "replay":
            return self._replay(x, y)
        gradients = self._gradient(self.update.before, self.names, x, y)
        return [gradients[n] for n in self.names]

    def _replay(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        hp = self.hyperparameters
        start = self.update.before
        trained = list(start)  # plain SGD on every parameter (uploaded or kept private)
        current = dict(start)
        b = x.shape[0]
        bs = max(1, min(hp.batch_size, b))
        for step in range(hp.steps):
            lo = (step * bs) % b
            gradients = self._gradient(current, trained, x[lo:lo + bs], y[lo:lo + bs])
            current = {n: current[n] - hp.lr * gradients[n] for n in trained}
        factor = -1.0 / (hp.lr * max(hp.steps, 1))
        return [factor * (current[n] - start[n]) for n in self.names]

    @functools.cached_property
    def model_key(self) -> tuple:
        """Everything ``shares_model_with`` compares except tensor values, hashable (for bucketing)."""
        hp = self.hyperparameters
        return (self.mode, tuple(self.names), None if hp is None else (hp.lr, hp.steps, hp.batch_size),
                self.scale_known, self.observation.image_shape, self.observation.num_classes,
                type(self.model).__name__, str(self.model), getattr(self.model, "arch", None))

    def shares_model_with(self, other: "GradientMatcher") -> bool:
        """Whether ``other``'s dummy quantity is the same function of (x, y) as this one's: same
        before-state, buffers, attacked parameters, mode, hyperparameters and architecture. Targets that share
        a model can be attacked in one batched optimisation (``attacks.batching``)."""
        if self.model_key != other.model_key or type(self.model) is not type(other.model):
            return False
        # buffers too: functional_call takes them (e.g. the normalisation's mean and std) from one model
        buffers, other_buffers = dict(self.model.named_buffers()), dict(other.model.named_buffers())
        if buffers.keys() != other_buffers.keys() or not all(torch.equal(buffers[k], other_buffers[k]) for k in buffers):
            return False
        mine, theirs = self.update.before, other.update.before
        return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    # -- labels ---------------------------------------------------------------------------------
    def classifier_weight_target(self) -> torch.Tensor | None:
        """The observed gradient-like update of the classifier's weight (None if not attacked)."""
        if CLASSIFIER_WEIGHT in self.names:
            return self.target[self.names.index(CLASSIFIER_WEIGHT)]
        return None


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])
