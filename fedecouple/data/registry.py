"""Data sets by name."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .dataset import ImageDataset
from . import embedded

EMBEDDED = {"mnist5k": embedded.load_mnist5k, "digits": embedded.load_digits}
# read from a user's directory by fedecouple.data.ondisk (imported on use: torchvision is slow to load)
ON_DISK = ("cifar10", "cifar100", "fmnist", "emnist", "cinic10")
DATASETS = tuple(EMBEDDED) + ON_DISK


def load_dataset(name: str, data_dir: str | Path | None = None, download: bool = False) -> ImageDataset:
    """Load a data set by name. Embedded sets need nothing; the others read ``data_dir``."""
    if name in EMBEDDED:
        return EMBEDDED[name]()
    if name in ON_DISK:
        if data_dir is None:
            raise UserError(
                f"data set {name!r} is read from disk: pass data_dir DIR pointing at a local copy "
                f"(or use an embedded set: {', '.join(EMBEDDED)})", fields=("data_dir",))
        from . import ondisk

        return getattr(ondisk, f"load_{name}")(Path(data_dir), download)
    raise UserError(f"unknown data set {name!r}; choose one of: {', '.join(DATASETS)}")
