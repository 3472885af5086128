"""Where tensors are computed: a ``device`` of ``auto|cpu|cuda|cuda:N``.

One validator (``resolve_device``) for every command. ``auto`` is CUDA when torch sees a GPU, else
the CPU. Training keeps the federation's bookkeeping (server state, clients' kept state, every
message through the channel) on the CPU and computes on the device: the workspace model and a
client's data move there for its local update, and what the update returns comes back to the CPU
(``to_device``), so recorders, aggregation and checkpoints are the same on every device.

Reproducibility on a GPU: ``deterministic`` switches on ``torch.use_deterministic_algorithms`` and
sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, the cuBLAS setting torch documents for it
(https://pytorch.org/docs/stable/notes/randomness.html). A seeded run then gives the same numbers
on the same GPU model, torch and CUDA version; CPU and GPU numbers differ from each other in the
last bits of every float, which chaotic optimisations (an attack's iterations) can amplify.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch

from .errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N"
CUBLAS_SETTING = ":4096:8"


def resolve_device(text: str | torch.device | None) -> str:
    """``auto|cpu|cuda|cuda:N`` → the device in force (``"cpu"``, ``"cuda"`` or ``"cuda:N"``);
    a one-line UserError for a device this machine does not have or a name that is none."""
    name = "auto" if text is None else str(text).strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        index = name[5:]
        if index and not index.isdigit():
            raise UserError(f"device {text!r}: expected {DEVICE_CHOICES}", fields=("device",))
        if not torch.cuda.is_available():
            raise UserError(f"device {text}: torch sees no CUDA GPU on this machine (torch {torch.__version__}, "
                            f"CUDA build {torch.version.cuda or 'none'}); use device cpu", fields=("device",))
        if index and int(index) >= torch.cuda.device_count():
            raise UserError(f"device {text}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                            f"numbered from 0", fields=("device",))
        return name
    raise UserError(f"unknown device {text!r}; choose one of: {DEVICE_CHOICES}")


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def device_record(device: str) -> dict:
    """What a run's config.json/summary.json say about where it ran: the device and its name."""
    record = {"device": device, "gpu": None}
    if is_cuda(device) and torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return record


def deterministic(device: str) -> None:
    """Make seeded GPU runs repeatable where torch allows it (a no-op on the CPU, which already is).

    ``warn_only``: an operation without a deterministic CUDA kernel warns instead of failing, so
    a run never stops for it (the warning names the operation)."""
    if not is_cuda(device):
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_SETTING)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def to_device(tensors: Mapping[str, torch.Tensor], device: str | torch.device) -> dict[str, torch.Tensor]:
    """The same named tensors on ``device`` (the very tensors where they are there already)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
