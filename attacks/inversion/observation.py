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
  uses the last global head if the download has one, else the initial head, and says so. In round
  0 the initial head is the client's (it has not trained yet); after it the client's head has moved
  in rounds the server never saw, so those parameters are **unknown** (``UpdateTarget.unknown``): the
  stand-in is only where a fit starts, and the attacks fit them (the head-free closed form of
  ``attacks.inversion.closed_form``, or ``GradientMatcher``'s fitted private parameters).

The forward model that compares a dummy batch with the update (``GradientMatcher``, the
replays, the augmentation family) is ``attacks.inversion.forward_model``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fedecouple.devices import to_device
from fedecouple.methods.facets import Replay
from fedecouple.models import SplitModel, group_of, use_batch_statistics

from ..base import KnownSchedule, LocalHyperparameters, NotApplicable, Observation
from ..choices import AUGMENTATION_MODELS, COPY_MODELS, MODES  # noqa: F401  (read here too)

CLASSIFIER_WEIGHT = "classifier.weight"


def observe(recorder, round: int, client_id: int, *, method, make_model: Callable[[], SplitModel],
            image_shape: tuple[int, int, int], num_classes: int,
            known_hyperparameters: LocalHyperparameters | None = None, head_known: bool = True,
            known_schedule: KnownSchedule | None = None, copies: str = "free",
            auxiliary: tuple[torch.Tensor, torch.Tensor] | None = None,
            round_prototypes: dict[int, torch.Tensor] | None = None, crafted: object | None = None,
            device: str = "cpu") -> Observation:
    """The server's view of ``client_id`` in ``round``: download as sent, upload as received,
    previous upload (the recorder's tensors, not copies, unless ``device`` is not the CPU: then
    copies there, where the attack computes), and what the threat model hands the attacker (the
    ``Observation`` fields of the same names; ``attacks.recorded.RecordedRun.observe`` derives them
    from a ``ThreatModel``). ``method`` is the Method object whose protocol the client follows."""
    exchange = recorder.get(round, client_id)
    if exchange is None:
        raise ValueError(f"round {round} of client {client_id} was not recorded (the recorder keeps "
                         f"rounds {sorted(recorder.rounds) if recorder.rounds is not None else 'all'})")
    if exchange.upload is None:
        raise ValueError(f"client {client_id} sent no upload in round {round} (dropped by the channel)")
    previous = recorder.previous_upload(client_id, round)
    return Observation(
        method=method, round=round, client_id=client_id, download=to_device(exchange.download.tensors, device),
        upload=to_device(exchange.upload.tensors, device),
        previous_upload=None if previous is None else to_device(previous.tensors, device),
        # BatchNorm as the client trained (batch statistics), and pure (running statistics never move)
        make_model=lambda: use_batch_statistics(make_model()).to(device), image_shape=tuple(image_shape),
        num_classes=int(num_classes), known_hyperparameters=known_hyperparameters, head_known=head_known,
        known_schedule=known_schedule, copies=copies, auxiliary=auxiliary, round_prototypes=round_prototypes,
        crafted=crafted, device=str(device))


@dataclass
class UpdateTarget:
    """The update an attack inverts, derived from an observation only."""

    before: dict[str, torch.Tensor]  # every model parameter at the start of local training, as the server knows it
    delta: dict[str, torch.Tensor]  # after − before, for the attacked parameters
    names: list[str]  # attacked parameters (uploaded model weights, minus the head when it is "unknown")
    classifier_update: bool  # whether the classifier's update is among the attacked parameters
    notes: list[str] = field(default_factory=list)
    # parameters the client trained but never uploaded whose before-state the server cannot know (a
    # private head after round 0): ``before`` holds only a stand-in for them
    unknown: list[str] = field(default_factory=list)


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
    unknown: list[str] = []
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
            if obs.round > 0:  # trained in earlier rounds the server never saw
                unknown.append(name)
            note_once(group, f"the client's {group} is not uploaded (kept private): "
                             + (f"in round 0 it is {stand_in}" if obs.round == 0 else
                                f"after round 0 the server does not hold it; its stand-in is {stand_in}"))
    names = list(uploaded)
    if not obs.head_known and any(group_of(n) == "classifier" for n in names):
        names = [n for n in names if group_of(n) != "classifier"]
        notes.append("threat model 'head unknown': the classifier's update is not used")
    if not names:
        raise NotApplicable(f"{obs.method.name}'s upload holds only the classifier and the threat model excludes it")
    delta = {n: (obs.upload[n].to(torch.get_default_dtype()) - before[n].to(torch.get_default_dtype())) for n in names}
    if all(float(d.abs().max()) == 0.0 for d in delta.values()):
        notes.append("the uploaded weights equal the before-state: the client's update is zero")
    return UpdateTarget(before={k: v.detach().to(torch.get_default_dtype()) for k, v in before.items()}, delta=delta,
                        names=names, classifier_update=any(group_of(n) == "classifier" for n in names), notes=notes,
                        unknown=unknown)


def kept_model(obs: Observation, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The client's kept model as the server can know it: each parameter from its previous upload where
    that holds it, else the initial weights (``initial``: the parameters of ``obs.make_model()``)."""
    previous = obs.previous_upload or {}
    return {n: previous[n].to(torch.get_default_dtype()) if n in previous else v for n, v in initial.items()}


def resolve_mode(obs: Observation, mode: str = "auto") -> str:
    """``method``, ``replay`` or ``scaled-gradient`` for the requested ``mode`` (auto, method, replay,
    scaled). ``auto``: the method's own replay when the hyperparameters are known and its local
    training is not plain SGD; otherwise the plain replay for more than one step, else the scaled
    gradient (for plain SGD the three are the same computation)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    hp, method = obs.known_hyperparameters, obs.method
    if mode in ("replay", "method") and hp is None:
        raise ValueError(f"{mode} needs the client's local hyperparameters (lr, steps, batch size): "
                         "use the 'hyperparameters known' threat model or the scaled mode")
    if mode == "method" and not isinstance(method, Replay):
        raise ValueError(f"{method.name} declares no replay of its local training; use --mode replay or scaled")
    if mode in ("replay", "method"):
        return mode
    if mode == "scaled":
        return "scaled-gradient"
    if hp is not None and isinstance(method, Replay) and not method.plain_sgd:
        return "method"
    return "replay" if hp is not None and hp.steps > 1 else "scaled-gradient"
