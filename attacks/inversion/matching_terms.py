"""How a dummy batch's counterpart is compared with the observed targets: the objectives of
``attacks.inversion.forward_model.GradientMatcher`` (DLG's squared distance, ``l2_objective``; IG's
1 − cosine, ``cosine_objective``; each plus the weighted closed-form terms after the method's own), and
the distances they are built from."""
from __future__ import annotations

import torch


class MatchingTerms:
    """``GradientMatcher``'s objectives (a part of it: they read its ``mode``, ``scale_known``, ``groups``,
    ``weight_groups``, ``extra_weights`` and ``extra_values``)."""

    def l2_objective(self, dummy: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
        """DLG's distance: Σ‖a − b‖² (with an unknown scale, min over s ≥ 0 of Σ‖a − s·b‖²); in the
        method mode the sum over groups of ‖a_g − b_g‖²/‖b_g‖² (scale-free per group, ``_relative_error``);
        plus the closed-form terms."""
        (dummy, target), extra = self._split(dummy, target)
        if self.mode != "method":
            return gradient_distance(dummy, target, self.scale_known) + extra
        total = 0.0
        for g in self.groups:
            total = total + _relative_error(flat([dummy[i] for i in g]), flat([target[i] for i in g]))
        return total + extra

    def _split(self, dummy: list[torch.Tensor], target: list[torch.Tensor]):
        """((the method's part of dummy, of target), the weighted closed-form terms: Σ w·‖a − b‖²/‖b‖²)."""
        k = len(self.extra_weights)
        n = len(dummy) - k
        extra = sum(w * (_nearest_relative_error(d, t) if j < self.extra_values else d)
                    for j, (w, d, t) in enumerate(zip(self.extra_weights, dummy[n:], target[n:])))
        return (dummy[:n], target[:n]), extra

    def cosine_objective(self, dummy: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
        """IG's data term: 1 − cos over all attacked weights at once (the paper's equal weights); in the
        method mode plus the relative squared error of each uploaded statistic. (One cosine per weight
        group instead was 1.6 dB worse on FedeCouple on the tuning federation.)"""
        (dummy, target), extra = self._split(dummy, target)
        if self.mode != "method":
            return one_minus_cosine(flat(dummy), flat(target)) + extra
        weights = [i for g in self.groups[:self.weight_groups] for i in g]
        total = one_minus_cosine(flat([dummy[i] for i in weights]), flat([target[i] for i in weights]))
        for g in self.groups[self.weight_groups:]:
            total = total + _relative_error(flat([dummy[i] for i in g]), flat([target[i] for i in g]))
        return total + extra


# per element, the squared size below which an observed value counts as zero: a statistic that is zero
# by construction (FedPAC's V of a one-image client) must not turn float rounding into a huge error
ZERO_FLOOR = 1e-8


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a − b‖² / ‖b‖², with ‖b‖² floored at ZERO_FLOOR per element."""
    return ((a - b) ** 2).sum() / ((b * b).sum() + ZERO_FLOOR * b.numel())


def _nearest_relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``_relative_error`` of ``a`` against ``b``, or, where ``b`` holds one more dimension (candidates
    for ``a``, e.g. a layer input the closed form solved up to which of two images it belongs to),
    against its nearest candidate."""
    if b.dim() == a.dim() + 1:
        return torch.stack([_relative_error(a, candidate) for candidate in b.unbind(0)]).min()
    return _relative_error(a, b)


def gradient_distance(dummy: list[torch.Tensor], target: list[torch.Tensor], scale_known: bool) -> torch.Tensor:
    """Σ_layers ‖a − b‖², or with an unknown scale min_s≥0 Σ ‖a − s·b‖² (s in closed form)."""
    if scale_known:
        return sum(((a - b) ** 2).sum() for a, b in zip(dummy, target))
    dot = sum((a * b).sum() for a, b in zip(dummy, target))
    bb = sum((b * b).sum() for b in target)
    s = dot.clamp_min(0.0) / bb.clamp_min(1e-30)
    return sum(((a - s * b) ** 2).sum() for a, b in zip(dummy, target))


def one_minus_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 − cos(a, b) as ½‖a/‖a‖ − b/‖b‖‖²: the same value and gradient, but without the cancellation of
    1 − (a float32 cosine near 1), so that a match to float rounding reads ≈ 0, not ±1e-5."""
    return 0.5 * (a / a.norm().clamp_min(1e-20) - b / b.norm().clamp_min(1e-20)).pow(2).sum()


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])
