"""Statistics for attack success: ROC, AUC, advantage, TPR at a fixed FPR, and honest intervals.

Pure functions over arrays (no training, no I/O); shared by membership inference and by any other
attack whose success is a rate over records or clients.

Conventions: ``scores`` are higher-is-member, ``labels`` are 1 for members and 0 for non-members.

* ``roc``: ``sklearn.metrics.roc_curve`` (ties give one ROC point, ``drop_intermediate=False``).
* ``auc``: the Mann–Whitney form P(score_member > score_nonmember) + ½·P(tie), from average ranks
  (equals ``sklearn.metrics.roc_auc_score``, computed without building the curve so bootstraps
  are cheap).
* ``advantage``: max over thresholds of TPR − FPR (Yeom et al. 2018's membership advantage).
* ``tpr_at_fpr``: the largest TPR among ROC points whose FPR is ≤ α (the reading of LiRA's
  reference code, ``tpr[np.where(fpr < α)[0][-1]]``, with ≤).
* ``low_fpr_refusal``: TPR at FPR α is refused, with a sentence, when there are fewer than 10/α
  non-members (below that, the threshold rests on fewer than 10 false positives).
* ``cluster_bootstrap``: a percentile interval that resamples *clusters* (clients) with
  replacement, keeping every record of a drawn cluster: records of one client share a model and
  a data distribution, so they are not independent draws.
* ``bootstrap_mean``: percentile bootstrap for a mean of independent values.
* ``cluster_mean_interval``: a studentized bootstrap (bootstrap-t) for the mean of per-cluster
  means, for means over few clusters (reconstruction PSNR over a handful of attacked clients).
* ``clopper_pearson``: the exact binomial interval (``scipy.stats.binomtest(...).proportion_ci``).
* ``empirical_epsilon``: a lower bound on ε implied by an attack's (TPR, FPR) at δ, see its docstring.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
from scipy import stats
from sklearn.metrics import roc_curve

MIN_FALSE_POSITIVES = 10


def _check(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).astype(bool).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores ({s.shape}) and labels ({y.shape}) differ in length")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite")
    return s, y


def roc(scores, labels) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fpr, tpr, thresholds): "member" when score ≥ threshold."""
    s, y = _check(scores, labels)
    return roc_curve(y, s, drop_intermediate=False)


def auc(scores, labels) -> float:
    """Area under the ROC curve; NaN unless both classes are present."""
    s, y = _check(scores, labels)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = stats.rankdata(s)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def roc_rates(s: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) of ``roc`` for checked float scores ``s`` and boolean labels ``y``, both classes present,
    with the same operations as ``sklearn.metrics.roc_curve(drop_intermediate=False)`` and so the same
    floats (``tests``). The bootstraps call it a thousand times per interval, where roc_curve's input
    validation costs more than the curve."""
    order = np.argsort(s, kind="mergesort")[::-1]
    s, y = s[order], y[order].astype(np.float64)
    ends = np.r_[np.flatnonzero(np.diff(s)), y.size - 1]  # the last row of each distinct score
    tps = np.cumsum(y)[ends]
    fps = 1 + ends - tps
    tps, fps = np.r_[0, tps], np.r_[0, fps]
    return fps / fps[-1], tps / tps[-1]


def advantage(scores, labels) -> float:
    """max over thresholds of TPR − FPR (0 for a useless score)."""
    s, y = _check(scores, labels)
    if y.all() or not y.any():
        return float("nan")
    fpr, tpr = roc_rates(s, y)
    return float(np.max(tpr - fpr))


def tpr_at_fpr(scores, labels, alpha: float) -> float:
    """The largest TPR reachable with FPR ≤ ``alpha`` (NaN unless both classes are present)."""
    s, y = _check(scores, labels)
    if y.all() or not y.any():
        return float("nan")
    fpr, tpr = roc_rates(s, y)
    return float(tpr[fpr <= alpha].max())


def threshold_at_fpr(scores, labels, alpha: float) -> float:
    """The lowest threshold whose FPR is ≤ ``alpha`` ("member" when score ≥ it)."""
    s, y = _check(scores, labels)
    fpr, _, thresholds = roc_curve(y, s, drop_intermediate=False)
    return float(thresholds[fpr <= alpha][-1])


def min_nonmembers(alpha: float) -> int:
    """Non-members needed before TPR at FPR ``alpha`` is reported: 10/α (10 false positives)."""
    return int(math.ceil(MIN_FALSE_POSITIVES / alpha - 1e-9))


def low_fpr_refusal(n_nonmembers: int, alpha: float) -> str | None:
    """A sentence refusing TPR at FPR ``alpha`` when there are fewer than 10/α non-members, else None."""
    need = min_nonmembers(alpha)
    if n_nonmembers >= need:
        return None
    return (f"not reported: TPR at {100 * alpha:g}% FPR needs at least {need} non-members (10/alpha) and there are "
            f"{n_nonmembers}; its threshold would rest on fewer than {MIN_FALSE_POSITIVES} false positives")


# ---------------------------------------------------------------------------------------------
# intervals


def per_group(values_x, values_z, x_group, z_group, score: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """``score(x_values_of_group, sorted_z_values_of_group)`` for every group of the x records (all one
    group when ``x_group`` is None): the population comparisons of Attack-P and RMIA are made within
    a record's own group (its client). A record whose group has no z record gets NaN."""
    vx, vz = np.asarray(values_x, np.float64).ravel(), np.asarray(values_z, np.float64).ravel()
    gx = np.zeros(len(vx), np.int64) if x_group is None else np.asarray(x_group).ravel()
    gz = np.zeros(len(vz), np.int64) if z_group is None else np.asarray(z_group).ravel()
    out = np.full(len(vx), np.nan)
    for g in np.unique(gx):
        rows = np.flatnonzero(gx == g)
        pop = np.sort(vz[gz == g])
        if len(pop):
            out[rows] = score(vx[rows], pop)
    return out


