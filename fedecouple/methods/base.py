"""The narrow interface every federated method implements, and what a client update sees.

A method is a set of pure-ish functions over plain tensor dictionaries:

* server side: ``init_server`` → server state; ``download`` → what a selected client is sent;
  ``aggregate`` → new server state from the uploads that came through the channel;
* client side: ``client_update(ctx, state, download) → (new state, upload)``, where ``state`` is
  only what the method keeps on the client between rounds (e.g. a personal classifier);
* evaluation: ``personalized`` → the parameters of the client's personalised model.

States are ``dict[str, Tensor]`` so they checkpoint with ``torch.load(weights_only=True)`` and can
later be shipped to another execution engine. ``manifest`` declares, in one place, every field the
method uploads: the channel tests hold each method to it.

What a method may declare beyond this core, each part of the toolkit reading its own, are facets it
opts into (``facets.py``): a replay of its local training for the attacks, what a crafted download
reaches, secure aggregation from sums, what differential privacy covers, the paper's preset.

What methods share beyond the interface lives beside it: the server's averaging in ``averaging.py``, the
client's local training loops (``sgd``, ``train_supervised``, ``train_head``, ``train_extractor``) in
``training.py``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Callable, ClassVar, Iterator

import numpy as np
import torch

from ..channel import Download, Upload
from ..data.augment import BatchAugmenter, Draw
from ..errors import DIVERGED, UserError
from ..models import SplitModel, get_params

State = dict[str, torch.Tensor]
KINDS = ("extractor", "classifier", "prototype", "class_counts", "statistic", "sample_count")


@dataclass(frozen=True)
class FieldSpec:
    """One uploaded field. ``per_class`` fields are sent as ``name.format(k=class)`` for a subset of
    classes (e.g. prototypes of the classes a client holds)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    per_class: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown field kind {self.kind!r}")
        if self.per_class and "{k}" not in self.name:
            raise ValueError(f"per-class field {self.name!r} has no '{{k}}' placeholder")

    @property
    def pattern(self) -> re.Pattern:
        """The names this field is sent under: the name itself, or for a per-class field every
        ``name.format(k=class)`` (group 1 is the class id)."""
        if not self.per_class:
            return re.compile(re.escape(self.name) + r"\Z")
        head, tail = self.name.split("{k}", 1)
        return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"\Z")


def model_fields(model: SplitModel, group: str) -> list[FieldSpec]:
    """Manifest entries for every parameter of one group (``extractor`` or ``classifier``)."""
    return [FieldSpec(n, group, tuple(p.shape)) for n, p in model.named_parameters() if n.startswith(group + ".")]


SAMPLE_COUNT = FieldSpec("sample_count", "sample_count", ())


@dataclass
class TrainConfig:
    lr: float = 0.05
    batch_size: int = 10
    local_epochs: int = 1
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass
class BatchRecord:
    """One SGD step's batch as the harness-only ground truth keeps it: the phase, the images'
    positions in the client's training set and in the pooled data set (in batch order), and, when
    the batch was augmented, what the augmentation drew for each image."""

    phase: str
    positions: np.ndarray
    indices: np.ndarray
    draws: list[Draw] | None = None


