"""A toy data set in one file: 8x8 grey images of 4 classes, 20 each, a bright bar per class on seeded noise.

Declared with ``fedecouple.data.DATASETS.declare("toy", "toys.toy_dataset:load_toy", embedded=True, ...)``."""
from __future__ import annotations

import torch

from fedecouple.data.dataset import ImageDataset, channel_stats

CLASSES, PER_CLASS = 4, 20


def load_toy() -> ImageDataset:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(CLASSES * PER_CLASS, 1, 8, 8, generator=generator) * 0.3
    labels = torch.arange(CLASSES).repeat_interleave(PER_CLASS)
    for k in range(CLASSES):
        images[labels == k, :, 2 * k:2 * k + 2, :] += 0.7  # class k: rows 2k and 2k+1 lit
    mean, std = channel_stats(images)
    return ImageDataset("toy", images, labels, CLASSES, mean, std, [f"bar{k}" for k in range(CLASSES)])
