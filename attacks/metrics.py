"""Scoring reconstructions so that results are comparable across methods and attacks.

* PSNR per image: 10·log10(1 / MSE) on images in [0, 1] (clamped), MSE averaged over all pixels
  and channels of that one image (never divided by the number of channels), ``data_range=1``
  passed explicitly to skimage.
* SSIM per image: ``skimage.metrics.structural_similarity(data_range=1, channel_axis=0)`` for
  multi-channel images; images smaller than 7 px use the largest odd window that fits.
* Reconstructions are matched one-to-one to the client's ground-truth images by
  ``scipy.optimize.linear_sum_assignment`` on pairwise MSE before scoring.
* A prior baseline: the data set's mean image, scored against the same matched truth, so that
  "leakage" means "above chance".
"""
from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from skimage.metrics import peak_signal_noise_ratio, structural_similarity


def _np(img: torch.Tensor) -> np.ndarray:
    return img.detach().to(torch.float64).clamp(0.0, 1.0).cpu().numpy()


def psnr(reconstruction: torch.Tensor, truth: torch.Tensor) -> float:
    """PSNR in dB of one (C, H, W) image against another, both in [0, 1]."""
    a, b = _np(reconstruction), _np(truth)
    if np.array_equal(a, b):
        return float("inf")
    return float(peak_signal_noise_ratio(b, a, data_range=1.0))


def ssim(reconstruction: torch.Tensor, truth: torch.Tensor) -> float:
    a, b = _np(reconstruction), _np(truth)
    side = min(a.shape[-2:])
    win = min(7, side if side % 2 else side - 1)
    if a.shape[0] == 1:
        return float(structural_similarity(b[0], a[0], data_range=1.0, win_size=win))
    return float(structural_similarity(b, a, data_range=1.0, channel_axis=0, win_size=win))


def match(reconstructions: torch.Tensor, truths: torch.Tensor) -> np.ndarray:
    """For each reconstruction, the index of the ground-truth image it is scored against
    (minimum total MSE, one-to-one; with more reconstructions than truths the extras get -1)."""
    r = reconstructions.detach().clamp(0, 1).flatten(1).to(torch.float64)
    t = truths.detach().clamp(0, 1).flatten(1).to(torch.float64)
    cost = torch.cdist(r, t).pow(2).numpy() / r.shape[1]
    rows, cols = linear_sum_assignment(cost)
    assignment = np.full(len(r), -1, dtype=np.int64)
    assignment[rows] = cols
    return assignment


def score_reconstructions(reconstructions: torch.Tensor, truths: torch.Tensor, prior: torch.Tensor) -> list[dict]:
    """One row per matched reconstruction: image, truth_index, psnr, ssim, prior_psnr, prior_ssim."""
    assignment = match(reconstructions, truths)
    rows = []
    for i, j in enumerate(assignment):
        if j < 0:
            continue
        rows.append({"image": i, "truth_index": int(j),
                     "psnr": psnr(reconstructions[i], truths[j]), "ssim": ssim(reconstructions[i], truths[j]),
                     "prior_psnr": psnr(prior, truths[j]), "prior_ssim": ssim(prior, truths[j])})
    return rows


def summarize_scores(rows: list[dict]) -> dict:
    """mean / median / max PSNR, mean prior PSNR and mean SSIM over scored images (finite values)."""
    if not rows:
        return {k: float("nan") for k in ("mean_psnr", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_ssim")}
    p = np.array([r["psnr"] for r in rows], dtype=float)
    p = np.where(np.isinf(p), 100.0, p)  # an exact copy is capped at 100 dB for averaging
    return {"mean_psnr": float(p.mean()), "median_psnr": float(np.median(p)), "max_psnr": float(p.max()),
            "mean_prior_psnr": float(np.mean([r["prior_psnr"] for r in rows])),
            "mean_ssim": float(np.mean([r["ssim"] for r in rows]))}
