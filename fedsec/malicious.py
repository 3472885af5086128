"""The harness side of a malicious server: the download interceptor that sends the crafted weights.

``MaliciousServer`` is a channel interceptor. For the attacked (round, client) pairs only, it
replaces the download with the one the attack crafts (``CraftingSpec.craft_download``, given a
``attacks.registry.CraftRequest``) and keeps the server's record of what it sent (``records``);
every other download passes unchanged. The channel's recorder stores each download before the
interceptors, so the recorder's view stays the honest one; the attack gets the crafted record beside
it (the server knows what it sent). The public images it crafts from are data of the same domain the
server holds: the pooled data set without the attacked clients' training images (or ``--aux-data``).

A craft may read the client's earlier exchange (classifier fishing reads its label counts there), so
the interceptor keeps each attacked client's latest download and the upload it got back. A round-level
attack's craft also gets the secure-aggregation protocol and every client attacked in the same round
(model inconsistency crafts the target apart from the others); a record that asks for its client's
upload (``keeps_upload``: a sybil, which the server runs) gets it, as that client sends it.
"""
from __future__ import annotations

import numpy as np
import torch

from attacks.registry import AttackSpec, CraftRequest
from fedecouple.channel import Download, Interceptor, Upload
from fedecouple.engine import derive_seed

# public images the server crafts from (a seeded sample of what it holds)
PUBLIC_IMAGES = 2000


class MaliciousServer(Interceptor):
    """Rewrites the download of ``targets`` ({(round, client)}) with ``spec``'s craft named ``craft``,
    built from ``public`` images (and their ``public_labels``); ``reached`` is the method's
    ``download_reaches``, ``method`` and ``train`` the federation's (what a craft may read of the
    client's local training), ``secure`` its secure-aggregation protocol (None: off or unknown)."""

    name = "malicious-server"

    def __init__(self, spec: AttackSpec, craft: str, targets: set[tuple[int, int]], make_model, public: torch.Tensor,
                 reached: tuple[str, ...], seed: int = 0, public_labels: torch.Tensor | None = None,
                 method=None, train=None, secure=None) -> None:
        self.spec, self.craft, self.targets, self.make_model = spec, craft, set(targets), make_model
        self.public, self.reached, self.seed = public, tuple(reached), int(seed)
        self.public_labels, self.method, self.train, self.secure = public_labels, method, train, secure
        self.records: dict[tuple[int, int], object] = {}
        self._clients = {c for _, c in self.targets}
        # each attacked client's latest exchange seen so far ({client: (round, download, upload)})
        self._earlier: dict[int, tuple[int, dict, dict | None]] = {}

    def on_download(self, message: Download) -> Download:
        key = (message.round, message.client_id)
        if key not in self.targets:
            if message.client_id in self._clients:
                self._earlier[message.client_id] = (message.round, dict(message.tensors), None)
            return message
        request = CraftRequest(self.craft, message.round, message.client_id, dict(message.tensors), self.make_model,
                               self.public, self.public_labels, self.reached,
                               derive_seed(self.seed, *key, 0x7A9) % 2**31, self._earlier.get(message.client_id),
                               self.method, self.train, self.secure,
                               tuple(sorted(c for r, c in self.targets if r == message.round)))
        tensors, record = self.spec.craft_download(request)
        self.records[key] = record
        # a later attacked round reads this exchange as the client's earlier one
        self._earlier[message.client_id] = (message.round, dict(tensors), None)
        return Download(message.round, message.client_id, tensors, dict(message.meta))

    def on_upload(self, message: Upload) -> Upload:
        record = self.records.get((message.round, message.client_id))
        if getattr(record, "keeps_upload", False):
            record.upload = {k: v.detach().clone() for k, v in message.tensors.items()}
        earlier = self._earlier.get(message.client_id)
        if earlier is not None and earlier[0] == message.round:
            self._earlier[message.client_id] = (earlier[0], earlier[1], dict(message.tensors))
        return message


def public_images(images: torch.Tensor, exclude: np.ndarray, seed: int, limit: int = PUBLIC_IMAGES) -> torch.Tensor:
    """A seeded sample of ``images`` without the rows in ``exclude`` (the attacked clients' data)."""
    return images[torch.from_numpy(public_rows(len(images), exclude, seed, limit))]


def public_rows(count: int, exclude: np.ndarray, seed: int, limit: int = PUBLIC_IMAGES) -> np.ndarray:
    """The rows ``public_images`` samples (for the labels of the same images)."""
    keep = np.setdiff1d(np.arange(count), np.asarray(exclude, dtype=np.int64))
    rng = np.random.default_rng(derive_seed(seed, 0x9B1C))
    return np.sort(rng.permutation(keep)[:limit])
