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
recovers the image (docs/attacks.md).

``resnet18``, ``resnet18-bn`` and ``resnet50`` are torchvision's ResNets with the 3x3 stem used for
small images (3x3 convolution, stride 1, no max-pool; the final ``fc`` is the classifier), so they
take any image side of at least 8 (digits, 28x28, 32x32) with 1 or 3 channels. ``resnet18`` and
``resnet50`` normalise with GroupNorm (32 groups, or fewer for narrower layers): each sample is
normalised on its own, so DP-SGD's per-sample gradients are defined and an attack's replay needs no
batch statistics. ``resnet18-bn`` keeps BatchNorm: its running statistics are buffers, not
parameters, so no upload carries them and no server averages them; every model here runs in
training mode (local training, evaluation on the client's test split, and the attacks' replay,
``use_batch_statistics``), so a BatchNorm layer always normalises by the statistics of the batch it
is given, and the running statistics take part in no result. DP-SGD refuses it (BatchNorm mixes the
samples of a batch).

The architectures are declared in ``fedecouple/architectures.py`` (``ARCHITECTURES``: name, image side,
feature dimension), each naming its extractor builder here (``cnn32_extractor``, ...). A ``model`` of
``package.module:factory`` (``load_factory``) builds the user's own ``SplitModel``.
"""
from __future__ import annotations

from collections import OrderedDict

import importlib
import sys
from pathlib import Path

import torch
from torch import nn

from .architectures import ANY_SIZE, ARCHITECTURES, MIN_SIDE
from .errors import UserError

GROUPS = ("extractor", "classifier")


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        # the working precision (float32 unless a caller set another default, as the replay tests do)
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.get_default_dtype()).view(1, -1, 1, 1))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.get_default_dtype()).view(1, -1, 1, 1))

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


def cnn32_extractor(channels: int) -> nn.Sequential:
    act = lambda: nn.LeakyReLU(0.01)  # noqa: E731
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 16, 5)), ("act1", act()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(16, 32, 5)), ("act2", act()), ("pool2", nn.MaxPool2d(2)),
        ("conv3", nn.Conv2d(32, 64, 3, padding=1)), ("act3", act()), ("pool3", nn.MaxPool2d(2, ceil_mode=True)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(64 * 3 * 3, 128)), ("act4", act()),
    ]))


def cnn28_extractor(channels: int, padding: int = 0) -> nn.Sequential:
    act = lambda: nn.LeakyReLU(0.01)  # noqa: E731
    side = ((28 + 2 * padding - 4) // 2 + 2 * padding - 4) // 2  # 4 without padding, 7 with "same" padding
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 16, 5, padding=padding)), ("act1", act()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(16, 32, 5, padding=padding)), ("act2", act()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(32 * side * side, 128)), ("act3", act()),
    ]))


def cnn28_same_extractor(channels: int) -> nn.Sequential:
    return cnn28_extractor(channels, padding=2)


def pfllib_cnn_extractor(channels: int) -> nn.Sequential:
    """PFLlib's ``FedAvgCNN`` for 28x28 images (the model its baselines run): conv 32 and conv 64, 5x5,
    no padding, each ReLU + max-pool, then FC 1024 → 512 (ReLU); the classifier is its ``fc``."""
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 32, 5)), ("act1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, 5)), ("act2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(64 * 4 * 4, 512)), ("act3", nn.ReLU()),
    ]))


def digits_extractor(channels: int) -> nn.Sequential:
    act = lambda: nn.LeakyReLU(0.01)  # noqa: E731
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(channels, 16, 3, padding=1)), ("act1", act()), ("pool1", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(16 * 4 * 4, 64)), ("act2", act()),
    ]))


def mlp_extractor(channels: int, act=lambda: nn.LeakyReLU(0.01)) -> nn.Sequential:
    """Fully connected, for 28x28 images: FC 784 → 256 → 128, each LeakyReLU (``act`` builds the
    activation). Its first layer sees the (normalised) pixels, so a malicious server that reads that
    layer's inputs has the image."""
    return nn.Sequential(OrderedDict([
        ("flatten", nn.Flatten()), ("fc", nn.Linear(channels * 28 * 28, 256)), ("act1", act()),
        ("fc2", nn.Linear(256, 128)), ("act2", act()),
    ]))


def mlp_relu_extractor(channels: int) -> nn.Sequential:
    """``mlp`` with ReLU: the loss gradient at each hidden unit is exactly zero where the unit is off,
    the sparsity exact batch recovery from a linear layer's update needs (``attacks.inversion.spear``)."""
    return mlp_extractor(channels, nn.ReLU)


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, channels), channels)


def _small_image_resnet(block: str, channels: int, norm_layer) -> nn.Module:
    """torchvision's ResNet with the small-image stem (3x3 conv, stride 1, no max-pool) and no ``fc``
    (the SplitModel's classifier takes its place): image → pooled feature vector."""
    from torchvision.models import resnet18, resnet50

    net = {"resnet18": resnet18, "resnet50": resnet50}[block](weights=None, norm_layer=norm_layer)
    net.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    net.fc = nn.Identity()
    return net


def resnet18_extractor(channels: int) -> nn.Module:
    return _small_image_resnet("resnet18", channels, _group_norm)


def resnet18_bn_extractor(channels: int) -> nn.Module:
    return _small_image_resnet("resnet18", channels, nn.BatchNorm2d)


