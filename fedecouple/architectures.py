"""The model architectures by name (``arch``), readable without torch.

Every architecture is declared once, below: its name, the function in ``fedecouple/models.py`` (or any
module) that builds its feature extractor for C image channels (``builder(channels) -> nn.Module``, imported
when a model is first built) and its facts:

* ``image_size``: the image side it takes (``ANY_SIZE``: every side from ``MIN_SIDE`` up); the first
  architecture declared for a side is that side's default;
* ``features``: the dimension of the extractor's output, which the linear classifier takes;
* ``summary``: one line on what it is.

``fedecouple.models.build_model`` puts the extractor and a linear classifier into a ``SplitModel``.

Adding an architecture: its extractor builder (a function in ``fedecouple/models.py``, or a file of its own),
plus its line here: ``ARCHITECTURES.declare("mine", "fedecouple.models:mine_extractor", image_size=28,
features=128, summary="...")``; at run time, ``fedecouple.architectures.ARCHITECTURES.declare(...)`` the same.
"""
from __future__ import annotations

from .plugins import Plugins

ANY_SIZE = None  # an architecture that takes every image side from MIN_SIDE up (never a size's default)
MIN_SIDE = 8

ARCHITECTURES = Plugins("architecture")  # name → its extractor builder, in the command line's order
ARCHITECTURES.declare("cnn32", "fedecouple.models:cnn32_extractor", image_size=32, features=128,
                      summary="the paper's CNN for 32x32 images: three convolutions (no padding in the first two), "
                              "FC 576 → 128")
ARCHITECTURES.declare("cnn28", "fedecouple.models:cnn28_extractor", image_size=28, features=128,
                      summary="the paper's convention for 28x28 images: two 5x5 convolutions, no padding, FC 512 → 128")
ARCHITECTURES.declare("cnn28-same", "fedecouple.models:cnn28_same_extractor", image_size=28, features=128,
                      summary="cnn28 with 'same' padding: FC 1568 → 128")
ARCHITECTURES.declare("pfllib-cnn", "fedecouple.models:pfllib_cnn_extractor", image_size=28, features=512,
                      summary="PFLlib's FedAvgCNN: conv 32, conv 64, 5x5, ReLU, FC 1024 → 512")
ARCHITECTURES.declare("digits", "fedecouple.models:digits_extractor", image_size=8, features=64,
                      summary="a small CNN for 8x8 images: one 3x3 convolution, FC 256 → 64")
ARCHITECTURES.declare("mlp", "fedecouple.models:mlp_extractor", image_size=28, features=128,
                      summary="fully connected for 28x28 images: FC 784 → 256 → 128, LeakyReLU")
ARCHITECTURES.declare("mlp-relu", "fedecouple.models:mlp_relu_extractor", image_size=28, features=128,
                      summary="mlp with ReLU (the exact sparsity SPEAR needs)")
ARCHITECTURES.declare("resnet18", "fedecouple.models:resnet18_extractor", image_size=ANY_SIZE, features=512,
                      summary="torchvision's ResNet-18 with the small-image stem, GroupNorm")
ARCHITECTURES.declare("resnet18-bn", "fedecouple.models:resnet18_bn_extractor", image_size=ANY_SIZE, features=512,
                      summary="resnet18 with BatchNorm")
ARCHITECTURES.declare("resnet50", "fedecouple.models:resnet50_extractor", image_size=ANY_SIZE, features=2048,
                      summary="torchvision's ResNet-50 with the small-image stem, GroupNorm")
