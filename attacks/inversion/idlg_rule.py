"""Labels read from the update before any image is optimised: iDLG's sign rule (Zhao et al., 2020) on
the classifier's weight update, and the closed form's per-class counts. DLG/iDLG
(``attacks.inversion.dlg``) and IG (``attacks.inversion.ig``) fix the labels with them.

For one image and cross-entropy, the classifier's weight gradient is ∂L/∂W_k = (p_k − 1[k = y])·h with h
the features. With non-negative features only the true class's row has a negative sum, so
y = argmin_k Σ_j ∂L/∂W_kj. Our models use LeakyReLU(0.01) before the classifier: features can be slightly
negative, but Σ_j h_j stays positive unless almost all features are negative, so the rule still holds in
practice (the bias gradient, p_k − 1[k = y], gives the same sign pattern exactly). For a batch of B > 1
images (not covered by iDLG) the classes with negative row sums are taken, B labels spread over them in
proportion to |row sum| (a heuristic, noted). The rule is read only from an update with that signature
(``idlg_applies``: the most negative row holds ≥ ``IDLG_SHARE`` of the negative row sums).
"""
from __future__ import annotations

import numpy as np
import torch

# iDLG's rule reads one image's cross-entropy gradient, whose only row with a negative sum is the true
# class's. Where the negative sums spread over several rows the update is not that gradient (a personal
# classifier distilled towards the global one in a trained round: FedeCouple's KL term outweighs a
# cross-entropy the classifier already fits) and the rule picks a wrong class; the most negative row must
# hold at least this share of the negative mass (below 1 for the float rounding of rows near zero). Seen:
# 1.000 on every one-image target of FedAvg, FedPAC and FedeCouple at round 0 and FedPAC at round 19;
# 0.15-0.46 on FedeCouple's at round 19, where the rule read 1 of 8 labels right
IDLG_SHARE = 0.9


def idlg_share(weight_gradient: torch.Tensor) -> float:
    """The most negative row sum's share of all negative row sums of a classifier weight gradient (C, D)
    (1.0: one image's cross-entropy signature, iDLG's rule applies; nan: no negative row)."""
    rows = weight_gradient.detach().to(torch.float64).sum(dim=1)
    negative = (-rows).clamp_min(0)
    return float(negative.max() / negative.sum()) if float(negative.sum()) > 0 else float("nan")


def idlg_applies(weight_gradient: torch.Tensor) -> bool:
    """Whether iDLG's rule can read one image's label from this update (``IDLG_SHARE``)."""
    return idlg_share(weight_gradient) >= IDLG_SHARE


IDLG_NOT_APPLICABLE = (f"the classifier's update is not one image's cross-entropy gradient (its negative row sums are "
                       f"spread: the most negative holds < {IDLG_SHARE:.0%} of them: the trace's idlg_share; e.g. "
                       f"a personal classifier distilled towards the global one): iDLG's rule does not apply, the "
                       f"label is optimised jointly with the image")


def idlg_labels(weight_gradient: torch.Tensor, count: int = 1) -> tuple[torch.Tensor, list[str]]:
    """Labels from the last layer's weight gradient (C, D): iDLG's sign rule (see module doc).

    Works on any positive multiple of the gradient (e.g. −Δ of an SGD step). Returns the labels
    and notes."""
    rows = weight_gradient.detach().to(torch.float64).sum(dim=1)
    if count == 1:
        return rows.argmin().reshape(1), []
    negative = torch.nonzero(rows < 0).flatten()
    notes = [f"iDLG's rule is for one image; for {count} images the labels are spread over the classes whose "
             f"classifier rows have negative gradient sums, in proportion to |sum| (heuristic)"]
    if len(negative) == 0:
        negative = rows.argsort()[:1]
    weights = (-rows[negative]).clamp_min(1e-12)
    share = (weights / weights.sum() * count).tolist()
    counts = [int(v) for v in np.floor(share)]
    if len(counts) <= count:
        counts = [max(n, 1) for n in counts]  # every class with a negative row appears at least once
    while sum(counts) > count:  # drop from the most over-represented class still holding two or more
        j = max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: counts[i] - share[i])
        counts[j] -= 1
    while sum(counts) < count:  # largest remainder
        j = max(range(len(counts)), key=lambda i: share[i] - counts[i])
        counts[j] += 1
    counts = torch.tensor(counts, dtype=torch.int64, device=negative.device)
    labels = torch.repeat_interleave(negative, counts)
    return labels, notes


def counted_labels(matcher, budget) -> torch.Tensor | None:
    """For a batch of several images, labels from the closed-form per-class counts
    (``attacks.inversion.closed_form.label_counts``) of the matcher (``GradientMatcher``), class by class;
    for one image only where the classifier-step solve confirmed its label (the features under it
    reproduce the update; else iDLG's rule applies); None without counts. ``budget``: the attack's
    ``Budget`` (its batch, where the matcher fixes none)."""
    counts = matcher.closed.label_counts
    b = matcher.originals or max(1, int(budget.batch))
    if counts is None or int(counts.sum()) != b or matcher.epoch_copies != 1:
        return None
    if b == 1 and matcher.closed.classifier_features is None:
        return None
    return torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
