"""Audit your own federation: your own PyTorch model and your own image folder, end to end.

    python examples/own_federation.py my-federation

writes into the folder given

* ``own_model.py``: a model factory, ``own_model:build``, the ``--model`` contract: a function of no
  arguments returning a ``fedecouple.models.SplitModel`` (parameters ``extractor.*`` and
  ``classifier.*``, images in [0, 1]);
* ``images/{train,valid,test}/<class>/*.png``: an image folder in the layout the ``cinic10`` loader reads
  (``--dataset cinic10 --data-dir images``: 32x32 RGB PNGs, the same class folders in every split), here
  scikit-learn's 8x8 handwritten digits scaled up;

and then runs, in that folder, the audit at a tiny budget (``AUDIT`` below), which writes ``audit/audit.md``.
Replace the two files with your own and drop the budget flags for a real audit.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MODEL_MODULE = "own_model"
IMAGES = "images"
SPLITS = {"train": 20, "valid": 5, "test": 5}  # images per class and split; the loader pools the splits

# the guide's command (docs/own-federation.md), run in the folder the two files were written to; the
# budget flags (--clients, --rounds, --evidence-iterations) keep it to seconds on a laptop CPU
AUDIT = ["fedsec", "audit", "--method", "fedavg", "--model", f"{MODEL_MODULE}:build", "--dataset", "cinic10",
         "--data-dir", IMAGES, "--clients", "4", "--rounds", "2", "--evidence-iterations", "20", "--out", "audit"]

MODEL_SOURCE = '''"""A small CNN for 3x32x32 images and 10 classes, held to fedsec's SplitModel contract."""
from collections import OrderedDict

from torch import nn

from fedecouple.models import SplitModel

MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # the normalisation the model applies to images in [0, 1]


def build() -> SplitModel:
    """The model at its initial weights (fedsec seeds torch before it calls this)."""
    extractor = nn.Sequential(OrderedDict([
        ("conv", nn.Conv2d(3, 8, 5, stride=2)), ("act1", nn.LeakyReLU(0.01)), ("pool", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()), ("fc", nn.Linear(8 * 7 * 7, 32)), ("act2", nn.LeakyReLU(0.01)),
    ]))
    return SplitModel(extractor, nn.Linear(32, 10), MEAN, STD, arch="own_model")
'''


def write_model(folder: Path) -> Path:
    """``folder/own_model.py``, importable as ``own_model`` when fedsec runs in ``folder``."""
    path = folder / f"{MODEL_MODULE}.py"
    path.write_text(MODEL_SOURCE, encoding="utf-8")
    return path


def write_images(folder: Path) -> Path:
    """``folder/images/<split>/<digit>/<n>.png``: 32x32 RGB copies of scikit-learn's digits."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    root = folder / IMAGES
    taken = {label: 0 for label in range(10)}
    for image, label in zip(digits.images, digits.target):
        at = taken[int(label)]
        split = next((s for s, end in zip(SPLITS, np.cumsum(list(SPLITS.values()))) if at < end), None)
        if split is None:
            continue  # this class has all the images it needs
        taken[int(label)] += 1
        pixels = np.kron(image / 16.0 * 255.0, np.ones((4, 4))).round().astype(np.uint8)  # 8x8 → 32x32
        target = root / split / str(int(label))
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.stack([pixels] * 3, axis=-1)).save(target / f"{at:04d}.png")  # uint8 H×W×3: RGB
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the model file, the images and the audit are written")
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    write_model(args.folder)
    write_images(args.folder)
    # the command line as a user types it; the folder is the working directory so own_model imports
    command = [sys.executable, "-m", "fedsec.cli", *AUDIT[1:]]
    return subprocess.run(command, cwd=args.folder).returncode


if __name__ == "__main__":
    sys.exit(main())
