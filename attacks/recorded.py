"""A finished federation as the attack and audit harnesses see it, however it ran.

``fedsec attack`` and ``fedsec audit`` train a federation in fedsec's own engine; ``fedsec flower``
runs a Flower app in Flower's simulation engine. Both end in a ``RecordedRun``: what the server
recorded through its channel, the harness-only ground truth, the data, and the facts a
method-aware attacker may know. ``fedsec.attack.attack_recorded`` and
``fedsec.audit.audit_recorded`` take it from there, so both paths share one harness.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from fedecouple.backends import Backend, SequentialBackend
from fedecouple.channel import Recorder
from fedecouple.data.dataset import ImageDataset
from fedecouple.engine import GroundTruth
from fedecouple.methods.base import Method, TrainConfig
from fedecouple.models import SplitModel


@dataclass
class RecordedRun:
    """Everything the harness needs about a finished federation.

    ``recorder`` holds every recorded download and upload (the server's view); ``ground_truth``
    which samples each client trained on (read only to score); ``method`` the protocol the clients
    follow (its name, manifest and persistent groups); ``make_model()`` the architecture at the
    federation's *initial* weights (the server built it); ``train`` the clients' local training
    settings (what the "hyperparameters known" threat model hands the attacker); ``label`` names
    the run in outputs; ``backend`` is where attack batches run."""

    recorder: Recorder
    ground_truth: GroundTruth
    dataset: ImageDataset
    method: Method
    make_model: Callable[[], SplitModel]
    train: TrainConfig
    label: str
    backend: Backend = field(default_factory=SequentialBackend)
    # a malicious server's records of the downloads it crafted, by (round, client)
    # (``attacks.malicious.CraftRecord``); empty for an honest server
    crafted: dict = field(default_factory=dict)
    # the clients' download check (``fedsec.defenses.download_check.DownloadCheck``), when one ran
    download_check: object | None = None
    device: str = "cpu"  # where the gradient attacks compute (``fedecouple.devices``)

    def upload_kinds(self) -> set[str]:
        return self.method.upload_kinds(self.make_model())
