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


@dataclass
class LocalHyperparameters:
    """What the server may know (or guess) about the client's local training."""

    lr: float
    steps: int
    batch_size: int


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

    def manifest(self) -> list[FieldSpec]:
        """The fields the method declares it uploads (``Method.manifest``)."""
        return self.method.manifest(self.make_model())


@dataclass
class Budget:
    iterations: int = 300
    restarts: int = 1
    batch: int = 1  # how many images to reconstruct


@dataclass
class AttackResult:
    images: torch.Tensor  # (B, C, H, W) in [0, 1]
    labels: torch.Tensor  # (B,) predicted labels, -1 where the attack gives none
    trace: dict = field(default_factory=dict)  # loss history, chosen mode, timings
    notes: list[str] = field(default_factory=list)  # plain sentences for the user


class NotApplicable(Exception):
    """The observation carries nothing this attack can use (e.g. no gradients for FedProto)."""