def cluster_bootstrap(data: Sequence[np.ndarray] | np.ndarray, clusters, statistic: Callable[..., float],
                      n_boot: int = 1000, seed: int = 0, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``statistic(*data)`` from ``n_boot`` resamples of whole clusters.

    ``data`` is one array or a sequence of equally long arrays (e.g. ``(scores, labels)``) whose
    rows belong to ``clusters`` (e.g. client ids). Each resample draws as many clusters as there
    are, with replacement, and keeps all rows of every drawn cluster (a cluster drawn twice counts
    twice). Resamples where the statistic is NaN (e.g. no member drawn) are dropped; if more than
    half are, the interval is (NaN, NaN).
    """
    arrays = [np.asarray(data)] if isinstance(data, np.ndarray) else [np.asarray(a) for a in data]
    cl = np.asarray(clusters).ravel()
    if any(len(a) != len(cl) for a in arrays):
        raise ValueError("every data array needs one cluster id per row")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    ids, inverse = np.unique(cl, return_inverse=True)
    # all resamples drawn at once: the same numbers as one draw of len(ids) clusters per resample
    drawn = np.random.default_rng(seed).integers(0, len(ids), size=(n_boot, len(ids)))
    if statistic is np.mean and len(arrays) == 1 and arrays[0].ndim == 1:
        # the mean of the kept rows is the drawn clusters' sum over their size, for every resample in one
        # go (exact for 0/1 values such as success flags, to float rounding otherwise)
        sums = np.bincount(inverse, weights=arrays[0].astype(np.float64), minlength=len(ids))
        sizes = np.bincount(inverse, minlength=len(ids))
        return _percentile_interval(sums[drawn].sum(axis=1) / sizes[drawn].sum(axis=1), confidence)
    order = np.argsort(inverse, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(inverse, minlength=len(ids)))])
    members = [order[bounds[k]:bounds[k + 1]] for k in range(len(ids))]
    values = np.empty(n_boot)
    for b in range(n_boot):
        rows = np.concatenate([members[k] for k in drawn[b]])
        values[b] = statistic(*(a[rows] for a in arrays))
    return _percentile_interval(values, confidence)


MIN_BOOTSTRAP_CLUSTERS = 5  # below this the bootstrap distribution is too coarse to read tails from


def cluster_mean_interval(values, clusters, n_boot: int = 2000, seed: int = 0,
                          confidence: float = 0.95) -> tuple[float, float]:
    """Studentized (bootstrap-t) interval for the mean of per-cluster means: with few clusters (a
    handful of attacked clients) the plain percentile bootstrap covers too rarely; resampling the
    t-statistic (mean* − mean)/se* of the cluster means keeps the nominal rate (``tests``). Fewer
    than ``MIN_BOOTSTRAP_CLUSTERS`` clusters: Student's t interval on the cluster means."""
    v = np.asarray(values, dtype=np.float64).ravel()
    cl = np.asarray(clusters).ravel()
    ids, inverse = np.unique(cl, return_inverse=True)
    means = np.bincount(inverse, weights=v) / np.bincount(inverse)
    k = len(means)
    if k < 2:
        return float("nan"), float("nan")
    centre, se = float(means.mean()), float(means.std(ddof=1) / math.sqrt(k))
    rng = np.random.default_rng(seed)
    draws = means[rng.integers(0, k, size=(n_boot, k))]
    spread = draws.std(axis=1, ddof=1) / math.sqrt(k)
    ok = spread > 1e-9 * max(1.0, float(np.abs(means).max()))  # a draw of one repeated cluster has no spread
    if se == 0:
        return centre, centre
    if k < MIN_BOOTSTRAP_CLUSTERS or ok.sum() < n_boot // 2:
        # too few clusters to resample (with two, every usable draw is the pair itself: t = 0 and a
        # zero-width interval): Student's t on the cluster means instead — wide, as it should be
        from scipy.stats import t as student_t

        half = float(student_t.ppf(0.5 + confidence / 2, k - 1)) * se
        return centre - half, centre + half
    t = (draws.mean(axis=1)[ok] - centre) / spread[ok]
    tail = 100 * (1 - confidence) / 2
    t_low, t_high = np.percentile(t, [tail, 100 - tail])
    return float(centre - t_high * se), float(centre - t_low * se)


def bootstrap_mean(values, n_boot: int = 1000, seed: int = 0, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval for the mean of independent ``values``."""
    v = np.asarray(values, dtype=np.float64).ravel()
    if len(v) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(axis=1)
    return _percentile_interval(means, confidence)


def _percentile_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    ok = values[np.isfinite(values)]
    if len(ok) < max(1, len(values) // 2):
        return float("nan"), float("nan")
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(ok, [tail, 100 - tail])
    return float(low), float(high)


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper–Pearson) interval for a binomial proportion; (NaN, NaN) without trials."""
    if trials <= 0:
        return float("nan"), float("nan")
    ci = stats.binomtest(int(successes), int(trials)).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def tpr_at_fixed_threshold(scores, labels, threshold: float, confidence: float = 0.95) -> dict:
    """TPR and FPR of "member when score ≥ threshold" with Clopper–Pearson intervals (the threshold
    taken as fixed: the interval does not include the uncertainty of choosing it)."""
    s, y = _check(scores, labels)
    hit = s >= threshold
    tp, fp = int((hit & y).sum()), int((hit & ~y).sum())
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    return {"tpr": tp / n_pos if n_pos else float("nan"), "tpr_ci": clopper_pearson(tp, n_pos, confidence),
            "fpr": fp / n_neg if n_neg else float("nan"), "fpr_ci": clopper_pearson(fp, n_neg, confidence)}


# ---------------------------------------------------------------------------------------------
# differential privacy


def epsilon_from_rates(tpr: float, fpr: float, delta: float) -> float:
    """The smallest ε that (ε, δ)-DP allows for a test with this TPR and FPR:
    max(log((TPR − δ)/FPR), log((1 − δ − FPR)/(1 − TPR)), 0) (Kairouz et al. 2015, Thm 2.1)."""
    candidates = [0.0]
    if tpr - delta > 0:
        candidates.append(math.inf if fpr <= 0 else math.log((tpr - delta) / fpr))
    if 1 - delta - fpr > 0:
        candidates.append(math.inf if tpr >= 1 else math.log((1 - delta - fpr) / (1 - tpr)))
    return float(max(candidates))


def empirical_epsilon(scores, labels, delta: float, select=None, confidence: float = 0.95) -> dict:
    """A lower bound on the ε of the training procedure implied by an attack's scores.

    An (ε, δ)-DP mechanism bounds every membership test: TPR ≤ e^ε·FPR + δ and
    1 − FPR ≤ e^ε·(1 − TPR) + δ (Kairouz, Oh & Viswanath, ICML 2015, Thm 2.1), so
    ε ≥ max(log((TPR − δ)/FPR), log((1 − δ − FPR)/(1 − TPR))). As in Jagielski, Ullman & Oprea
    (NeurIPS 2020, "Auditing differentially private machine learning") and Nasr et al. (S&P 2021),
    the conservative version plugs in the Clopper–Pearson lower end of TPR and upper end of FPR
    (each two-sided ``confidence``, so both hold jointly with probability ≥ 2·confidence − 1).

    The threshold is chosen where the point estimate of the bound is largest on the rows where
    ``select`` is True (default: all rows) and the bound is evaluated on the other rows (all rows if
    ``select`` is None — then the choice overfits and the bound is optimistic). Records of one
    trained model are treated as independent trials, which they are not exactly (one training run;
    see Steinke, Nasr & Jagielski, NeurIPS 2023, for an audit that handles that).
    Returns ``epsilon_lower_bound`` (Clopper–Pearson), ``epsilon_point`` (plug-in rates), the
    threshold and the rates it gives on the evaluation rows.
    """
    s, y = _check(scores, labels)
    sel = np.ones_like(y) if select is None else np.asarray(select).astype(bool).ravel()
    evaluate = ~sel if select is not None else sel
    fpr, tpr, thresholds = roc_curve(y[sel], s[sel], drop_intermediate=False)
    points = [epsilon_from_rates(t, f, delta) for t, f in zip(tpr, fpr)]
    finite = [p if math.isfinite(p) else -1.0 for p in points]  # an untested infinite bound is not evidence
    threshold = float(thresholds[int(np.argmax(finite))])
    rates = tpr_at_fixed_threshold(s[evaluate], y[evaluate], threshold, confidence)
    lower = epsilon_from_rates(rates["tpr_ci"][0], rates["fpr_ci"][1], delta)
    return {"epsilon_lower_bound": lower, "epsilon_point": epsilon_from_rates(rates["tpr"], rates["fpr"], delta),
            "threshold": threshold, "tpr": rates["tpr"], "fpr": rates["fpr"], "delta": delta,
            "n_members": int(y[evaluate].sum()), "n_nonmembers": int((~y[evaluate]).sum())}
