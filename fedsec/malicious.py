"""The harness side of a malicious server (``attacks.malicious``): the download interceptor that
sends the crafted weights (the scoring of what the attack read back is ``attacks.malicious.scoring``).

``MaliciousServer`` is a channel interceptor. For the attacked (round, client) pairs only, it
replaces the download with the crafted one and keeps the server's record of what it sent
(``records``); every other download passes unchanged. The channel's recorder stores each download
before the interceptors, so the recorder's view stays the honest one; the attack gets the crafted
record beside it (the server knows what it sent). The public images it crafts from are data of the
same domain the server holds: the pooled data set without the attacked clients' training images
(or ``--aux-data``).

Classifier fishing (``attacks.malicious.fishing``) picks the class it fishes from the client's label
counts, which the server reads from that client's earlier exchange (the download it sent and the
upload it got back, the latest before the attacked round) with the toolkit's label inference
(``attacks.inversion.labels``): so the interceptor also keeps the attacked clients' earlier
downloads and uploads.
"""
from __future__ import annotations

import numpy as np
import torch

from attacks.base import NotApplicable, Observation
from attacks.inversion.labels import label_inference
from attacks.malicious import FISHING, craft, fishing_download
from fedecouple.channel import Download, Interceptor, Upload
from fedecouple.engine import derive_seed
from fedecouple.methods.base import phase_steps

# public images the server crafts from (a seeded sample of what it holds)
PUBLIC_IMAGES = 2000


class MaliciousServer(Interceptor):
    """Rewrites the download of ``targets`` ({(round, client)}) with ``craft`` (an ``attacks.malicious``
    craft name) built from ``public`` images; ``reached`` is the method's ``download_reaches``.
    Fishing also needs the public images' ``public_labels`` and the federation's ``method``."""

    name = "malicious-server"

    def __init__(self, kind: str, targets: set[tuple[int, int]], make_model, public: torch.Tensor,
                 reached: tuple[str, ...], seed: int = 0, public_labels: torch.Tensor | None = None,
                 method=None, train=None) -> None:
        self.kind, self.targets, self.make_model = kind, set(targets), make_model
        self.public, self.reached, self.seed = public, tuple(reached), int(seed)
        self.public_labels, self.method, self.train = public_labels, method, train
        self.records: dict[tuple[int, int], object] = {}
        self._clients = {c for _, c in self.targets}
        # fishing: each attacked client's latest exchange seen so far ({client: (round, download, upload)})
        self._earlier: dict[int, tuple[int, dict, dict | None]] = {}

    def on_download(self, message: Download) -> Download:
        key = (message.round, message.client_id)
        if key not in self.targets:
            if self.kind == FISHING and message.client_id in self._clients:
                self._earlier[message.client_id] = (message.round, dict(message.tensors), None)
            return message
        if self.kind == FISHING:
            counts, steps = self.label_counts(message.client_id, message.round)
            tensors, record = fishing_download(dict(message.tensors), self.make_model(), self.public,
                                               self.public_labels, counts, steps)
        else:
            tensors, record = craft(self.kind, dict(message.tensors), self.make_model(), self.public, self.reached,
                                    seed=derive_seed(self.seed, *key, 0x7A9) % 2**31)
        self.records[key] = record
        if self.kind == FISHING:  # a later attacked round reads this exchange as the client's earlier one
            self._earlier[message.client_id] = (message.round, dict(tensors), None)
        return Download(message.round, message.client_id, tensors, dict(message.meta))

    def on_upload(self, message: Upload) -> Upload:
        earlier = self._earlier.get(message.client_id)
        if earlier is not None and earlier[0] == message.round:
            self._earlier[message.client_id] = (earlier[0], earlier[1], dict(message.tensors))
        return message

    def label_counts(self, client: int, round: int) -> tuple[torch.Tensor, int]:
        """((C,) the client's label counts as the server reads them from its latest exchange before
        ``round`` (``attacks.inversion.labels.label_inference``), zeros where there is none; the SGD
        steps it takes against the classifier, from its uploaded sample count and the federation's
        ``train`` settings (1 where either is unknown))."""
        num_classes = self.make_model().num_classes
        earlier = self._earlier.get(client)
        if earlier is None or earlier[2] is None or earlier[0] >= round:
            return torch.zeros(num_classes, dtype=torch.float64), 1
        steps = 1
        if self.train is not None and "sample_count" in earlier[2]:
            n = int(earlier[2]["sample_count"])
            steps = sum(phase_steps(e, n, self.train.batch_size) for phase, e, _ in
                        self.method.local_phases(self.train.local_epochs) if phase in ("local", "classifier")) or 1
        observation = Observation(self.method, earlier[0], client, earlier[1], earlier[2], None, self.make_model,
                                  tuple(self.public.shape[1:]), num_classes)
        try:
            result = label_inference(observation, None, 0)
        except NotApplicable:
            return torch.zeros(num_classes, dtype=torch.float64), steps
        return torch.as_tensor(result.trace["label_counts"], dtype=torch.float64), steps


def public_images(images: torch.Tensor, exclude: np.ndarray, seed: int, limit: int = PUBLIC_IMAGES) -> torch.Tensor:
    """A seeded sample of ``images`` without the rows in ``exclude`` (the attacked clients' data)."""
    return images[torch.from_numpy(public_rows(len(images), exclude, seed, limit))]


def public_rows(count: int, exclude: np.ndarray, seed: int, limit: int = PUBLIC_IMAGES) -> np.ndarray:
    """The rows ``public_images`` samples (for the labels of the same images)."""
    keep = np.setdiff1d(np.arange(count), np.asarray(exclude, dtype=np.int64))
    rng = np.random.default_rng(derive_seed(seed, 0x9B1C))
    return np.sort(rng.permutation(keep)[:limit])
