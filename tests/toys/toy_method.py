"""A toy method in one file: FedAvg whose server takes the plain mean of the uploads (every client weighs
the same, whatever its sample count; not meant for secure aggregation).

Declared with ``fedecouple.methods.METHODS.declare("toy", "toys.toy_method:ToyAvg", summary=...)``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedecouple.methods.fedavg import FedAvg


@dataclass
class ToyAvg(FedAvg):
    name = "toy"

    def aggregate(self, server, uploads, round):
        uploads = sorted(uploads, key=lambda u: u.client_id)  # the same sum whatever the arrival order
        names = [k for k in uploads[0].tensors if k != "sample_count"]
        mean = {f"global.{k}": torch.stack([u.tensors[k] for u in uploads]).mean(0) for k in names}
        return {**server, **mean}
