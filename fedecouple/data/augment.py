"""The paper's data augmentation (Section IV-D): per image, one of crop, horizontal flip,
rotation, brightness or pixel inversion, chosen at random with a random magnitude.

Built from torchvision's v2 transforms; randomness comes from torch's global generator, which
the engine seeds per (round, client) so runs are reproducible. ``BatchAugmenter`` also returns what
it drew for each image (the operation and its parameters), without changing how it draws: the
harness keeps the draws as ground truth, and ``apply`` re-applies them to other images,
deterministically and differentiably (what an attacker who knows the draws can do).
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2

OPERATIONS = ("crop", "flip", "rotation", "brightness", "inversion")
Draw = tuple[int, dict]  # (index into OPERATIONS, the parameters the operation drew)


def paper_augmentation(image_size: int) -> v2.RandomChoice:
    """A transform on one (C, H, W) image in [0, 1] that applies one of the five operations."""
    return v2.RandomChoice([
        v2.RandomResizedCrop(image_size, scale=(0.6, 1.0), ratio=(0.85, 1.15), antialias=True),
        v2.RandomHorizontalFlip(p=1.0),
        v2.RandomRotation(degrees=30.0),
        v2.ColorJitter(brightness=(0.5, 1.5)),
        v2.RandomInvert(p=1.0),
    ])


class BatchAugmenter:
    """Applies ``paper_augmentation`` independently to each image of a batch tensor."""

    def __init__(self, image_size: int):
        self.transform = paper_augmentation(image_size)
        self._drawn: list[Draw] = []
        for i, operation in enumerate(self.transform.transforms):
            operation.make_params = self._recorder(i, operation.make_params)

    def _recorder(self, index: int, make_params):
        # every operation draws its parameters exactly once per image it applies to (flip and
        # inversion with p = 1 always apply): wrapping make_params sees each draw, consuming nothing
        def make_and_record(flat_inputs):
            params = make_params(flat_inputs)
            self._drawn.append((index, params))
            return params

        return make_and_record

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return self.augment(images)[0]

    def augment(self, images: torch.Tensor) -> tuple[torch.Tensor, list[Draw]]:
        """(augmented copies, the draw of each image)."""
        self._drawn = []
        out = torch.stack([self.transform(img) for img in images]).clamp_(0.0, 1.0)
        return out, list(self._drawn)

    def apply(self, images: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
        """The copies ``augment`` made with ``draws``, for other images (differentiable)."""
        ops = self.transform.transforms
        return torch.stack([ops[i].transform(img, params) for img, (i, params) in zip(images, draws)]).clamp(0.0, 1.0)
