"""Data: in-memory image sets, label-skew partitions and the paper's augmentation."""
from .dataset import ImageDataset
from .registry import DATASETS, load_dataset
from .partition import SCHEMES, Partition, make_partition
from .augment import BatchAugmenter

__all__ = ["ImageDataset", "DATASETS", "load_dataset", "SCHEMES", "Partition", "make_partition", "BatchAugmenter"]
