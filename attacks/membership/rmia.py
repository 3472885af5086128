"""Offline RMIA (Zarifzadeh, Liu & Shokri, "Low-cost high-power membership inference attacks",
ICML 2024).

Registry entry ``rmia``: inputs → one score per record, higher = more likely a member.

* Inputs: the target model's probability of the true label p(x|θ) for every record x and for
  population records z (known non-members); the same probabilities under reference models that
  did *not* train on the record ("OUT" references, ``(n, k)``); optional groups (e.g. client ids,
  so that x is compared only with z of its own client's label mix). A record that is also a
  population record is compared with itself like any z (LR = 1, counted only when γ < 1), as the
  reference code does: every score of a group then has the same denominator. Leaving x out gives
  non-members a denominator one smaller, and since the counts are small integers shared by many
  records (the few z a typical record beats), members and non-members with the same count then get
  systematically different scores (per-client AUC 0.29 on a model with no membership signal).
* Probabilities: softmax of logits / ``temperature`` at the true label (``probability``).
* Offline p(x): with only OUT references, p(x) ≈ ½((1 + a)·mean_OUT p(x|θ') + (1 − a)) — the
  paper's linear approximation of the IN mean from the OUT mean (p_IN ≈ a·p_OUT + 1 − a).
* Score(x) = fraction of population z with [p(x|θ)/p(x)] / [p(z|θ)/p(z)] > γ.
* Defaults: γ = 2 and temperature 2 (the paper's attack configs,
  privacytrustlab/ml_privacy_meter ``research/2023_rmia/attack_configs``); a = 0.3 when not
  tuned. ``tune_offline_a`` picks a from {0, 0.1, …, 1} by the AUC of attacking one model of a
  reference pair with the other reference models, as the reference code's ``tune_offline_a``
  (``modules/mia/attacks/rmia.py``) does. (The current ML Privacy Meter compares the ratio with
  γ = 1; ``gamma`` is a parameter.)

Pure functions over numpy arrays; no training.
"""
from __future__ import annotations

import numpy as np
import torch

from ..registry import MembershipSpec
from ..statistics import auc, per_group

DEFAULT_GAMMA = 2.0
DEFAULT_TEMPERATURE = 2.0
DEFAULT_OFFLINE_A = 0.3
A_GRID = tuple(round(0.1 * i, 1) for i in range(11))


def probability(logits, labels, temperature: float = DEFAULT_TEMPERATURE) -> np.ndarray:
    """softmax(logits / temperature) at the true label, per record (float64). ``logits`` may carry
    leading model axes: shape (..., n, C) with labels (n,) gives (..., n)."""
    z = torch.as_tensor(np.asarray(logits), dtype=torch.float64) / float(temperature)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    p = torch.softmax(z, dim=-1)
    index = y.expand(p.shape[:-1]).unsqueeze(-1)
    return p.gather(-1, index).squeeze(-1).numpy()


def offline_p(p_out, a: float) -> np.ndarray:
    """p(x) from OUT reference probabilities ``(n, k)``: ½((1 + a)·mean_OUT + (1 − a))."""
    mean_out = np.asarray(p_out, np.float64).reshape(len(p_out), -1).mean(axis=1)
    return 0.5 * ((1 + a) * mean_out + (1 - a))


def rmia_scores(p_x, p_out_x, p_z, p_out_z, gamma: float = DEFAULT_GAMMA, a: float = DEFAULT_OFFLINE_A,
                x_group=None, z_group=None) -> np.ndarray:
    """Offline RMIA score per record: the fraction of same-group population records z with
    LR(x, z) = [p(x|θ)/p(x)] / [p(z|θ)/p(z)] > γ. A record whose group has no z gets NaN."""
    ratio_x = np.asarray(p_x, np.float64).ravel() / offline_p(p_out_x, a)
    ratio_z = np.asarray(p_z, np.float64).ravel() / offline_p(p_out_z, a)
    # ratio_x / ratio_z > γ  ⇔  ratio_z < ratio_x / γ (all ratios are positive)
    return per_group(ratio_x, ratio_z, x_group, z_group,
                     lambda x, pop: np.searchsorted(pop, x / gamma, side="left") / len(pop))


def tune_offline_a(p_x, p_out_x, p_z, p_out_z, members, gamma: float = DEFAULT_GAMMA, x_group=None, z_group=None,
                   grid=A_GRID) -> tuple[float, dict[float, float]]:
    """The a in ``grid`` whose RMIA scores on a known-membership model (one model of a reference
    pair, attacked with the other reference models) give the highest AUC; ties keep the smaller
    a. Returns (a, {a: AUC})."""
    members = np.asarray(members).astype(bool).ravel()
    aucs: dict[float, float] = {}
    for a in grid:
        scores = rmia_scores(p_x, p_out_x, p_z, p_out_z, gamma, a, x_group, z_group)
        ok = np.isfinite(scores)
        aucs[float(a)] = auc(scores[ok], members[ok]) if ok.any() else float("nan")
    best = max(aucs, key=lambda k: (np.nan_to_num(aucs[k], nan=-1.0), -k))
    return best, aucs


def _score(inputs) -> np.ndarray:
    """Offline RMIA on ``MembershipInputs`` (options: gamma, temperature, a)."""
    o = inputs.options
    temperature = o.get("temperature", DEFAULT_TEMPERATURE)
    p_t = probability(inputs.logits, inputs.labels, temperature)
    p_refs = probability(inputs.reference_logits, inputs.labels, temperature)  # (R, n)
    p_out = inputs.per_record(p_refs.T, trained=False)
    z = inputs.population
    return rmia_scores(p_t, p_out, p_t[z], p_out[z], o.get("gamma", DEFAULT_GAMMA), o.get("a", DEFAULT_OFFLINE_A),
                       inputs.owner, inputs.owner[z])


SPEC = MembershipSpec("rmia", _score, references=True)