def phase_steps(epochs: int, n: int, batch_size: int, steps_per_phase: int | None = None) -> int:
    """The SGD steps of one training phase of ``epochs`` epochs on ``n`` samples, as
    ``ClientContext.batches`` takes them: ``n // bs`` per epoch with ``bs = min(batch_size, n)`` (a
    ragged last batch is dropped), or exactly ``steps_per_phase`` in the victim setting."""
    if n == 0:
        return 0
    if steps_per_phase is not None:
        return int(steps_per_phase)
    return int(epochs) * (n // min(batch_size, n))


@dataclass
class ClientContext:
    """Everything a client's local update may use: its own data, a shared workspace model whose
    weights the method must set, the training config and a seeded generator."""

    client_id: int
    round: int
    images: torch.Tensor
    labels: torch.Tensor
    indices: np.ndarray  # positions in the pooled data set, for the ground-truth hook only
    model: SplitModel
    config: TrainConfig
    num_classes: int
    generator: torch.Generator
    steps_per_phase: int | None = None  # victim setting: T steps per phase instead of epochs
    batch_log: list[BatchRecord] = field(default_factory=list)
    # values the client computes and keeps to itself (e.g. FedeCouple's anchors); handed to the
    # harness-only ground-truth hook so audits can verify they never appear in an upload
    private: dict[str, torch.Tensor] = field(default_factory=dict)
    _augmenter: BatchAugmenter | None = None

    @property
    def num_samples(self) -> int:
        return int(self.labels.shape[0])

    def class_counts(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)

    def class_feature_sums(self, features: Callable[[torch.Tensor], torch.Tensor],
                           squared_norms: bool = False) -> "ClassFeatureSums":
        """Per-class sums of ``features(images)`` over the client's un-augmented training images,
        the class counts and, with ``squared_norms``, per-class sums of ‖feature‖².

        The one way a method reads a whole-data statistic of the client's features (class means,
        prototypes, anchors, FedPAC's h and V are formed from it). ``features`` must act on each
        image on its own (one row out per image in). A DP context overrides this with a Gaussian
        mechanism (``defenses.dp_statistics``); here the numbers are exact."""
        return ClassFeatureSums.of(features(self.images), self.labels, self.num_classes, squared_norms)

    def class_means(self, model: SplitModel) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-class mean feature of ``model``, class counts) over the client's un-augmented
        training images, through ``class_feature_sums`` (rows of absent classes are zero)."""
        sums = self.class_feature_sums(lambda images: extract_features(model, images))
        return sums.means(), sums.counts

    def batches(self, epochs: int, phase: str, augment: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Mini-batches drawn by index from the in-memory tensors.

        ``epochs`` passes over shuffled data (a last batch smaller than the batch size is dropped;
        a client with fewer samples than the batch size trains on one batch of all of them), or
        exactly ``steps_per_phase`` batches in the victim setting. With ``augment`` each batch is the
        originals followed by one augmented copy of each (the paper trains on original + augmented
        data). Every batch goes to the ground-truth log (``BatchRecord``), which only the harness reads.
        ``phase_steps`` counts the batches this yields.
        """
        n = self.num_samples
        if n == 0:
            return
        bs = min(self.config.batch_size, n)
        total = phase_steps(epochs, n, bs, self.steps_per_phase)
        emitted = 0
        while emitted < total:  # epochs: each a fresh shuffle, a ragged last batch dropped
            order = torch.randperm(n, generator=self.generator)
            for start in range(0, n - bs + 1, bs):
                # (drop_last, as torch's loaders and PFLlib's: a one-image SGD step at the end of
                # every epoch can wreck a model)
                if emitted >= total:
                    return
                sel = order[start:start + bs]
                x, y = self.images[sel], self.labels[sel]
                record = BatchRecord(phase, sel.numpy(), self.indices[sel.numpy()])
                if augment:
                    if self._augmenter is None:
                        self._augmenter = BatchAugmenter(x.shape[-1])
                    copies, record.draws = self._augmenter.augment(x)
                    x, y = torch.cat([x, copies]), torch.cat([y, y])
                self.batch_log.append(record)
                emitted += 1
                yield x, y

    def check_finite(self, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss):
            raise UserError(
                f"{DIVERGED} (non-finite loss) on client {self.client_id} in round {self.round}; lower lr",
                fields=("lr",))


@dataclass(frozen=True)
class ClassFeatureSums:
    """What ``ClientContext.class_feature_sums`` returns: per-class sums of features (C, d), class
    counts (C,) int64 and per-class sums of squared feature norms (C,) or None. A class with count
    0 is absent: its rows are zero. Means and FedPAC's statistics are formed from these by the same
    formulas with or without DP (a DP context returns noisy sums and guarded noisy counts)."""

    sums: torch.Tensor
    counts: torch.Tensor
    squared_norms: torch.Tensor | None = None

    @classmethod
    def of(cls, features: torch.Tensor, labels: torch.Tensor, num_classes: int,
           squared_norms: bool = False) -> "ClassFeatureSums":
        """Exact per-class sums of the rows of ``features`` (one row per sample of ``labels``)."""
        counts = torch.bincount(labels, minlength=num_classes)
        sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)\
            .index_add_(0, labels, features)
        squares = None
        if squared_norms:
            squares = torch.zeros(num_classes, dtype=features.dtype, device=features.device)\
                .index_add_(0, labels, features.pow(2).sum(dim=1))
        return cls(sums, counts, squares)

    def denominators(self) -> torch.Tensor:
        """(C,) counts clamped below at 1, in the sums' dtype: what means divide by."""
        return self.counts.clamp_min(1).to(self.sums.dtype)

    def means(self) -> torch.Tensor:
        """(C, d) per-class mean feature; rows of absent classes are zero."""
        return self.sums / self.denominators().unsqueeze(1)


