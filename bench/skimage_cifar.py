"""CIFAR-shaped data without CIFAR: scikit-image's colour photographs cut into 32x32 RGB images,
written in CINIC-10's ImageFolder layout, so ``--dataset cinic10 --data-dir DIR`` reads them.

Each of ``CLASSES`` (one skimage photograph per class) gives ``--per-class`` seeded random square
crops (side 25-100 % of the photograph's shorter side), each resized to 32x32 with anti-aliasing;
60 % go to ``train/``, 20 % to ``valid/``, 20 % to ``test/`` (fedsec pools the splits anyway). Real
photographic texture at CIFAR's shape, for attacks on 32x32 models where no CIFAR is on disk.

    python bench/skimage_cifar.py DIR [--per-class 30] [--seed 0]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data
from skimage.transform import resize

CLASSES = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
           "colorwheel")
SPLITS = (("train", 0.6), ("valid", 0.2), ("test", 0.2))


def crops(image: np.ndarray, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` random square crops of ``image`` (H, W, 3 uint8), each resized to 32x32x3 uint8."""
    h, w = image.shape[:2]
    out = []
    for _ in range(count):
        side = int(rng.uniform(0.25, 1.0) * min(h, w))
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        patch = resize(image[top:top + side, left:left + side], (32, 32), anti_aliasing=True, preserve_range=True)
        out.append(np.clip(np.rint(patch), 0, 255).astype(np.uint8))
    return out


def write(root: Path, per_class: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for name in CLASSES:
        image = getattr(data, name)()[..., :3]
        images = crops(image, per_class, rng)
        start = 0
        for split, share in SPLITS:
            count = round(share * per_class) if split != "test" else per_class - start
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for j, patch in enumerate(images[start:start + count]):
                Image.fromarray(patch).save(folder / f"{name}_{start + j}.png")
            start += count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--per-class", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(Path(args.out), args.per_class, args.seed)
    print(f"{len(CLASSES)} classes x {args.per_class} images (32x32 RGB) → {args.out}")


if __name__ == "__main__":
    main()
