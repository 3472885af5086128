"""In-memory image data sets.

Every data set is held as one tensor of images in [0, 1] (N, C, H, W, float32) and one tensor
of integer labels. Normalisation (per-channel mean/std) is *not* applied to the stored images:
the models carry a fixed ``Normalize`` layer, so attacks optimise and are scored directly in the
[0, 1] pixel space and nobody has to remember to denormalise.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ImageDataset:
    name: str
    images: torch.Tensor  # (N, C, H, W) float32 in [0, 1]
    labels: torch.Tensor  # (N,) int64
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.images.ndim != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(self.images.shape)}")
        if self.images.shape[0] != self.labels.shape[0]:
            raise ValueError("images and labels differ in length")
        self.images = self.images.to(torch.float32).contiguous()
        self.labels = self.labels.to(torch.int64).contiguous()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[2])

    def class_counts(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)


STATS_CHUNK = 4096  # images per float64 chunk (CIFAR-size sets would need GBs in one piece)


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (unbiased) std of a (N, C, H, W) tensor, for the model's Normalize layer.

    Accumulated in float64 and rounded to float32, the precision of the Normalize layer: a float32
    reduction's last bit depends on how torch splits it over threads, so the statistics, and with
    them every number of a run, changed with the machine's default thread count at load time."""
    n = images.shape[0] * images.shape[2] * images.shape[3]
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    for chunk in images.split(STATS_CHUNK):
        total += chunk.to(torch.float64).sum(dim=(0, 2, 3))
    mean = total / n
    squares = torch.zeros_like(total)
    for chunk in images.split(STATS_CHUNK):
        squares += ((chunk.to(torch.float64) - mean.view(1, -1, 1, 1)) ** 2).sum(dim=(0, 2, 3))
    std = (squares / max(n - 1, 1)).sqrt().clamp_min(1e-6)
    return (tuple(float(v) for v in mean.to(torch.float32)), tuple(float(v) for v in std.to(torch.float32)))
