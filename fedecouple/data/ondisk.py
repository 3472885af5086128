"""Data sets read from local files laid out the way torchvision expects.

Each loader returns ONE pooled :class:`ImageDataset`: the official train and test splits (and
CINIC-10's valid split) are concatenated, train first. Federated partitioning later splits this
pool into per-client train/test sets, so the official split is deliberately not kept.

Images come back as float32 in [0, 1], shape (N, C, H, W); labels as int64. The arrays are read
straight from torchvision's ``.data``/``.targets`` (no per-sample ``__getitem__``), except for
CINIC-10, whose PNG files have to be decoded one by one.

Every failure (missing folder, failed download, corrupt or truncated file, wrong array sizes)
becomes a one-line :class:`UserError` that names the data set, the file or folder and the fix.
torchvision is imported lazily, so the embedded data sets do not pay for it.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .dataset import ImageDataset, channel_stats

CINIC10_SPLITS = ("train", "valid", "test")


def load_cifar10(root: Path, download: bool) -> ImageDataset:
    """CIFAR-10 (60,000 32x32 RGB images, 10 classes) from ``root/cifar-10-batches-py``.

    Pools the 50,000 training and 10,000 test images into one data set.
    """
    return _load_cifar("cifar10", "CIFAR-10", "CIFAR10", Path(root), download, "labels", 10)


def load_cifar100(root: Path, download: bool) -> ImageDataset:
    """CIFAR-100 (60,000 32x32 RGB images, 100 fine classes) from ``root/cifar-100-python``.

    Pools the 50,000 training and 10,000 test images into one data set.
    """
    return _load_cifar("cifar100", "CIFAR-100", "CIFAR100", Path(root), download, "fine_labels", 100)


def load_fmnist(root: Path, download: bool) -> ImageDataset:
    """Fashion-MNIST (70,000 28x28 grey images, 10 classes) from ``root/FashionMNIST/raw``.

    Pools the 60,000 training and 10,000 test images into one data set.
    """
    from torchvision.datasets import FashionMNIST

    names = [f"{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")]
    return _load_idx("fmnist", "Fashion-MNIST", FashionMNIST, Path(root), download, names, {}, False)


def load_emnist(root: Path, download: bool, split: str = "balanced") -> ImageDataset:
    """EMNIST ``split`` (default "balanced": 131,600 28x28 grey images, 47 classes).

    Reads ``root/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`` and pools
    the training and test images into one data set. The NIST files store every character
    transposed (torchvision's ``.data`` shows them mirrored and rotated); they are transposed
    back here, so images are upright.
    """
    from torchvision.datasets import EMNIST

    if split not in EMNIST.splits:
        raise UserError(f"emnist: unknown split {split!r}; choose one of: {', '.join(EMNIST.splits)}")
    names = [f"emnist-{split}-{s}-{k}-ubyte" for s in ("train", "test") for k in ("images-idx3", "labels-idx1")]
    return _load_idx("emnist", f"EMNIST-{split}", EMNIST, Path(root), download, names, {"split": split}, True)


def load_cinic10(root: Path, download: bool) -> ImageDataset:
    """CINIC-10 (270,000 32x32 RGB images, 10 classes) in its standard ImageFolder layout.

    Expects ``root/{train,valid,test}/<class>/*.png`` with the same class folders in every split
    and pools all three splits into one data set. Grey images are converted to RGB. torchvision
    has no CINIC-10 downloader, so ``download=True`` is refused.
    """
    from PIL import Image
    from torchvision.datasets import ImageFolder

    root = Path(root)
    layout = f"{root}/{{{','.join(CINIC10_SPLITS)}}}/<class>/*.png (same class folders in each split, 32x32 RGB)"
    if download:
        raise UserError(f"cinic10: torchvision has no CINIC-10 downloader, so download cannot fetch it; "
                        f"put a local copy at {layout}", fields=("download",))
    missing = [str(root / s) for s in CINIC10_SPLITS if not (root / s).is_dir()]
    if missing:
        raise UserError(f"cinic10: expected CINIC-10 in ImageFolder layout at {layout}; "
                        f"missing folder(s) {', '.join(missing)}")
    folders = []
    for split in CINIC10_SPLITS:
        try:
            folders.append(ImageFolder(root / split))
        except Exception as exc:  # no class folders, or a class folder without images
            raise UserError(f"cinic10: {root / split}: {_one_line(exc)}; expected {layout}") from exc
    classes = folders[0].classes
    for split, folder in zip(CINIC10_SPLITS, folders):
        if folder.classes != classes:
            raise UserError(f"cinic10: {root / split} has class folders {folder.classes} but {root / 'train'} has "
                            f"{classes}; every split needs the same class folders")
    samples = [sample for folder in folders for sample in folder.samples]
    images = np.empty((len(samples), 32, 32, 3), dtype=np.uint8)
    for i, (path, _) in enumerate(samples):  # decoding PNGs one by one is unavoidable
        try:
            with Image.open(path) as img:
                pixels = np.asarray(img.convert("RGB"))
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ... on bad files
            raise UserError(f"cinic10: cannot read image {path}: {_one_line(exc)}") from exc
        if pixels.shape != (32, 32, 3):
            raise UserError(f"cinic10: {path} is {pixels.shape[1]}x{pixels.shape[0]} pixels, expected 32x32")
        images[i] = pixels
    labels = torch.tensor([target for _, target in samples], dtype=torch.int64)
    return _make("cinic10", torch.from_numpy(images).permute(0, 3, 1, 2), labels, list(classes))


# --------------------------------------------------------------------------------------------------
# CIFAR (pickled batches)


def _load_cifar(name: str, title: str, cls_name: str, root: Path, download: bool, label_key: str,
                num_classes: int) -> ImageDataset:
    from torchvision import datasets

    cls = getattr(datasets, cls_name)
    try:
        parts = [cls(root, train=train, download=download) for train in (True, False)]
        # torchvision keeps .data as an HWC view of the CHW batches; transposing back avoids a copy.
        images = np.concatenate([p.data.transpose(0, 3, 1, 2) for p in parts])
        labels = np.concatenate([np.asarray(p.targets, dtype=np.int64) for p in parts])
        classes = list(parts[0].classes)
        _check_labels(labels, len(images), len(classes))
    except Exception as exc:
        raise _cifar_problem(name, title, cls, root, download, label_key, num_classes, exc) from exc
    return _make(name, torch.from_numpy(images), torch.from_numpy(labels), classes)


def _cifar_problem(name: str, title: str, cls, root: Path, download: bool, label_key: str,
                   num_classes: int, exc: Exception) -> UserError:
    """The error explaining why torchvision could not load a CIFAR folder (only runs after a failure)."""
    from torchvision.datasets.utils import check_integrity

    folder = root / cls.base_folder
    batches = [(f, md5) for f, md5 in cls.train_list + cls.test_list]
    files = batches + [(cls.meta["filename"], cls.meta["md5"])]
    missing = [f for f, _ in files if not (folder / f).is_file()]
    if missing:
        fix, named = ((f"download failed ({_one_line(exc)})", ()) if download else
                      ("put a local copy there or pass download", ("download",)))
        return UserError(f"{name}: expected torchvision's {title} files at {folder} "
                         f"({_brief_list([f for f, _ in files])}); {_missing(folder, missing, len(files))}; {fix}",
                         fields=named)
    for f, md5 in files:
        if not check_integrity(folder / f, md5):
            return UserError(f"{name}: {folder / f} is corrupt (its MD5 differs from the official {title} file); "
                             f"replace it with a good copy (or delete {folder} and pass download)",
                             fields=("download",))
    for f, _ in batches:
        problem = _cifar_batch_problem(folder / f, label_key, num_classes)
        if problem:
            return UserError(f"{name}: {folder / f} is not a valid {title} batch: {problem}")
    return UserError(f"{name}: could not load {title} from {folder}: {_one_line(exc)}")


def _cifar_batch_problem(path: Path, label_key: str, num_classes: int) -> str | None:
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")  # as torchvision reads it
        data, labels = np.asarray(entry["data"]), np.asarray(entry[label_key])
    except Exception as exc:
        return f"unreadable pickle ({_one_line(exc)})"
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        return f"'data' is {data.dtype} of shape {data.shape}, expected uint8 of shape (n, 3072)"
    if labels.shape != (len(data),):
        return f"{labels.size} {label_key} for {len(data)} images"
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        return f"{label_key} outside 0..{num_classes - 1}"
    return None


# --------------------------------------------------------------------------------------------------
# MNIST-style IDX files


def _load_idx(name: str, title: str, cls, root: Path, download: bool, names: list[str], kwargs: dict,
              transpose: bool) -> ImageDataset:
    """``names`` = [train images, train labels, test images, test labels] inside ``root/<cls>/raw``."""
    try:
        parts = [cls(root, train=train, download=download, **kwargs) for train in (True, False)]
        for p in parts:
            if len(p.data) != len(p.targets):
                raise ValueError(f"{len(p.data)} images but {len(p.targets)} labels")
        images = torch.cat([p.data for p in parts])  # (N, H, W) uint8
        labels = torch.cat([p.targets for p in parts]).to(torch.int64)
        classes = list(parts[0].classes)
        _check_labels(labels.numpy(), len(images), len(classes))
    except Exception as exc:
        raise _idx_problem(name, title, cls, root, download, names, exc) from exc
    if transpose:
        images = images.transpose(1, 2)
    return _make(name, images.unsqueeze(1), labels, classes)


def _idx_problem(name: str, title: str, cls, root: Path, download: bool, names: list[str],
                 exc: Exception) -> UserError:
    """The error explaining why torchvision could not load an MNIST-style folder (only runs after a failure)."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    raw = root / cls.__name__ / "raw"
    missing = [n for n in names if not (raw / n).is_file()]
    if missing:
        named = ()
        if download:
            fix = f"download failed ({_one_line(exc)})"
        elif any((raw / f"{n}.gz").is_file() for n in missing):
            fix = "only .gz copies are there: gunzip them in place"
        else:
            fix, named = "put a local copy there or pass download", ("download",)
        return UserError(f"{name}: expected torchvision's {title} files at {raw} ({', '.join(names)}; uncompressed); "
                         f"{_missing(raw, missing, len(names))}; {fix}", fields=named)
    for image_name, label_name in (names[:2], names[2:]):
        arrays = []
        for file_name, reader in ((image_name, read_image_file), (label_name, read_label_file)):
            try:
                arrays.append(reader(str(raw / file_name)))
            except Exception as exc2:  # torchvision asserts on bad headers and sizes
                return UserError(f"{name}: {raw / file_name} is truncated or not an uncompressed IDX file "
                                 f"({_one_line(exc2)})")
        if len(arrays[0]) != len(arrays[1]):
            return UserError(f"{name}: {raw / image_name} holds {len(arrays[0])} images but {raw / label_name} "
                             f"holds {len(arrays[1])} labels")
    return UserError(f"{name}: could not load {title} from {raw}: {_one_line(exc)}")


# --------------------------------------------------------------------------------------------------
# shared helpers


def _check_labels(labels: np.ndarray, n_images: int, num_classes: int) -> None:
    if labels.shape != (n_images,):
        raise ValueError(f"{labels.size} labels for {n_images} images")
    if n_images and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels outside 0..{num_classes - 1}")


def _make(name: str, images_uint8: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> ImageDataset:
    """Build the data set from (N, C, H, W) uint8 images."""
    images = images_uint8.to(torch.float32, memory_format=torch.contiguous_format).div_(255.0)
    mean, std = channel_stats(images)
    return ImageDataset(name, images, labels, len(classes), mean, std, [str(c) for c in classes])


def _missing(folder: Path, missing: list[str], total: int) -> str:
    if not folder.is_dir():
        return "that folder does not exist"
    return "none of them is there" if len(missing) == total else f"missing {', '.join(missing)}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _brief_list(names: list[str]) -> str:
    """'data_batch_1..5, test_batch, batches.meta' rather than five data_batch names."""
    batches = [n for n in names if n.startswith("data_batch_")]
    if len(batches) < 2:
        return ", ".join(names)
    rest = [n for n in names if n not in batches]
    return ", ".join([f"data_batch_1..{len(batches)}", *rest])
