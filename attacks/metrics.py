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

from typing import Callable

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

PSNR_CAP_DB = 100.0  # an exact copy (infinite PSNR) counts as this much when PSNRs are averaged


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


def score_images(scoring: str, images: torch.Tensor, labels: torch.Tensor, truths: torch.Tensor,
                 truth_labels: torch.Tensor, prior: torch.Tensor,
                 class_priors: torch.Tensor | None = None) -> list[tuple[int, int, dict]]:
    """(image index, truth index, score row) for each scored reconstruction, by the attack's scoring:

    * ``images``: reconstructions matched one-to-one to the images the client trained on;
    * ``class-images``: class-typical images (one per class, labelled by class), each scored
      against its best match among the client's images of that class.

    With ``class_priors`` ((C, ...) class-mean images of data the attacker could hold) each row also
    gets ``class_prior_psnr``: the class-mean image of the matched image's class, scored the same way
    (the prior of an attacker who knows the class).
    """
    if len(truths) == 0:
        return []
    if scoring == "images":
        out = [(r["image"], r["truth_index"], r) for r in score_reconstructions(images, truths, prior)]
    elif scoring == "class-images":
        out = []
        for i in range(len(images)):
            pool = torch.nonzero(truth_labels == int(labels[i])).flatten()
            if len(pool) == 0:
                continue
            (row,) = score_reconstructions(images[i:i + 1], truths[pool], prior)
            out.append((i, int(pool[row["truth_index"]]), row))
    else:
        raise ValueError(f"no image scoring {scoring!r}")
    if class_priors is not None:
        for _, j, row in out:
            row["class_prior_psnr"] = psnr(class_priors[int(truth_labels[j])], truths[j])
    return out


def prediction_accuracy(pairs: list[tuple[int, int]]) -> float:
    """Fraction of (true label, predicted label) pairs that agree, over pairs with a prediction (≥ 0)."""
    made = [(t, p) for t, p in pairs if p >= 0]
    return float(np.mean([t == p for t, p in made])) if made else float("nan")


