"""Models: always a feature extractor f(θ) followed by a linear classifier g(φ).

Parameters are addressed by their ``state_dict`` names; names starting with ``extractor.`` form
the extractor group and ``classifier.`` the classifier group. A fixed (parameter-free)
``Normalize`` layer comes first so models take images in [0, 1].

Padding is not stated in the paper. We use no padding in the first two convolutions and padding 1
(with a ceil-mode max-pool) in the third of the 32x32 model: that gives a 64x3x3 map, an extractor
of 106,400 parameters = 415.6 KiB, exactly the extractor size in the paper's communication formula.
The 28x28 model ``cnn28`` follows the same convention (no padding: 28→24→12→8→4, FC 512→128).
``cnn28-same`` is the other reading, "same" padding 2 in both convolutions (28→28→14→14→7, FC 1568→128).
``pfllib-cnn`` is PFLlib's ``FedAvgCNN`` (conv 32, conv 64, 5x5, no padding, ReLU, FC 1024→512), the
model the paper's baselines likely ran, so tables can be checked on it.
The choice matters for gradient inversion far more than for accuracy: on cnn28 the FC layer sees 512
pooled features of a 784-pixel image and DLG stalls (≈15-20 dB); on cnn28-same it sees 1568 and DLG
recovers the image (BENCHMARKS.md, "Attacks").
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .errors import UserError

GROUPS = ("extractor", "classifier")
ARCHITECTURES = ("cnn32", "cnn28", "cnn28-same", "pfllib-cnn", "digits", "mlp")


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class SplitModel(nn.Module):
    """normalize → extractor (→ feature vector) → classifier (→ logits)."""

    def __init__(self, extractor: nn.Module, classifier: nn.Linear, mean, std, arch: str):
        super().__init__()
        self.normalize = Normalize(mean, std)
        self.extractor = extractor
        self.classifier = classifier
        self.arch = arch

    @property
    def feature_dim(self) -> int:
        return self.classifier.in_features

    @property
    def num_classes(self) -> int:
        return self.classifier.out_features

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.extractor(self.normalize(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _cnn32(channels: int) -> nn.Sequential:
    act = lambda: nn.LeakyReLU(0.01)  # noqa: E731
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 16, 5)), ("act1", act()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(16, 32, 5)), ("act2", act()), ("pool2", nn.MaxPool2d(2)),
        ("conv3", nn.Conv2d(32, 64, 3, padding=1)), ("act3", act()), ("pool3", nn.MaxPool2d(2, ceil_mode=True)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(64 * 3 * 3, 128)), ("act4", act()),
    ]))


def _cnn28(channels: int, padding: int = 0) -> nn.Sequential:
    act = lambda: nn.LeakyReLU(0.01)  # noqa: E731
    side = ((28 + 2 * padding - 4) // 2 + 2 * padding - 4) // 2  # 4 without padding, 7 with "same" padding
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 16, 5, padding=padding)), ("act1", act()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(16, 32, 5, padding=padding)), ("act2", act()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(32 * side * side, 128)), ("act3", act()),
    ]))


def _cnn28_same(channels: int) -> nn.Sequential:
    return _cnn28(channels, padding=2)


def _pfllib_cnn(channels: int) -> nn.Sequential:
    """PFLlib's ``FedAvgCNN`` for 28x28 images (the model its baselines run): conv 32 and conv 64, 5x5,
    no padding, each ReLU + max-pool, then FC 1024 → 512 (ReLU); the classifier is its ``fc``."""
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 32, 5)), ("act1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, 5)), ("act2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(64 * 4 * 4, 512)), ("act3", nn.ReLU()),
    ]))


def _digits(channels: int) -> nn.Sequential:
    act = lambda: nn.LeakyReLU(0.01)  # noqa: E731
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 16, 3, padding=1)), ("act1", act()), ("pool1", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(16 * 4 * 4, 64)), ("act2", act()),
    ]))


def _mlp(channels: int) -> nn.Sequential:
    """Fully connected, for 28x28 images: FC 784 → 256 → 128, each LeakyReLU. Its first layer sees
    the (normalised) pixels, so a malicious server that reads that layer's inputs has the image."""
    act = lambda: nn.LeakyReLU(0.01)  # noqa: E731
    return nn.Sequential(OrderedDict([
        ("flatten", nn.Flatten()), ("fc", nn.Linear(channels * 28 * 28, 256)), ("act1", act()),
        ("fc2", nn.Linear(256, 128)), ("act2", act()),
    ]))


# the first entry of each image size is that size's default
_BUILDERS = {"cnn32": (_cnn32, 32, 128), "cnn28": (_cnn28, 28, 128), "cnn28-same": (_cnn28_same, 28, 128),
             "pfllib-cnn": (_pfllib_cnn, 28, 512), "digits": (_digits, 8, 64), "mlp": (_mlp, 28, 128)}


def default_architecture(channels: int, image_size: int) -> str:
    for name, (_, size, _) in _BUILDERS.items():
        if size == image_size:
            return name
    raise UserError(f"no model for {channels}x{image_size}x{image_size} images; supported sizes: 32, 28, 8")


def check_architecture(arch: str, image_size: int) -> None:
    """A one-line UserError unless ``arch`` exists and takes ``image_size`` images."""
    if arch not in _BUILDERS:
        raise UserError(f"unknown model {arch!r}; choose one of: {', '.join(ARCHITECTURES)}")
    size = _BUILDERS[arch][1]
    if size != image_size:
        fits = " or ".join(a for a, (_, s, _) in _BUILDERS.items() if s == image_size) or "none"
        raise UserError(f"model {arch} expects {size}x{size} images, the data set has {image_size}x{image_size}; "
                        f"use --arch {fits}, or omit --arch")


def build_model(arch: str, channels: int, image_size: int, num_classes: int, mean, std) -> SplitModel:
    check_architecture(arch, image_size)
    builder, _, feat = _BUILDERS[arch]
    return SplitModel(builder(channels), nn.Linear(feat, num_classes), mean, std, arch)


def group_of(name: str) -> str:
    return name.split(".", 1)[0]


def get_params(model: nn.Module, group: str | None = None) -> dict[str, torch.Tensor]:
    """Detached copies of the model's parameters (optionally one group), keyed by state-dict name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if group is None or group_of(n) == group}


@torch.no_grad()
def set_params(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy ``params`` (any subset of the model's parameters) into the model in place."""
    own = dict(model.named_parameters())
    for name, value in params.items():
        own[name].copy_(value)
