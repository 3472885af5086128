"""The common shape of every attack: ``attack(observation, budget, seed) -> AttackResult``.

An ``Observation`` is what an honest-but-curious server holds about one client in one round:
the download it sent and the upload it received (from the channel recorder), the client's
previous upload (the server's memory of parts the client keeps across rounds), and the threat
model's switches. It never holds the client's data: ground truth is used only for scoring, by the
harness, after the attack returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fedecouple.methods.base import FieldSpec, Method
from fedecouple.models import SplitModel

from .choices import STARTS  # noqa: F401  (``Budget.start``'s choices, where callers look for them)


@dataclass
class LocalHyperparameters:
    """What the server may know (or guess) about the client's local training: the learning rate, the
    batch size and epochs, the client's number of samples (FedAvg-style methods upload it), or, in
    the victim setting, the steps per phase. ``steps`` is the total number of SGD steps (what the
    plain replay and the scaled-gradient reading use)."""

    lr: float
    steps: int
    batch_size: int
    epochs: int = 1
    samples: int | None = None
    steps_per_phase: int | None = None


@dataclass
class KnownSchedule:
    """The oracle threat model (an upper bound): the client's true batch order and augmentation
    draws, per SGD step (``fedecouple.methods.replay.Step``; draws None for an unaugmented step)."""

    steps: list
    draws: list


@dataclass
class Observation:
    """The server's view of one client in one round. The tensors are the recorder's own (not
    copies): attacks read them and never write to them."""

    method: Method  # the protocol the client follows: its name, manifest, persistent groups, replay facts
    round: int
    client_id: int
    download: dict[str, torch.Tensor]
    upload: dict[str, torch.Tensor]
    previous_upload: dict[str, torch.Tensor] | None
    make_model: Callable[[], SplitModel]  # a fresh model of the federation's architecture at its initial weights
    image_shape: tuple[int, int, int]
    num_classes: int
    known_hyperparameters: LocalHyperparameters | None = None  # None: the server does not know them
    head_known: bool = True  # False: the client's classifier is private (FedPer/FedRep)
    known_schedule: KnownSchedule | None = None  # the oracle threat model; None: the server guesses it
    # how an attacker without the draws models each augmented copy: "free" (an unknown image) or
    # "family" (a transform of the image from the augmentation family, its parameters unknown)
    copies: str = "free"
    # public data of the same domain the server holds (images in [0, 1], labels), and the prototypes
    # it aggregated from every upload of this round: the auxiliary-data threat model of ``proto``
    auxiliary: tuple[torch.Tensor, torch.Tensor] | None = None
    round_prototypes: dict[int, torch.Tensor] | None = None
    # a malicious server's record of the download it crafted for this client
    # (``attacks.malicious.CraftRecord``: the weights as sent); None: an honest server
    crafted: object | None = None
    device: str = "cpu"  # where the tensors above and ``make_model``'s model live, and the attack computes
    # costly facts derived from the fields above alone (the closed form's solves), kept so that the attack
    # and its forward check compute them once; never part of what the server saw
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def manifest(self) -> list[FieldSpec]:
        """The fields the method declares it uploads (``Method.manifest``)."""
        return self.method.manifest(self.make_model())


@dataclass
class Budget:
    iterations: int = 300
    restarts: int = 1
    batch: int = 1  # how many images to reconstruct
    start: str = "noise"  # DLG's dummy images: uniform noise, or the per-channel mean (public: the model's Normalize)


@dataclass
class AttackResult:
    images: torch.Tensor  # (B, C, H, W) in [0, 1]
    labels: torch.Tensor  # (B,) predicted labels, -1 where the attack gives none
    trace: dict = field(default_factory=dict)  # loss history, chosen mode, timings
    notes: list[str] = field(default_factory=list)  # plain sentences for the user
    # the optimised variables at the kept iterate, for the forward-model check: every dummy image
    # (the B reconstructions, then any free augmented copies) and the label probability rows
    variables: dict[str, torch.Tensor] = field(default_factory=dict)


class NotApplicable(Exception):
    """The observation carries nothing this attack can use (e.g. no gradients for FedProto)."""