SUMMARY_KEYS = ("mean_psnr", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_class_prior_psnr", "mean_ssim")


def summarize_scores(rows: list[dict]) -> dict:
    """mean / median / max PSNR, mean prior and class-prior PSNR and mean SSIM over scored images."""
    if not rows:
        return {k: float("nan") for k in SUMMARY_KEYS}
    p = np.array([r["psnr"] for r in rows], dtype=float)
    p = np.where(np.isinf(p), PSNR_CAP_DB, p)
    class_prior = [r["class_prior_psnr"] for r in rows if r.get("class_prior_psnr") is not None]
    return {"mean_psnr": float(p.mean()), "median_psnr": float(np.median(p)), "max_psnr": float(p.max()),
            "mean_prior_psnr": float(np.mean([r["prior_psnr"] for r in rows])),
            "mean_class_prior_psnr": float(np.mean(class_prior)) if class_prior else float("nan"),
            "mean_ssim": float(np.mean([r["ssim"] for r in rows]))}


# ------------------------------------------------------------------------------------------------
# labels


def presence_threshold(num_classes: int) -> float:
    """A class is predicted present when its predicted proportion exceeds 1/(2C): half its share
    under a uniform distribution."""
    return 1.0 / (2.0 * num_classes)


def score_label_distribution(predicted: torch.Tensor, true_counts: torch.Tensor) -> dict:
    """Score a predicted label distribution (C,) against the client's true class counts (C,).

    * ``class_presence_accuracy``: fraction of the C classes whose presence is predicted correctly. A class
      is *present* when its proportion exceeds 1/(2C) (``presence_threshold``: half its share
      under a uniform distribution), the same rule for the prediction and for the truth, so an
      exact prediction always scores 1.0 (a class holding 2 % of a client's data, as the minor
      classes of a ``weak`` s=20 split do, counts as absent on both sides).
    * ``total_variation``: ½·Σ_k |p_k − q_k| between the predicted proportions p (renormalised to
      sum 1) and the true proportions q = counts/Σcounts; 0 is exact, 1 is disjoint.
    * ``top1_correct``: whether the predicted most frequent class is a most frequent true class.
    * also ``present_true`` / ``present_pred`` (class lists, same rule), ``precision`` and ``recall``
      of the predicted present set, and ``held_true`` (every class with a count > 0).
    """
    p = torch.as_tensor(predicted, dtype=torch.float64).flatten().clamp_min(0.0)
    counts = torch.as_tensor(true_counts, dtype=torch.float64).flatten()
    if p.numel() != counts.numel():
        raise ValueError(f"predicted has {p.numel()} classes, true_counts {counts.numel()}")
    c = p.numel()
    p = p / p.sum() if float(p.sum()) > 0 else torch.full_like(p, 1.0 / c)
    total = float(counts.sum())
    q = counts / total if total > 0 else torch.zeros_like(counts)
    pred_present = p > presence_threshold(c)
    true_present = q > presence_threshold(c)
    hits = int((pred_present & true_present).sum())
    return {
        "class_presence_accuracy": float((pred_present == true_present).to(torch.float64).mean()),
        "total_variation": float(0.5 * (p - q).abs().sum()) if total > 0 else float("nan"),
        "top1_correct": bool(total > 0 and float(counts[int(p.argmax())]) == float(counts.max())),
        "present_true": torch.nonzero(true_present).flatten().tolist(),
        "present_pred": torch.nonzero(pred_present).flatten().tolist(),
        "held_true": torch.nonzero(counts > 0).flatten().tolist(),
        "precision": hits / int(pred_present.sum()) if int(pred_present.sum()) else float("nan"),
        "recall": hits / int(true_present.sum()) if int(true_present.sum()) else float("nan"),
    }


# ------------------------------------------------------------------------------------------------
# how sure: intervals and success rates over the scored images


from .verdicts import SUCCESS_MARGIN_DB, SUCCESS_RULE, SUCCESS_RULE_SSIM, SUCCESS_SSIM  # noqa: E402


def rate_interval(hits: np.ndarray, clusters: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95 % interval of a success rate: the hull of Clopper–Pearson over the images and, with several
    targets, a bootstrap that resamples targets (images of one client are not independent; and a
    bootstrap alone collapses to a point when every image, or none, succeeded)."""
    from .statistics import clopper_pearson, cluster_bootstrap

    low, high = clopper_pearson(int(hits.sum()), len(hits))
    if len(np.unique(clusters)) >= 2:
        b_low, b_high = cluster_bootstrap(hits.astype(float), clusters, np.mean, seed=seed)
        low, high = min(low, b_low), max(high, b_high)
    return low, high


def input_shares(rows: list[dict], seed: int, flags: dict[str, Callable[[np.ndarray, list[dict]], np.ndarray]]) -> dict:
    """For rows of recovered layer inputs (``input_error``, ``round``, ``client``): per name in ``flags`` the
    share of rows it marks (``flag(errors, rows)``, a boolean array) as ``NAME_share`` with its 95 % interval
    resampling attacked clients (``rate_interval``) as ``NAME_share_ci``, and the median error."""
    errors = np.array([float(r["input_error"]) for r in rows])
    clusters = np.array([f"{r['round']}/{r['client']}" for r in rows])
    out = {}
    for name, flag in flags.items():
        hits = np.asarray(flag(errors, rows), dtype=bool)
        out[f"{name}_share"] = float(hits.mean())
        out[f"{name}_share_ci"] = [float(v) for v in rate_interval(hits, clusters, seed)]
    out["inputs_median_error"] = float(np.median(errors))
    return out


MIN_INTERVAL_TARGETS = 3  # fewer attacked clients: Student's t on 2 client means spans ±12.7 standard errors
MIN_INTERVAL_IMAGES = 8  # with 1-2 targets, an interval over their images (conditional on those clients) needs this many
TOO_FEW_FOR_INTERVAL = "too few targets for an interval"


def mean_interval(values: np.ndarray, clusters: np.ndarray, seed: int = 0,
                  bounds: tuple[float, float] = (0.0, PSNR_CAP_DB)) -> tuple[list[float] | None, str]:
    """95 % interval for a mean of per-image values grouped by target, and what it resamples.

    At least ``MIN_INTERVAL_TARGETS`` targets: a studentized bootstrap over targets (images of one
    client are not independent). One or two targets with at least ``MIN_INTERVAL_IMAGES`` images: a
    percentile bootstrap over the images, an interval conditional on those clients. Fewer: no interval
    (None, ``TOO_FEW_FOR_INTERVAL``). The interval is intersected with ``bounds``, the metric's range
    (PSNR in [0, cap] for images in [0, 1]): the mean lies there, so coverage is kept."""
    from .statistics import bootstrap_mean, cluster_mean_interval

    k = len(np.unique(clusters))
    if k >= MIN_INTERVAL_TARGETS:
        (low, high), resamples = cluster_mean_interval(values, clusters, seed=seed), "targets"
    elif len(values) >= MIN_INTERVAL_IMAGES:
        (low, high), resamples = bootstrap_mean(values, seed=seed), f"images (conditional on the {k} attacked targets)"
    else:
        return None, TOO_FEW_FOR_INTERVAL
    if not (np.isfinite(low) and np.isfinite(high)):
        return None, TOO_FEW_FOR_INTERVAL
    return [float(np.clip(low, *bounds)), float(np.clip(high, *bounds))], resamples


def leakage_statistics(rows: list[dict], seed: int = 0) -> dict:
    """For the scored images of one attack: how many, the mean PSNR with a 95 % interval inside
    [0, ``PSNR_CAP_DB``] (``mean_interval``: over targets when there are enough, else none, saying
    so in ``interval_resamples``), and the success rates under two stated rules with their intervals."""
    if not rows:
        return {"n_images": 0, "n_targets": 0, "mean_psnr_ci": None, "interval_resamples": TOO_FEW_FOR_INTERVAL,
                "success_rate": None, "success_rate_ci": None, "success_rule": SUCCESS_RULE,
                "success_rate_ssim": None, "success_rate_ssim_ci": None, "success_rule_ssim": SUCCESS_RULE_SSIM}
    psnr = np.array([min(float(r["psnr"]), PSNR_CAP_DB) for r in rows])
    gain = psnr - np.array([float(r["prior_psnr"]) for r in rows])
    ssim_ = np.array([float(r["ssim"]) for r in rows])
    clusters = np.array([f"{r['round']}/{r['client']}" for r in rows])
    interval, resamples = mean_interval(psnr, clusters, seed=seed)
    hits, hits_ssim = gain >= SUCCESS_MARGIN_DB, ssim_ >= SUCCESS_SSIM
    return {"n_images": len(rows), "n_targets": int(len(np.unique(clusters))),
            "interval_resamples": resamples,
            "mean_psnr_ci": interval, "success_rate": float(hits.mean()),
            "success_rate_ci": list(rate_interval(hits, clusters, seed)), "success_rule": SUCCESS_RULE,
            "success_rate_ssim": float(hits_ssim.mean()),
            "success_rate_ssim_ci": list(rate_interval(hits_ssim, clusters, seed)),
            "success_rule_ssim": SUCCESS_RULE_SSIM}


def paired_difference(rows_a: list[dict], rows_b: list[dict], seed: int = 0) -> dict:
    """Leakage of A minus leakage of B, paired over the images both scored (same round, client and
    image: methods compared on the same partition, seed and targets): the mean difference of PSNR
    above the prior with a 95 % interval that resamples targets, and a verdict that calls a
    difference only when the interval excludes zero."""
    key = lambda r: (int(r["round"]), int(r["client"]), int(r["image"]))  # noqa: E731
    gain = lambda r: min(float(r["psnr"]), PSNR_CAP_DB) - float(r["prior_psnr"])  # noqa: E731
    b = {key(r): gain(r) for r in rows_b}
    pairs = [(key(r), gain(r) - b[key(r)]) for r in rows_a if key(r) in b]
    if not pairs:
        return {"n_pairs": 0, "mean_difference": None, "ci": None, "verdict": "no image scored by both"}
    diff = np.array([d for _, d in pairs])
    clusters = np.array([f"{k[0]}/{k[1]}" for k, _ in pairs])
    ci, _ = mean_interval(diff, clusters, seed=seed, bounds=(-PSNR_CAP_DB, PSNR_CAP_DB))
    verdict = (f"not distinguishable: {TOO_FEW_FOR_INTERVAL}" if ci is None else "A leaks more" if ci[0] > 0 else
               "B leaks more" if ci[1] < 0 else "not distinguishable at this sample size")
    return {"n_pairs": len(pairs), "n_targets": int(len(np.unique(clusters))), "mean_difference": float(diff.mean()),
            "ci": ci, "verdict": verdict}
