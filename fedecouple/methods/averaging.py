"""How a server combines uploads: FedAvg's sample-weighted average, in the clear or as the summands and
mean of a secure sum, and the client-id order every aggregate reads uploads in."""
from __future__ import annotations

import torch

from ..channel import Upload
from ..errors import UserError
from .base import State


def sample_weighted_average(uploads: list[Upload], names) -> State:
    """Σ_i (n_i / Σ n) · tensor_i for each name (FedAvg's rule)."""
    weights = torch.tensor([float(u.tensors["sample_count"]) for u in uploads])
    weights = weights / weights.sum()
    return {n: sum(w * u.tensors[n] for w, u in zip(weights, uploads)) for n in names}


def weighted_summands(upload: Upload, names, max_weight: float) -> dict[str, torch.Tensor]:
    """FedAvg's rule as a sum: w·tensor for each name and w itself under ``sample_count``, with
    w = n / max_weight (as Flower's SecAgg+ weights parameters by num_examples / max_weight)."""
    w = float(upload.tensors["sample_count"]) / max_weight
    return {**{n: w * upload.tensors[n].to(torch.float64) for n in names},
            "sample_count": torch.tensor(w, dtype=torch.float64)}


def weighted_mean(total: dict[str, torch.Tensor], like: State, prefix: str = "global.") -> State:
    """Σ w·tensor / Σ w for every summed name but ``sample_count``, under ``prefix``, in the dtype of
    the server's ``like`` entry of the same name (the sum is decoded in float64)."""
    weight = total["sample_count"]
    if not float(weight) > 0:
        raise UserError("the secure sum's total weight is not positive: every survivor reported 0 samples")
    return {prefix + n: (v / weight).to(like[prefix + n].dtype) for n, v in total.items() if n != "sample_count"}


def by_client(uploads: list[Upload]) -> list[Upload]:
    """Uploads in client-id order, so an aggregate never depends on the order they arrived in."""
    return sorted(uploads, key=lambda u: u.client_id)
