"""Data: in-memory image sets, label-skew partitions and the paper's augmentation.

The data sets and partition schemes are declared in ``registry.py`` (``DATASETS``, ``SCHEMES``), which
imports no torch; ``ImageDataset``, ``Partition``, ``make_partition`` and ``BatchAugmenter`` are read
from their modules on first access, so importing this package stays light.
"""
from __future__ import annotations

from .registry import DATASETS, SCHEMES, load_dataset


def __getattr__(name: str):
    """``ImageDataset``, ``Partition``, ``make_partition``, ``BatchAugmenter``: imported on first access."""
    if name == "ImageDataset":
        from .dataset import ImageDataset

        return ImageDataset
    if name in ("Partition", "make_partition"):
        from . import partition

        return getattr(partition, name)
    if name == "BatchAugmenter":
        from .augment import BatchAugmenter

        return BatchAugmenter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ImageDataset", "DATASETS", "load_dataset", "SCHEMES", "Partition", "make_partition", "BatchAugmenter"]
