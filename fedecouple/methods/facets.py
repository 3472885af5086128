"""Facets: what a method may declare beyond the core ``Method`` (``base.py``), one small class per part of
the toolkit that reads it.

A method opts into a facet by inheriting it beside ``Method`` (``class FedAvg(Method, Replay, ...)``) and
implementing its abstract members; a facet's other members have defaults it may override. A caller that
needs a facet asks for it explicitly (``isinstance(method, Replay)``, or ``facet(method, Replay)``: the
method typed as the facet, None without it) and refuses in one line where it is required. What opting in
gives:

* ``Replay``: the gradient attacks replay the client's local training as a differentiable program (their
  ``method`` mode), read what an upload fixes in closed form and count its SGD steps phase by phase;
  without it their ``method`` mode is refused and they match a plain SGD replay or a scaled gradient;
* ``ClassifierStep`` (a ``Replay``): the closed form solves the features of a one-image classifier step
  through the method's own step;
* ``DownloadReach``: malicious-server attacks craft the parameter groups its local training takes as
  sent; without it (or with nothing declared) they are refused before anything trains;
* ``SecureSummation``: it runs under secure aggregation, its server aggregating the sum of its clients'
  summands; ``SecureTwoPass`` (a ``SecureSummation``) needs a second sum, formed from a broadcast of the
  first. A method that communicates without it is refused under secure aggregation in one line
  (``secure_refusal``) that names what ``PerClientFields`` declares its server reads one client at a time;
* ``DPCoverage``: what DP covers of it (the loss terms DP-SGD clips per sample, the whole-data statistics
  the Gaussian mechanism releases, and what neither covers, which DP then refuses); without it DP runs with
  nothing declared: no statistic (a DP context refuses any) and nothing known to be uncovered;
* ``PaperPreset``: the hyperparameters the paper's preset sets for it.

A wrapper that changes how a method trains (the DP method, ``defenses.dp``) has each facet the wrapped
method has: ``facets_of`` names them and ``facet_members`` the members each declares, to forward.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, TypeVar

import torch

from ..channel import Upload
from ..models import SplitModel
from .base import State

F = TypeVar("F", bound="Facet")


class Facet(ABC):
    """Base of the facets. A facet's members are the public names its class body (and its base facets')
    declares: data as annotated class attributes, behaviour as methods."""


class Replay(Facet):
    """The client's local training, as attacks replay it (``fedecouple.methods.replay``).

    Implement ``replay``; declare ``local_phases`` when the training is more than one unaugmented phase
    ``"local"`` of ``epochs`` epochs, and the facts below where they hold."""

    # True: local training is T plain cross-entropy SGD steps on every trained parameter, one phase, no
    # augmentation, no extra loss; replaying those steps on the true batch gives the upload exactly
    plain_sgd: ClassVar[bool] = False
    # the phases of ``local_phases`` whose SGD steps train the extractor
    extractor_phases: ClassVar[tuple[str, ...]] = ("local",)
    # what an upload fixes in closed form, before any optimisation (read and computed by
    # ``attacks.inversion.closed_form``): "last-linear" (when the extractor takes one unaugmented SGD step on
    # one image, the update of its last linear layer gives that layer's input and its error signal δ exactly:
    # weight row / bias entry), "labels" (the classifier's update gives the labels), "statistics" (FedPAC's h
    # and prototypes of a one-image client are its features), "classifier-features" (one classifier step on
    # one image: its features, and its augmented copy's, solved from the classifier's update through the
    # method's ``ClassifierStep``; reported, not matched), "classifier-row-space" (the classifier's weight
    # update spans the features it was trained on), "extractor-linear-input" (with those features, the input
    # of the extractor's last linear layer, whose update spans the inputs of the images the extractor phase
    # trained on)
    closed_form: ClassVar[tuple[str, ...]] = ()

    def local_phases(self, epochs: int) -> list[tuple[str, int, bool]]:
        """The phases of the client's local training, in order: (phase name, as ``ctx.batches`` gets it;
        epochs; whether its batches are augmented)."""
        return [("local", epochs, False)]

    @abstractmethod
    def replay(self, model: SplitModel, context, images: torch.Tensor, labels: torch.Tensor,
               copies: list) -> dict[str, torch.Tensor]:
        """The client's local training as a differentiable program: what it would upload after the steps of
        ``context`` (a ``ReplayContext``) on ``images`` with ``labels``; ``copies[i]`` are step i's augmented
        copies (None for an unaugmented step)."""


class ClassifierStep(Replay):
    """A classifier phase of single differentiable steps (FedeCouple's), which the closed form inverts."""

    @abstractmethod
    def classifier_step(self, model: SplitModel, student: dict, teacher: dict, feats: torch.Tensor,
                        probs: torch.Tensor, lr: float) -> tuple[dict, dict]:
        """One step of the classifier phase on a batch's features: the classifiers after it."""


class DownloadReach(Facet):
    """What a crafted download reaches (``attacks.malicious``)."""

    # parameter groups the client's local training takes exactly as downloaded: trained from (FedAvg's whole
    # model, FedPer's base) or trained against (FedeCouple's global classifier in its GLF step); () : none
    download_reaches: ClassVar[tuple[str, ...]]


class SecureSummation(Facet):
    """Aggregation from a sum (``fedecouple.secure_aggregation``): the server sees only the decoded sum of
    the survivors' summands. Implement ``secure_summands`` and ``secure_aggregate``."""

    # how the secure variant differs from the method as published, in words (None: it does not)
    secure_variant_note: ClassVar[str | None] = None
    # the parameter groups a crafted download reaches under secure aggregation, where the download may hold
    # less (None: as ``DownloadReach`` declares)
    secure_download_reaches: ClassVar[tuple[str, ...] | None] = None

    @abstractmethod
    def secure_summands(self, upload: Upload, max_weight: float, num_classes: int) -> dict[str, torch.Tensor]:
        """What a client adds to the round's secure sum, from its upload: every value scaled to fit the
        protocol's clipping range (``max_weight``: the largest sample count the protocol is set for)."""

    @abstractmethod
    def secure_aggregate(self, server: State, total: dict[str, torch.Tensor], round: int, max_weight: float) -> State:
        """The new server state from the decoded sum of the survivors' ``secure_summands``."""


class SecureTwoPass(SecureSummation):
    """Aggregation from two sums (FedeCouple's eq. 16; ``Federation._second_pass`` runs them): the server
    sends ``secure_broadcast`` of the first sum back to its survivors, those that stay send
    ``secure_second_summands``, and ``secure_second_aggregate`` forms the new state from both sums; with
    fewer than ``secure_second_pass_minimum`` of them the round keeps ``secure_aggregate`` of the first."""

    secure_second_pass_minimum: ClassVar[int]

    @abstractmethod
    def secure_broadcast(self, total: dict[str, torch.Tensor], max_weight: float) -> dict[str, torch.Tensor]:
        """What the server sends the first pass's survivors, from its sum."""

    @abstractmethod
    def secure_second_summands(self, upload: Upload, broadcast: dict[str, torch.Tensor], max_weight: float,
                               num_classes: int) -> dict[str, torch.Tensor]:
        """What a client adds to the second sum, from its upload and the broadcast."""

    @abstractmethod
    def secure_second_aggregate(self, server: State, first: dict[str, torch.Tensor],
                                second: dict[str, torch.Tensor], round: int, max_weight: float) -> State:
        """The new server state from both decoded sums."""


class PerClientFields(Facet):
    """Why a method without ``SecureSummation`` cannot run under secure aggregation, for its refusal."""

    # the upload fields its server must read one client at a time, and why
    per_client_fields: ClassVar[tuple[str, ...]] = ()
    per_client_reason: ClassVar[str] = ""


class DPCoverage(Facet):
    """What differential privacy covers of the method (``defenses.dp``)."""

    # which loss terms are per-sample, in words (DP-SGD's per-sample clipping needs them to be)
    dp_per_sample: ClassVar[str] = "n/a"
    # the whole-data statistics it computes through ``ctx.class_feature_sums``, in words (a DP context
    # releases them through their own Gaussian mechanism); None: none (a DP context then refuses any call,
    # so the declaration stays true)
    dp_statistics: ClassVar[str | None] = None

    def dp_uncovered(self) -> str | None:
        """What neither DP-SGD nor the statistics mechanism covers in this configuration (a clause for an
        error message), or None."""
        return None


class PaperPreset(Facet):
    """The hyperparameters the paper's preset sets for the method (a value the user gave wins)."""

    paper_preset: ClassVar[dict]


FACETS: tuple[type[Facet], ...] = (Replay, ClassifierStep, DownloadReach, SecureSummation, SecureTwoPass,
                                   PerClientFields, DPCoverage, PaperPreset)


def facet(method: object, kind: type[F]) -> F | None:
    """``method`` as the facet ``kind``, or None when it does not declare it."""
    return method if isinstance(method, kind) else None


def facets_of(method: object) -> tuple[type[Facet], ...]:
    """The facets ``method`` declares, the most specific of each line (``SecureTwoPass``, not also
    ``SecureSummation``), in ``FACETS`` order."""
    held = [kind for kind in FACETS if isinstance(method, kind)]
    return tuple(kind for kind in held if not any(other is not kind and issubclass(other, kind) for other in held))


def facet_members(kind: type[Facet]) -> tuple[str, ...]:
    """The members ``kind`` declares, its base facets' included, in declaration order."""
    names: dict[str, None] = {}
    for klass in reversed(kind.__mro__):
        if issubclass(klass, Facet) and klass is not Facet:
            names.update(dict.fromkeys(n for n in (*vars(klass).get("__annotations__", {}), *vars(klass))
                                       if not n.startswith("_")))
    return tuple(names)


def local_phases(method: object, epochs: int) -> list[tuple[str, int, bool]]:
    """The phases of ``method``'s local training (``Replay.local_phases``); a method that declares no
    replay is counted as one unaugmented phase ``"local"`` of ``epochs`` epochs."""
    replay = facet(method, Replay)
    return replay.local_phases(epochs) if replay is not None else [("local", epochs, False)]


def trains_plain_sgd(method: object) -> bool:
    """Whether ``method`` declares (``Replay.plain_sgd``) that its local training is plain cross-entropy SGD."""
    replay = facet(method, Replay)
    return replay is not None and replay.plain_sgd


def download_reach(method: object, secure: bool = False) -> tuple[str, ...]:
    """The parameter groups a crafted download reaches in ``method``'s local training (``DownloadReach``;
    () without it); with ``secure``, under secure aggregation (``SecureSummation.secure_download_reaches``
    where it declares one)."""
    summation = facet(method, SecureSummation)
    if secure and summation is not None and summation.secure_download_reaches is not None:
        return tuple(summation.secure_download_reaches)
    reach = facet(method, DownloadReach)
    return tuple(reach.download_reaches) if reach is not None else ()


def secure_refusal(method) -> str | None:
    """Why ``method`` cannot run under secure aggregation (one line naming the upload fields its server reads
    one by one, ``PerClientFields``), or None: it sends nothing, or declares ``SecureSummation``."""
    if not method.communicates or isinstance(method, SecureSummation):
        return None
    declared = facet(method, PerClientFields) or PerClientFields()
    fields = ", ".join(declared.per_client_fields) or "every upload field"
    return (f"{method.name} cannot run under secure aggregation: its server reads {fields} of each client on "
            f"its own ({declared.per_client_reason}), which the protocol never reveals; turn secure aggregation off, "
            f"or pick a method that aggregates a sum (fedavg, ft-fedavg, fedper, fedrep, fedproto, fedecouple, fedpac)")


def secure_passes(method: object) -> int:
    """The secure sums a round of ``method`` takes: 2 for a ``SecureTwoPass``, else 1."""
    return 2 if isinstance(method, SecureTwoPass) else 1


def dp_coverage(method: object) -> DPCoverage:
    """What ``method`` declares DP covers (``DPCoverage``); for a method without the facet, the facet's
    defaults: nothing declared."""
    return facet(method, DPCoverage) or DPCoverage()
