"""Smoothed stand-ins for a model's kinks, for the final stage of the gradient attacks
(the inversion template's polish, ``attacks.inversion.optimise.polish``).

A replayed update is piecewise smooth in the images and jumps where an activation's slope or a
max-pool's winner changes: LeakyReLU's slope is 1 or 0.01, so the weight gradients below a unit
change by a factor of 100 when its input crosses 0. An optimiser that starts near the truth but in
another piece of that pattern cannot reach it by local steps (torch's and scipy's L-BFGS end within
a few evaluations there). ``smoothed(model, temperature)`` replaces, while it is open,

* each ``nn.LeakyReLU`` / ``nn.ReLU`` (slope s) by s·z + (1 − s)·T·softplus(z / T), whose slope
  s + (1 − s)·σ(z / T) is continuous, and
* each ``nn.MaxPool2d`` without padding or dilation and with its stride equal to its kernel by the
  softmax-weighted mean of each window, Σ softmax(v / T)·v,

both equal to the exact layer up to O(T) (T = 0 leaves the model as it is), so a continuation
(decreasing T, then the exact model) can move between pieces. Every module is restored on exit.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class SmoothLeakyReLU(nn.Module):
    """s·z + (1 − s)·T·softplus(z / T): LeakyReLU with slope s, its kink rounded over about T."""

    def __init__(self, slope: float, temperature: float):
        super().__init__()
        self.slope, self.temperature = float(slope), float(temperature)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.slope * z + (1.0 - self.slope) * self.temperature * F.softplus(z / self.temperature)


class SoftMaxPool2d(nn.Module):
    """Each window's softmax(v / T)-weighted mean (windows of ``kernel``, stride ``kernel``): the
    window's maximum as T → 0. Written with pooling so that it runs under ``torch.func.vmap``; each
    window is shifted by its (constant) maximum, so no exponential exceeds 1."""

    def __init__(self, kernel: int, ceil_mode: bool, temperature: float):
        super().__init__()
        self.kernel, self.ceil_mode, self.temperature = int(kernel), bool(ceil_mode), float(temperature)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        k = self.kernel
        top = F.max_pool2d(z, k, ceil_mode=self.ceil_mode).detach()  # cancels in the ratio: any constant works
        shift = top.repeat_interleave(k, -2).repeat_interleave(k, -1)[..., :z.shape[-2], :z.shape[-1]]
        weights = torch.exp((z - shift) / self.temperature)
        return (F.avg_pool2d(weights * z, k, ceil_mode=self.ceil_mode)
                / F.avg_pool2d(weights, k, ceil_mode=self.ceil_mode))


def _pair(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def smooth_stand_in(module: nn.Module, temperature: float) -> nn.Module | None:
    """The smoothed stand-in of ``module`` at ``temperature``, or None where there is none."""
    if isinstance(module, nn.LeakyReLU):
        return SmoothLeakyReLU(module.negative_slope, temperature)
    if isinstance(module, nn.ReLU):
        return SmoothLeakyReLU(0.0, temperature)
    if isinstance(module, nn.MaxPool2d):
        kernel, stride = _pair(module.kernel_size), _pair(module.stride or module.kernel_size)
        if (kernel[0] == kernel[1] and stride == kernel and _pair(module.padding) == (0, 0)
                and _pair(module.dilation) == (1, 1) and not module.return_indices):
            return SoftMaxPool2d(kernel[0], module.ceil_mode, temperature)
    return None


@contextlib.contextmanager
def smoothed(model: nn.Module, temperature: float):
    """``model`` with its kinks smoothed at ``temperature`` (module docstring) while the context is
    open; yields how many modules were replaced (0 for T = 0, or a model without such modules)."""
    replaced: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        if temperature > 0:
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    stand_in = smooth_stand_in(child, temperature)
                    if stand_in is not None:
                        setattr(parent, name, stand_in)
                        replaced.append((parent, name, child))
        yield len(replaced)
    finally:
        for parent, name, child in reversed(replaced):
            setattr(parent, name, child)
