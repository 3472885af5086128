"""The paper's data augmentation (Section IV-D): per image, one of crop, horizontal flip,
rotation, brightness or pixel inversion, chosen at random with a random magnitude.

Built from torchvision's v2 transforms; randomness comes from torch's global generator, which
the engine seeds per (round, client) so runs are reproducible.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2

OPERATIONS = ("crop", "flip", "rotation", "brightness", "inversion")


def paper_augmentation(image_size: int) -> v2.Transform:
    """A transform on one (C, H, W) image in [0, 1] that applies one of the five operations."""
    return v2.RandomChoice([
        v2.RandomResizedCrop(image_size, scale=(0.6, 1.0), ratio=(0.85, 1.15), antialias=True),
        v2.RandomHorizontalFlip(p=1.0),
        v2.RandomRotation(degrees=30.0),
        v2.ColorJitter(brightness=(0.5, 1.5)),
        v2.RandomInvert(p=1.0),
    ])


class BatchAugmenter:
    """Applies ``paper_augmentation`` independently to each image of a batch tensor."""

    def __init__(self, image_size: int):
        self.transform = paper_augmentation(image_size)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.transform(img) for img in images]).clamp_(0.0, 1.0)
