"""On-disk loaders, fed tiny files written in each data set's real on-disk format."""
from __future__ import annotations

import hashlib
import pickle
import struct
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest
import torch
from PIL import Image

torchvision = pytest.importorskip("torchvision")
from torchvision.datasets import CIFAR10, CIFAR100, EMNIST, FashionMNIST  # noqa: E402

from fedecouple.data import ondisk  # noqa: E402
from fedecouple.errors import UserError  # noqa: E402

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


# ------------------------------------------------------------------------------------------------
# writers for the real formats


class _Py2Pickler(pickle._Pickler):
    """Writes ``str`` and ``bytes`` as Python 2 byte strings, as in the original CIFAR files.

    Those were pickled by Python 2: loaded with ``encoding="bytes"`` their keys read as b"data",
    b"labels", ... (what the CIFAR web page shows); torchvision loads them with
    ``encoding="latin1"`` and sees "data", "labels", ... A Python 3 pickle with bytes keys would
    NOT load in torchvision (KeyError 'data'), so the tests write the Python 2 opcodes.
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_string(self, obj: str | bytes) -> None:
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = _save_py2_string
    dispatch[bytes] = _save_py2_string  # numpy's raw array buffer, as Python 2 wrote it


def _write_py2_pickle(path: Path, obj) -> None:
    with open(path, "wb") as f:
        _Py2Pickler(f, protocol=2).dump(obj)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _trust_files(monkeypatch, cls, folder: Path) -> None:
    """Point torchvision's MD5 table for ``cls`` at the files we wrote (class attributes only)."""
    monkeypatch.setattr(cls, "train_list", [[f, _md5(folder / f)] for f, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[f, _md5(folder / f)] for f, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": _md5(folder / cls.meta["filename"])})


def _cifar_rows(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)


def write_cifar10(root: Path, monkeypatch, sizes=(2, 2, 2, 2, 2), n_test=3):
    """Returns (images (N, 3, 32, 32) uint8, labels) in the expected pooled order (train then test)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    all_data, all_labels = [], []
    for i, n in enumerate([*sizes, n_test]):
        data = _cifar_rows(rng, n)
        labels = [int(x) for x in rng.integers(0, 10, size=n)]
        fname = f"data_batch_{i + 1}" if i < len(sizes) else "test_batch"
        batch = {"batch_label": f"batch {i + 1} of 5", "labels": labels, "data": data,
                 "filenames": [f"img_{i}_{j}.png" for j in range(n)]}
        _write_py2_pickle(folder / fname, batch)
        all_data.append(data)
        all_labels += labels
    _write_py2_pickle(folder / "batches.meta",
                      {"num_cases_per_batch": 10000, "label_names": CIFAR10_NAMES, "num_vis": 3072})
    _trust_files(monkeypatch, CIFAR10, folder)
    return np.concatenate(all_data).reshape(-1, 3, 32, 32), np.array(all_labels)


def write_cifar100(root: Path, monkeypatch, n_train=4, n_test=3):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    all_data, all_labels = [], []
    for fname, n in (("train", n_train), ("test", n_test)):
        data = _cifar_rows(rng, n)
        fine = [99, *[int(x) for x in rng.integers(0, 100, size=n - 1)]]
        _write_py2_pickle(folder / fname, {"filenames": [f"{fname}_{j}.png" for j in range(n)], "batch_label": fname,
                                           "fine_labels": fine, "coarse_labels": [f % 20 for f in fine], "data": data})
        all_data.append(data)
        all_labels += fine
    _write_py2_pickle(folder / "meta", {"fine_label_names": [f"fine{i}" for i in range(100)],
                                        "coarse_label_names": [f"coarse{i}" for i in range(20)]})
    _trust_files(monkeypatch, CIFAR100, folder)
    return np.concatenate(all_data).reshape(-1, 3, 32, 32), np.array(all_labels)


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX file as distributed (uncompressed): magic 0x08 0x0N (2051 images, 2049 labels), big-endian dims."""
    array = np.asarray(array, dtype=np.uint8)
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def write_idx_set(raw: Path, prefixes: tuple[str, str], n: tuple[int, int], num_classes: int, seed: int):
    raw.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for prefix, count in zip(prefixes, n):
        x = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        y = rng.integers(0, num_classes, size=count, dtype=np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", x)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", y)
        images.append(x)
        labels.append(y)
    return np.concatenate(images), np.concatenate(labels).astype(np.int64)


def write_cinic10(root: Path, per_class=(2, 1, 1)) -> dict[Path, tuple[int, np.ndarray]]:
    """Returns {png path: (label, HWC RGB uint8 pixels as they should load)}."""
    rng = np.random.default_rng(2)
    written = {}
    for split, count in zip(ondisk.CINIC10_SPLITS, per_class):
        for label, cls in enumerate(CIFAR10_NAMES):
            (root / split / cls).mkdir(parents=True)
            for j in range(count):
                path = root / split / cls / f"{split}_{cls}_{j}.png"
                if split == "valid" and label == 0:  # CINIC-10 has some grey PNGs; they load as RGB
                    grey = rng.integers(0, 256, size=(32, 32), dtype=np.uint8)
                    Image.fromarray(grey, mode="L").save(path)
                    written[path] = (label, np.repeat(grey[:, :, None], 3, axis=2))
                else:
                    rgb = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
                    Image.fromarray(rgb, mode="RGB").save(path)
                    written[path] = (label, rgb)
    return written


def assert_one_line_error(excinfo, *fragments) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


def assert_well_formed(ds, n, channels, size, num_classes):
    assert len(ds) == n
    assert ds.images.shape == (n, channels, size, size)
    assert ds.images.dtype == torch.float32 and ds.labels.dtype == torch.int64
    assert 0.0 <= float(ds.images.min()) and float(ds.images.max()) <= 1.0
    assert ds.num_classes == num_classes == len(ds.class_names)
    assert len(ds.mean) == len(ds.std) == channels
    expected_mean = ds.images.mean(dim=(0, 2, 3))
    assert np.allclose(ds.mean, expected_mean.numpy(), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100


def test_cifar10_pools_train_and_test(tmp_path, monkeypatch):
    images, labels = write_cifar10(tmp_path, monkeypatch)
    ds = ondisk.load_cifar10(tmp_path, False)
    assert_well_formed(ds, 10 + 3, 3, 32, 10)
    assert ds.name == "cifar10" and ds.class_names == CIFAR10_NAMES
    assert torch.equal(ds.labels, torch.from_numpy(labels))
    # every pixel round-trips, including the CHW row layout of the batches (R plane, G plane, B plane)
    assert torch.allclose(ds.images, torch.from_numpy(images).float() / 255)
    row = 11  # second image of test_batch
    assert ds.images[row, 1, 5, 7] == pytest.approx(images.reshape(-1, 3072)[row, 1024 + 5 * 32 + 7] / 255)


def test_cifar10_pickles_look_like_the_real_ones(tmp_path, monkeypatch):
    write_cifar10(tmp_path, monkeypatch)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        entry = pickle.load(f, encoding="bytes")
    assert {b"data", b"labels", b"batch_label", b"filenames"} == set(entry)
    assert entry[b"data"].dtype == np.uint8 and entry[b"data"].shape == (2, 3072)


def test_cifar100_uses_fine_labels(tmp_path, monkeypatch):
    images, labels = write_cifar100(tmp_path, monkeypatch)
    ds = ondisk.load_cifar100(tmp_path, False)
    assert_well_formed(ds, 4 + 3, 3, 32, 100)
    assert ds.class_names[99] == "fine99" and int(ds.labels[0]) == 99
    assert torch.equal(ds.labels, torch.from_numpy(labels))
    assert torch.allclose(ds.images, torch.from_numpy(images).float() / 255)


def test_cifar10_missing_folder_names_expected_path(tmp_path):
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cifar10(tmp_path, False)
    assert_one_line_error(excinfo, tmp_path / "cifar-10-batches-py", "data_batch_1..5", "test_batch", "pass download")


def test_cifar100_missing_one_file(tmp_path, monkeypatch):
    write_cifar100(tmp_path, monkeypatch)
    (tmp_path / "cifar-100-python" / "test").unlink()
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cifar100(tmp_path, False)
    assert_one_line_error(excinfo, tmp_path / "cifar-100-python", "missing test")


def test_cifar10_truncated_pickle_checksum_mismatch(tmp_path, monkeypatch):
    write_cifar10(tmp_path, monkeypatch)  # MD5 table now matches the intact files
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    bad.write_bytes(bad.read_bytes()[:500])
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cifar10(tmp_path, False)
    assert_one_line_error(excinfo, bad, "corrupt")


def test_cifar10_truncated_pickle_with_matching_checksum(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(tmp_path, monkeypatch)
    bad = folder / "test_batch"
    bad.write_bytes(bad.read_bytes()[:500])
    _trust_files(monkeypatch, CIFAR10, folder)  # so torchvision gets as far as unpickling it
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cifar10(tmp_path, False)
    assert_one_line_error(excinfo, bad, "unreadable pickle")


def test_cifar10_wrong_array_size(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(tmp_path, monkeypatch)
    _write_py2_pickle(folder / "data_batch_2", {"data": np.zeros((2, 3000), np.uint8), "labels": [0, 1]})
    _trust_files(monkeypatch, CIFAR10, folder)
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cifar10(tmp_path, False)
    assert_one_line_error(excinfo, folder / "data_batch_2", "(2, 3000)")


def test_cifar10_label_count_mismatch(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(tmp_path, monkeypatch)
    _write_py2_pickle(folder / "data_batch_4", {"data": np.zeros((2, 3072), np.uint8), "labels": [0]})
    _trust_files(monkeypatch, CIFAR10, folder)
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cifar10(tmp_path, False)
    assert_one_line_error(excinfo, folder / "data_batch_4", "1 labels for 2 images")


@pytest.mark.parametrize("loader, cls", [(ondisk.load_cifar10, CIFAR10), (ondisk.load_cifar100, CIFAR100),
                                         (ondisk.load_fmnist, FashionMNIST), (ondisk.load_emnist, EMNIST)])
def test_download_flag_is_passed_to_torchvision(tmp_path, monkeypatch, loader, cls):
    calls = []

    def fake_download(self):
        calls.append(type(self).__name__)
        raise URLError("no network in tests")

    monkeypatch.setattr(cls, "download", fake_download)
    with pytest.raises(UserError) as excinfo:
        loader(tmp_path, True)
    assert calls == [cls.__name__]
    assert_one_line_error(excinfo, "download failed", "no network in tests", tmp_path)


# ------------------------------------------------------------------------------------------------
# Fashion-MNIST / EMNIST


def test_fmnist_pools_train_and_test(tmp_path):
    images, labels = write_idx_set(tmp_path / "FashionMNIST" / "raw", ("train", "t10k"), (5, 3), 10, seed=3)
    ds = ondisk.load_fmnist(tmp_path, False)
    assert_well_formed(ds, 5 + 3, 1, 28, 10)
    assert ds.class_names[0] == "T-shirt/top"
    assert torch.equal(ds.labels, torch.from_numpy(labels))
    assert torch.allclose(ds.images[:, 0], torch.from_numpy(images).float() / 255)
    assert ds.images[6, 0, 3, 20] == pytest.approx(images[6, 3, 20] / 255)


def test_emnist_balanced_is_transposed_upright(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    images, labels = write_idx_set(raw, ("emnist-balanced-train", "emnist-balanced-test"), (4, 2), 47, seed=4)
    ds = ondisk.load_emnist(tmp_path, False)
    assert_well_formed(ds, 4 + 2, 1, 28, 47)
    assert ds.class_names[:3] == ["0", "1", "2"] and len(ds.class_names) == 47
    assert torch.equal(ds.labels, torch.from_numpy(labels))
    stored = torch.from_numpy(images).float() / 255
    assert torch.allclose(ds.images[:, 0], stored.transpose(1, 2))
    assert ds.images[5, 0, 20, 2] == pytest.approx(images[5, 2, 20] / 255)  # (row, col) swapped


def test_fmnist_missing_folder_names_expected_path(tmp_path):
    with pytest.raises(UserError) as excinfo:
        ondisk.load_fmnist(tmp_path, False)
    assert_one_line_error(excinfo, tmp_path / "FashionMNIST" / "raw", "train-images-idx3-ubyte", "pass download")


def test_fmnist_only_gz_files_says_gunzip(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (raw / f"{name}.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(UserError) as excinfo:
        ondisk.load_fmnist(tmp_path, False)
    assert_one_line_error(excinfo, raw, "gunzip")


def test_emnist_missing_folder_names_expected_path(tmp_path):
    with pytest.raises(UserError) as excinfo:
        ondisk.load_emnist(tmp_path, False)
    assert_one_line_error(excinfo, tmp_path / "EMNIST" / "raw", "emnist-balanced-train-images-idx3-ubyte")


def test_fmnist_truncated_idx_file(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    write_idx_set(raw, ("train", "t10k"), (5, 3), 10, seed=3)
    bad = raw / "t10k-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(UserError) as excinfo:
        ondisk.load_fmnist(tmp_path, False)
    assert_one_line_error(excinfo, bad, "truncated")


def test_emnist_label_count_mismatch(tmp_path):
    raw = tmp_path / "EMNIST" / "raw"
    write_idx_set(raw, ("emnist-balanced-train", "emnist-balanced-test"), (4, 2), 47, seed=4)
    write_idx(raw / "emnist-balanced-train-labels-idx1-ubyte", np.zeros(3, np.uint8))
    with pytest.raises(UserError) as excinfo:
        ondisk.load_emnist(tmp_path, False)
    assert_one_line_error(excinfo, raw / "emnist-balanced-train-images-idx3-ubyte", "4 images", "3 labels")


# ------------------------------------------------------------------------------------------------
# CINIC-10


def test_cinic10_pools_three_splits(tmp_path):
    written = write_cinic10(tmp_path)
    ds = ondisk.load_cinic10(tmp_path, False)
    assert_well_formed(ds, 10 * (2 + 1 + 1), 3, 32, 10)
    assert ds.class_names == CIFAR10_NAMES
    # ImageFolder order: train, valid, test; classes sorted; files sorted within a class
    paths = sorted(written, key=lambda p: (ondisk.CINIC10_SPLITS.index(p.parts[-3]), p.parts[-2], p.name))
    expected_labels = torch.tensor([written[p][0] for p in paths])
    expected_images = torch.from_numpy(np.stack([written[p][1] for p in paths])).permute(0, 3, 1, 2).float() / 255
    assert torch.equal(ds.labels, expected_labels)
    assert torch.allclose(ds.images, expected_images)
    assert ds.class_counts().tolist() == [4] * 10


def test_cinic10_refuses_download(tmp_path):
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cinic10(tmp_path, True)
    assert_one_line_error(excinfo, "no CINIC-10 downloader", tmp_path)


def test_cinic10_missing_split(tmp_path):
    write_cinic10(tmp_path)
    for png in (tmp_path / "valid").rglob("*.png"):
        png.unlink()
    for folder in sorted((tmp_path / "valid").iterdir()):
        folder.rmdir()
    (tmp_path / "valid").rmdir()
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cinic10(tmp_path, False)
    assert_one_line_error(excinfo, tmp_path / "valid", "train,valid,test")


def test_cinic10_missing_root(tmp_path):
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cinic10(tmp_path / "nowhere", False)
    assert_one_line_error(excinfo, tmp_path / "nowhere" / "train")


def test_cinic10_splits_need_same_classes(tmp_path):
    write_cinic10(tmp_path, per_class=(1, 1, 1))
    extra = tmp_path / "test" / "zebra"
    extra.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(extra / "z.png")
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cinic10(tmp_path, False)
    assert_one_line_error(excinfo, tmp_path / "test", "zebra", "same class folders")


def test_cinic10_empty_class_folder(tmp_path):
    write_cinic10(tmp_path, per_class=(1, 1, 1))
    (tmp_path / "train" / "frog" / "train_frog_0.png").unlink()
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cinic10(tmp_path, False)
    assert_one_line_error(excinfo, tmp_path / "train", "frog")


def test_cinic10_corrupt_png(tmp_path):
    write_cinic10(tmp_path, per_class=(1, 1, 1))
    bad = tmp_path / "valid" / "cat" / "valid_cat_0.png"
    bad.write_bytes(bad.read_bytes()[:40])
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cinic10(tmp_path, False)
    assert_one_line_error(excinfo, bad)


def test_cinic10_wrong_image_size(tmp_path):
    write_cinic10(tmp_path, per_class=(1, 1, 1))
    bad = tmp_path / "test" / "ship" / "test_ship_0.png"
    Image.fromarray(np.zeros((64, 48, 3), np.uint8)).save(bad)
    with pytest.raises(UserError) as excinfo:
        ondisk.load_cinic10(tmp_path, False)
    assert_one_line_error(excinfo, bad, "48x64", "32x32")
