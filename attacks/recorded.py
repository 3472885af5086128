"""A finished federation as an attacker sees it, however it ran, and the threat model that says how
much of it the server may use.

``fedsec attack`` and ``fedsec audit`` train a federation in fedsec's own engine; ``fedsec flower``
runs a Flower app in Flower's simulation engine. Both end in a ``RecordedRun``: what the server
recorded through its channel, the harness-only ground truth, the data, and the facts a
method-aware attacker may know. ``attacks.harness.attack_recorded`` and
``fedsec.jobs.audit.audit_recorded`` take it from there, so both paths share one harness.

``RecordedRun.observe`` builds the whole ``Observation`` of one target under a ``ThreatModel``:
the server's view from the recorder, plus what the threat model hands the attacker (the local
hyperparameters, the classifier, the augmentation draws, public data, a crafted download).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from fedecouple.backends import Backend, SequentialBackend
from fedecouple.channel import Recorder
from fedecouple.data.dataset import ImageDataset
from fedecouple.data import load_dataset
from fedecouple.engine import GroundTruth, VictimSetting
from fedecouple.methods.base import Method, TrainConfig, phase_steps, upload_kinds
from fedecouple.methods.facets import local_phases
from fedecouple.methods.replay import Step
from fedecouple.models import SplitModel

from .base import KnownSchedule, LocalHyperparameters, Observation
from .inversion.observation import observe
from .inversion.prototypes import per_class_values


@dataclass(frozen=True)
class ThreatModel:
    """What the server may use beyond the recorded traffic.

    ``hyperparameters_known``: the client's local training settings (lr, steps, batch size);
    ``head_known`` False drops the classifier's update; ``augmentations`` how the attacker models
    the augmented copies a client trains on ("free": unknown images, "family": transforms of the
    image, parameters unknown, "oracle": the client's batch order and draws, an upper bound);
    ``aux_data`` an embedded data set's name the server holds as public data; ``mode`` the forward
    model (``attacks.inversion.observation.MODES``); ``craft`` a malicious server's crafted download
    (None: an honest server)."""

    hyperparameters_known: bool = True
    head_known: bool = True
    augmentations: str = "free"
    aux_data: str | None = None
    mode: str = "auto"
    craft: str | None = None


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
    # the clients' download check, when one ran (``defenses.download_check.DownloadCheck``):
    # ``summary(attacked)`` gives its detection statistics
    download_check: object | None = None
    # under secure aggregation, the clients' download-consistency check when one ran
    # (``defenses.consistency_check.ConsistencyCheck``): detections on the rounds whose downloads differed
    consistency_check: object | None = None
    device: str = "cpu"  # where the gradient attacks compute (``fedecouple.devices``)

    def upload_kinds(self) -> set[str]:
        return upload_kinds(self.method, self.make_model())

    def observe(self, round: int, client: int, threat: ThreatModel, victim: VictimSetting | None = None, *,
                auxiliary: tuple[torch.Tensor, torch.Tensor] | None = None, device: str = "cpu") -> Observation:
        """The whole ``Observation`` of ``client`` in ``round`` under ``threat`` (``auxiliary``: the
        public data ``threat.aux_data`` names, loaded once for all targets by ``auxiliary_data``)."""
        exchange = self.recorder.get(round, client)
        upload = None if exchange is None else exchange.upload  # none: ``observe`` says why
        oracle = threat.augmentations == "oracle"
        return observe(self.recorder, round, client, method=self.method, make_model=self.make_model,
                       image_shape=tuple(self.dataset.images.shape[1:]), num_classes=self.dataset.num_classes,
                       known_hyperparameters=None if upload is None else self.known_hyperparameters(upload, threat, victim),
                       head_known=threat.head_known,
                       known_schedule=self.known_schedule(round, client) if oracle else None,
                       copies="free" if oracle else threat.augmentations, auxiliary=auxiliary,
                       round_prototypes=None if auxiliary is None else self.round_prototypes(round),
                       crafted=self.crafted.get((round, client)), device=device)

    def known_hyperparameters(self, upload, threat: ThreatModel,
                              victim: VictimSetting | None) -> LocalHyperparameters | None:
        """The "hyperparameters known" threat model: the client's lr, batch size and epochs (or, in the
        victim setting, its steps and images), and its number of samples from its upload; the steps
        are derived the way the client takes them (``phase_steps``: a ragged last batch is dropped)."""
        if not threat.hyperparameters_known:
            return None
        train = self.train
        if victim is not None:
            return LocalHyperparameters(lr=train.lr, steps=victim.steps, batch_size=victim.batch,
                                        epochs=train.local_epochs, samples=victim.batch, steps_per_phase=victim.steps)
        sample_count = upload.tensors.get("sample_count")
        n = int(sample_count) if sample_count is not None else train.batch_size
        steps = sum(phase_steps(epochs, n, train.batch_size)
                    for _, epochs, _ in local_phases(self.method, train.local_epochs))
        return LocalHyperparameters(lr=train.lr, steps=steps, batch_size=train.batch_size, epochs=train.local_epochs,
                                    samples=n)

    def known_schedule(self, round: int, client: int) -> KnownSchedule:
        """The oracle threat model: the client's true batch order and augmentation draws (harness-only
        ground truth handed to the attacker on purpose, for an upper bound)."""
        records = self.ground_truth.schedule(round, client)
        return KnownSchedule([Step(r.phase, tuple(int(p) for p in r.positions)) for r in records],
                             [r.draws for r in records])

    def round_prototypes(self, round: int) -> dict[int, torch.Tensor]:
        """Per class, the mean of the prototypes every client uploaded in ``round`` (the server sees them
        all; equal weights)."""
        specs = [s for s in self.method.manifest(self.make_model()) if s.kind == "prototype" and s.per_class]
        sums: dict[int, list[torch.Tensor]] = {}
        for (r, _), exchange in sorted(self.recorder.exchanges.items()):
            if r == round and exchange.upload is not None:
                for k, proto in per_class_values(dict(exchange.upload.tensors), specs).items():
                    sums.setdefault(k, []).append(proto.float().flatten())
        return {k: torch.stack(v).mean(0) for k, v in sorted(sums.items())}


def auxiliary_data(name: str, like, exclude: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedded data set ``name`` as public data of ``like``'s domain: resized (bilinear) to its
    image size and converted to its number of channels. When it is ``like`` itself, the images at
    ``exclude`` (the attacked clients' own) are left out: the server's data is disjoint from theirs."""
    data = load_dataset(name)
    x, labels = data.images, data.labels
    if name == like.name and exclude is not None and len(exclude):
        keep = torch.ones(len(labels), dtype=torch.bool)
        keep[torch.from_numpy(exclude)] = False
        x, labels = x[keep], labels[keep]
    if x.shape[-1] != like.image_size:
        x = torch.nn.functional.interpolate(x, size=(like.image_size, like.image_size), mode="bilinear",
                                            align_corners=False).clamp(0, 1)
    if x.shape[1] != like.channels:
        x = x.mean(dim=1, keepdim=True).expand(-1, like.channels, -1, -1).contiguous()
    return x, labels
