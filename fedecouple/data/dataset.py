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


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of a (N, C, H, W) tensor, used for the model's Normalize layer."""
    mean = images.mean(dim=(0, 2, 3))
    std = images.std(dim=(0, 2, 3)).clamp_min(1e-6)
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)
