"""LiRA with a global (fixed) variance (Carlini et al., "Membership inference attacks from first
principles", S&P 2022).

Registry entry ``lira``: inputs → one score per record, higher = more likely a member.

* Signal: the scaled logit φ = log p_y − log Σ_{y'≠y} p_{y'} = z_y − logsumexp_{y'≠y} z_{y'}
  (computed from logits, numerically stable; ``scaled_logit``).
* Inputs: φ of every record under the target model, under reference models that trained on the
  record ("IN", ``(n, k_in)``) and under reference models that did not ("OUT", ``(n, k_out)``);
  NaN marks a missing reference.
* Online score: log N(φ; μ_in(x), σ_in²) − log N(φ; μ_out(x), σ_out²), with per-record means and a
  *global* standard deviation per side (with few reference models, per-record variances are too
  noisy: the paper's Fig. 9 and the ``fix_variance`` option of its code).
* Global σ: the pooled within-record standard deviation of the references (Bessel-corrected,
  over records with ≥ 2 references on that side). With one reference per side it cannot be
  computed; then σ is the standard deviation of all reference values on that side, which is what
  the paper's code computes with ``fix_variance=True`` (it includes the spread between records).
* Offline (one-sided) score, when no IN references exist: (φ − μ_out(x)) / σ_out.

Pure functions over numpy arrays; no training.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from ..registry import MembershipSpec

STD_FLOOR = 1e-6


def scaled_logit(logits, labels) -> np.ndarray:
    """φ = z_y − logsumexp_{y'≠y} z_{y'} per record; ``logits`` may carry leading model axes
    ((..., n, C) with labels (n,) gives (..., n))."""
    z = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    index = y.expand(z.shape[:-1]).unsqueeze(-1)
    true = z.gather(-1, index).squeeze(-1)
    others = z.scatter(-1, index, float("-inf"))
    return (true - torch.logsumexp(others, dim=-1)).numpy()


def global_std(values) -> float:
    """Pooled within-record standard deviation of ``values`` (n, k) (NaN = missing); the plain
    standard deviation of all values when no record has two."""
    v = np.asarray(values, np.float64).reshape(len(values), -1)
    counts = np.sum(np.isfinite(v), axis=1)
    usable = counts >= 2
    if usable.any():
        means = np.nanmean(v[usable], axis=1, keepdims=True)
        squares = np.nansum((v[usable] - means) ** 2)
        return float(max(np.sqrt(squares / np.sum(counts[usable] - 1)), STD_FLOOR))
    finite = v[np.isfinite(v)]
    return float(max(np.std(finite), STD_FLOOR)) if len(finite) > 1 else 1.0


def _log_normal(x: np.ndarray, mean: np.ndarray, std: float) -> np.ndarray:
    return -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)


def lira_online(phi_target, phi_in, phi_out) -> np.ndarray:
    """Online LiRA with global variances; NaN for a record without an IN or an OUT reference."""
    t = np.asarray(phi_target, np.float64).ravel()
    pin = np.asarray(phi_in, np.float64).reshape(len(t), -1)
    pout = np.asarray(phi_out, np.float64).reshape(len(t), -1)
    mu_in, mu_out = _nanmean(pin), _nanmean(pout)
    return _log_normal(t, mu_in, global_std(pin)) - _log_normal(t, mu_out, global_std(pout))


def _nanmean(values: np.ndarray) -> np.ndarray:
    """Row means ignoring NaN; NaN (silently) for a row without any value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=1)


def _score(inputs) -> np.ndarray:
    """Online LiRA with a global variance on ``MembershipInputs``."""
    phi_t = scaled_logit(inputs.logits, inputs.labels)
    phi_refs = scaled_logit(inputs.reference_logits, inputs.labels).T  # (n, R)
    return lira_online(phi_t, inputs.per_record(phi_refs, trained=True), inputs.per_record(phi_refs, trained=False))


SPEC = MembershipSpec("lira", _score, references=True)