@torch.no_grad()
def extract_features(model: SplitModel, images: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    return torch.cat([model.features(images[i:i + chunk]) for i in range(0, len(images), chunk)]) \
        if len(images) else torch.zeros(0, model.feature_dim, device=images.device)


def only_group(tensors, group: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.startswith(group + ".")}


class Method:
    """The core every federated method implements. Subclasses are dataclasses whose fields are the
    method's hyperparameters.

    A method implements ``manifest`` (every field it uploads), ``client_update``, ``aggregate`` and
    ``personalized``; ``init_server``, ``init_client`` and ``download`` default to one global model of
    every parameter (``"global." + name``) sent whole, with nothing kept on the client. It names itself
    (``name``; its one-line summary is in its declaration, ``fedecouple.methods.METHODS``) and declares what
    the engine and the upload filters read of every method: whether it talks to the server at all
    (``communicates``) and which parameter groups its client keeps between rounds (``persistent_groups``).

    Everything else is a facet it opts into (``facets.py``), each read by one part of the toolkit:
    ``Replay`` (attacks replay its local training), ``ClassifierStep``, ``DownloadReach`` (what a malicious
    server's crafted download reaches), ``SecureSummation`` / ``SecureTwoPass`` (it runs under secure
    aggregation; ``PerClientFields`` words the refusal of a method that does not), ``DPCoverage`` (what
    differential privacy covers of it) and ``PaperPreset``."""

    name: ClassVar[str] = "method"
    # parameter groups whose value before local training is the client's own kept state rather
    # than what the server sent (FedeCouple's personal classifier); a server that wants the
    # client's update for such a group must use the client's previous upload of it
    persistent_groups: ClassVar[tuple[str, ...]] = ()
    # False: no download is sent and no upload leaves the client (the engine skips the channel)
    communicates: ClassVar[bool] = True

    @classmethod
    def accepted(cls, hyperparameters: dict) -> dict:
        """The entries of ``hyperparameters`` this method takes (``hyperparameter_names``)."""
        names = hyperparameter_names(cls)
        return {k: v for k, v in hyperparameters.items() if k in names}

    def manifest(self, model: SplitModel) -> list[FieldSpec]:
        raise NotImplementedError

    def init_server(self, model: SplitModel) -> State:
        return {"global." + k: v for k, v in get_params(model).items()}

    def init_client(self, model: SplitModel, client_id: int) -> State:
        return {}

    def download(self, server: State, client_id: int, round: int) -> dict[str, torch.Tensor]:
        return strip_prefix(server, "global.")

    def client_update(self, ctx: ClientContext, state: State, download: Download) -> tuple[State, Upload]:
        raise NotImplementedError

    def aggregate(self, server: State, uploads: list[Upload], round: int) -> State:
        raise NotImplementedError

    def personalized(self, ctx: ClientContext, server: State, state: State) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hyperparameters(self) -> dict:
        return {name: getattr(self, name) for name in hyperparameter_names(type(self))}


def hyperparameter_names(method: type[Method] | Method) -> tuple[str, ...]:
    """A method's hyperparameters: its dataclass fields."""
    return tuple(f.name for f in fields(method)) if hasattr(method, "__dataclass_fields__") else ()


def upload_kinds(method: Method, model: SplitModel) -> set[str]:
    """The field kinds ``method`` declares it uploads (empty when it never communicates)."""
    return {spec.kind for spec in method.manifest(model)} if method.communicates else set()


def strip_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def add_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in tensors.items()}


def make_upload(ctx: ClientContext, tensors: dict[str, torch.Tensor], sample_count: bool = True, **meta) -> Upload:
    """An upload of ``tensors`` (plus the client's training-set size unless ``sample_count=False``)."""
    tensors = dict(tensors)
    if sample_count:
        tensors["sample_count"] = torch.tensor(ctx.num_samples, dtype=torch.int64)
    return Upload(ctx.round, ctx.client_id, tensors, meta)
