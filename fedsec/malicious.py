"""The harness side of a malicious server (``attacks.malicious``): the download interceptor that
sends the crafted weights (the scoring of what the attack read back is ``attacks.malicious.scoring``).

``MaliciousServer`` is a channel interceptor. For the attacked (round, client) pairs only, it
replaces the download with the crafted one and keeps the server's record of what it sent
(``records``); every other download passes unchanged. The channel's recorder stores each download
before the interceptors, so the recorder's view stays the honest one; the attack gets the crafted
record beside it (the server knows what it sent). The public images it crafts from are data of the
same domain the server holds: the pooled data set without the attacked clients' training images
(or ``--aux-data``).
"""
from __future__ import annotations

import numpy as np
import torch

from attacks.malicious import craft
from fedecouple.channel import Download, Interceptor
from fedecouple.engine import derive_seed

# public images the server crafts from (a seeded sample of what it holds)
PUBLIC_IMAGES = 2000


class MaliciousServer(Interceptor):
    """Rewrites the download of ``targets`` ({(round, client)}) with ``craft`` (an ``attacks.malicious``
    craft name) built from ``public`` images; ``reached`` is the method's ``download_reaches``."""

    name = "malicious-server"

    def __init__(self, kind: str, targets: set[tuple[int, int]], make_model, public: torch.Tensor,
                 reached: tuple[str, ...], seed: int = 0) -> None:
        self.kind, self.targets, self.make_model = kind, set(targets), make_model
        self.public, self.reached, self.seed = public, tuple(reached), int(seed)
        self.records: dict[tuple[int, int], object] = {}

    def on_download(self, message: Download) -> Download:
        key = (message.round, message.client_id)
        if key not in self.targets:
            return message
        tensors, record = craft(self.kind, dict(message.tensors), self.make_model(), self.public, self.reached,
                                seed=derive_seed(self.seed, *key, 0x7A9) % 2**31)
        self.records[key] = record
        return Download(message.round, message.client_id, tensors, dict(message.meta))


def public_images(images: torch.Tensor, exclude: np.ndarray, seed: int, limit: int = PUBLIC_IMAGES) -> torch.Tensor:
    """A seeded sample of ``images`` without the rows in ``exclude`` (the attacked clients' data)."""
    keep = np.setdiff1d(np.arange(len(images)), np.asarray(exclude, dtype=np.int64))
    rng = np.random.default_rng(derive_seed(seed, 0x9B1C))
    chosen = np.sort(rng.permutation(keep)[:limit])
    return images[torch.from_numpy(chosen)]