def resnet50_extractor(channels: int) -> nn.Module:
    return _small_image_resnet("resnet50", channels, _group_norm)


def _takes(size: int | None, image_size: int) -> bool:
    return image_size >= MIN_SIDE if size is ANY_SIZE else size == image_size


def default_architecture(channels: int, image_size: int) -> str:
    """The first declared architecture made for ``image_size`` images (``fedecouple.architectures``)."""
    sizes = ARCHITECTURES.fact("image_size")
    for name, size in sizes.items():
        if size == image_size:
            return name
    supported = ", ".join(str(s) for s in dict.fromkeys(sizes.values()) if s is not ANY_SIZE)
    raise UserError(f"no model for {channels}x{image_size}x{image_size} images; supported sizes: {supported}")


def check_architecture(arch: str, image_size: int) -> None:
    """A one-line UserError unless ``arch`` exists and takes ``image_size`` images."""
    if arch not in ARCHITECTURES:
        raise UserError(f"unknown model {arch!r}; choose one of: {', '.join(ARCHITECTURES)}")
    sizes = ARCHITECTURES.fact("image_size")
    size = sizes[arch]
    if not _takes(size, image_size):
        fits = " or ".join(a for a, s in sizes.items() if _takes(s, image_size)) or "none"
        expects = f"at least {MIN_SIDE}x{MIN_SIDE}" if size is ANY_SIZE else f"{size}x{size}"
        raise UserError(f"model {arch} expects {expects} images, the data set has {image_size}x{image_size}; "
                        f"use arch {fits}, or omit arch", fields=("arch",))


def build_model(arch: str, channels: int, image_size: int, num_classes: int, mean, std) -> SplitModel:
    check_architecture(arch, image_size)
    extractor = ARCHITECTURES[arch](channels)
    return SplitModel(extractor, nn.Linear(ARCHITECTURES.facts(arch)["features"], num_classes), mean, std, arch)


MODEL_HOW = "a function of no arguments returning a fedecouple.models.SplitModel at its initial weights"


def load_factory(reference: str):
    """The function ``package.module:factory`` names (the current directory is importable, as for
    ``python -m``); a one-line UserError when it cannot be found."""
    module_name, _, attribute = str(reference).partition(":")
    if not module_name or not attribute:
        raise UserError(f"model {reference!r}: expected package.module:factory ({MODEL_HOW})", fields=("model",))
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        function = importlib.import_module(module_name)
        for part in attribute.split("."):
            function = getattr(function, part)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"model {reference!r}: cannot load it ({str(exc).splitlines()[0]})",
                        fields=("model",)) from None
    if not callable(function):
        raise UserError(f"model {reference!r} is not a function ({MODEL_HOW})", fields=("model",))
    return function


def build_custom(reference: str) -> SplitModel:
    """The user's model from ``reference`` (a ``model`` of ``package.module:factory``): called, and held
    to the SplitModel contract."""
    try:
        model = load_factory(reference)()
    except UserError:
        raise
    except Exception as exc:  # the user's code: one line naming it, not its traceback
        first = (str(exc).splitlines() or [""])[0]
        raise UserError(f"model {reference!r} raised {type(exc).__name__}: {first}", fields=("model",)) from None
    if not isinstance(model, SplitModel):
        raise UserError(f"model {reference!r} returned {type(model).__name__}, not a SplitModel ({MODEL_HOW})",
                        fields=("model",))
    groups = {group_of(n) for n, _ in model.named_parameters()}
    missing = [g for g in GROUPS if g not in groups]
    if missing or not groups <= set(GROUPS):
        other = sorted(groups - set(GROUPS))
        raise UserError(f"model {reference!r}: its parameters must all be extractor.* or classifier.*"
                        + (f"; it has none in {', '.join(missing)}" if missing else "")
                        + (f"; it has {', '.join(g + '.*' for g in other)}" if other else ""), fields=("model",))
    return model


@torch.no_grad()
def check_fits(model: SplitModel, channels: int, image_size: int, num_classes: int, what: str,
               fields: tuple[str, ...] = ()) -> None:
    """A one-line UserError unless ``model`` takes (N, channels, image_size, image_size) images in [0, 1]
    and gives ``num_classes`` logits (one forward pass on two blank images); ``what`` names the model in
    it, and ``fields`` the fields ``what`` names (``UserError.fields``)."""
    shape = f"{channels}x{image_size}x{image_size}"
    try:
        logits = model(torch.zeros(2, channels, image_size, image_size,
                                   device=next(model.parameters()).device))
    except Exception as exc:  # shapes the user's layers reject
        first = (str(exc).splitlines() or [""])[0]
        raise UserError(f"{what} does not take the data set's {shape} images ({type(exc).__name__}: {first})",
                        fields=fields) from None
    if tuple(logits.shape) != (2, num_classes):
        raise UserError(f"{what} gives logits of shape {tuple(logits.shape)[1:]} per image; the data set has "
                        f"{num_classes} classes", fields=fields)


def use_batch_statistics(model: nn.Module) -> nn.Module:
    """Every BatchNorm layer of ``model`` normalises by its batch's statistics and never updates its
    running statistics (as in the clients' training, and pure, so ``torch.func.vmap`` can batch it);
    a model without BatchNorm is left as it is."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.train()
            module.track_running_stats = False
    return model


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
