"""Membership scoring and its statistics (``fedsec mia``): the model-based attacks on one target kind
(``score_kind``: every declared ``MembershipSpec`` on the target's and the reference models' logits,
RMIA's ``a`` tuned on reference pair 0 by ``tune_a``), the update test (``score_update``), the chance
level of the member/non-member split (``chance_level``), and per attack the pooled statistics with
client-bootstrap intervals, the per-client AUCs and the empirical ε lower bound (``attack_metrics``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from fedecouple.engine import derive_seed

from .. import statistics as st
from ..registry import MEMBERSHIP, MembershipInputs
from .mia_threshold import loss_scores
from .mia_update import loss_decrease, update_scores
from .rmia import DEFAULT_OFFLINE_A, probability, tune_offline_a

FPR_LEVELS = {"tpr_at_1pct_fpr": 0.01, "tpr_at_0_1pct_fpr": 0.001}


@dataclass
class AuditRecords:
    """The audited records, grouped by client: pool index, owner, label, target membership."""

    index: np.ndarray
    owner: np.ndarray
    labels: np.ndarray
    member: np.ndarray


def _pick(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Row-wise selection of ``values`` (m, R) where ``mask`` is True; every row has as many."""
    counts = mask.sum(axis=1)
    if len(counts) and counts.min() != counts.max():
        raise ValueError("every record needs the same number of selected reference runs")
    return values[mask].reshape(len(values), -1)


@dataclass
class KindScores:
    """Scores of one target kind: one array (all records, NaN where not scored) per attack."""

    scores: dict[str, np.ndarray] = field(default_factory=dict)
    not_applicable: dict[str, str] = field(default_factory=dict)
    offline_a: dict = field(default_factory=dict)
    note: str | None = None  # how the target model was assembled, when that needs saying
    chance: dict = field(default_factory=dict)  # the split's LOSS AUC under models trained on neither


def tune_a(ref_p: np.ndarray, ref_in: np.ndarray, owner: np.ndarray, gamma: float) -> dict:
    """Tune RMIA's ``a`` on reference pair 0: run 0 is attacked with the runs outside its pair (each
    record is OUT of exactly (R − 2)/2 of them); members = its IN records, population = its OUT
    records of the same client. ``ref_p``: (R, m) probabilities of the true label."""
    runs = ref_p.shape[0]
    others = list(range(2, runs))
    members = ref_in[:, 0]
    p_out = _pick(ref_p[others].T, ~ref_in[:, others])
    z = ~members
    a, aucs = tune_offline_a(ref_p[0], p_out, ref_p[0][z], p_out[z], members, gamma, owner, owner[z])
    return {"a": a, "tuned": True, "auc_by_a": aucs, "pseudo_target": "ref-0",
            "references": [f"ref-{r}" for r in others]}


def score_kind(target: np.ndarray, refs: np.ndarray, records: AuditRecords, ref_in: np.ndarray,
               settings) -> KindScores:
    """Model-based attacks on one target kind. ``target``: (n, C) logits; ``refs``: (R, n, C);
    ``settings``: the attacks to run and their options (``attacks``, ``gamma``, ``temperature``,
    ``offline_a``: None tunes it; ``fedsec.jobs.mia.MiaSettings`` holds them)."""
    result = KindScores()
    valid = np.isfinite(target).all(axis=1) & np.isfinite(refs).all(axis=(0, 2))
    t, y = target[valid], records.labels[valid]
    owner, member = records.owner[valid], records.member[valid]
    z = ~member  # the population: the target's held-out records, grouped by client
    inside = ref_in[valid]
    if "rmia" in settings.attacks:
        p_refs = probability(refs[:, valid], y, settings.temperature)
        result.offline_a = _offline_a(p_refs, inside, owner, settings)
    inputs = MembershipInputs(t, y, owner, z, refs[:, valid], inside,
                              {"gamma": settings.gamma, "temperature": settings.temperature,
                               "a": (result.offline_a or {}).get("a", DEFAULT_OFFLINE_A)})
    raw = {name: MEMBERSHIP[name].score(inputs) for name in settings.attacks if name in MEMBERSHIP}
    for name, values in raw.items():
        full = np.full(len(records.index), np.nan)
        full[valid] = values
        result.scores[name] = full
    return result


def _offline_a(p_refs: np.ndarray, inside: np.ndarray, owner: np.ndarray, settings) -> dict:
    if settings.offline_a is not None:
        return {"a": settings.offline_a, "tuned": False}
    if p_refs.shape[0] < 4:
        return {"a": DEFAULT_OFFLINE_A, "tuned": False,
                "note": f"not tuned: tuning needs a reference pair plus another pair (--reference-runs >= 4); "
                        f"used the default a = {DEFAULT_OFFLINE_A}"}
    return tune_a(p_refs, inside, owner, settings.gamma)


def chance_level(refs: np.ndarray, records: AuditRecords, ref_in: np.ndarray) -> dict:
    """The LOSS AUC of the target's member/non-member split under models that trained on neither:
    each reference run's models on the records that run left out. One random train/held-out split
    is not exactly balanced in difficulty, so this, not 0.5, is the chance level of the audit."""
    per_run = []
    for r in range(refs.shape[0]):
        out = ~ref_in[:, r] & np.isfinite(refs[r]).all(axis=1)
        per_run.append(st.auc(loss_scores(refs[r][out], records.labels[out]), records.member[out]))
    return {"loss_auc_mean": float(np.mean(per_run)), "loss_auc_per_run": per_run}


def score_update(signals: dict, records: AuditRecords) -> np.ndarray:
    """The update test's scores (all records) from the target run's last-round loss matrices."""
    clients = signals["update_clients"].numpy()
    position = {int(c): i for i, c in enumerate(clients)}
    owner = np.array([position[int(c)] for c in records.owner])
    decrease = loss_decrease(signals["loss_down"].numpy(), signals["loss_up"].numpy())
    return update_scores(decrease, owner)


def _tpr_statistic(alpha: float) -> Callable[[np.ndarray, np.ndarray], float]:
    return lambda s, y: st.tpr_at_fpr(s, y, alpha)


def selection_clients(clients: np.ndarray, seed: int) -> np.ndarray:
    """A seeded half of the clients: the empirical-ε threshold is chosen on them, the bound
    evaluated on the others."""
    ids = np.unique(clients)
    chosen = np.random.default_rng(derive_seed(seed, 0xE951)).permutation(ids)[: len(ids) // 2]
    return np.isin(clients, chosen)


def attack_metrics(scores: np.ndarray, member: np.ndarray, clients: np.ndarray, n_boot: int, seed: int,
                   delta: float) -> dict:
    """AUC, advantage and TPR at 1 % / 0.1 % FPR with client-bootstrap intervals (or the refusal),
    TPR at the fixed 1 %-FPR threshold with Clopper–Pearson, per-client AUCs, empirical ε."""
    ok = np.isfinite(scores)
    s, y, c = scores[ok], member[ok].astype(bool), clients[ok]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    out: dict = {"n_members": n_pos, "n_nonmembers": n_neg, "n_clients": int(len(np.unique(c))),
                 "n_unscored": int((~ok).sum())}
    if n_pos == 0 or n_neg == 0:
        out["note"] = "needs both members and non-members"
        return out
    out["auc"] = st.auc(s, y)
    out["auc_ci"] = list(st.cluster_bootstrap((s, y), c, st.auc, n_boot, seed))
    out["advantage"] = st.advantage(s, y)
    out["advantage_ci"] = list(st.cluster_bootstrap((s, y), c, st.advantage, n_boot, seed))
    for key, alpha in FPR_LEVELS.items():
        refusal = st.low_fpr_refusal(n_neg, alpha)
        if refusal is not None:
            out[key], out[key + "_ci"] = refusal, None
            continue
        out[key] = st.tpr_at_fpr(s, y, alpha)
        out[key + "_ci"] = list(st.cluster_bootstrap((s, y), c, _tpr_statistic(alpha), n_boot, seed))
        fixed = st.tpr_at_fixed_threshold(s, y, st.threshold_at_fpr(s, y, alpha))
        out[key + "_fixed_threshold"] = {"tpr": fixed["tpr"], "tpr_ci_clopper_pearson": list(fixed["tpr_ci"]),
                                         "fpr": fixed["fpr"], "fpr_ci_clopper_pearson": list(fixed["fpr_ci"])}
    out["per_client_auc"] = per_client_auc_summary(s, y, c)
    out["empirical_epsilon"] = st.empirical_epsilon(s, y, delta, select=selection_clients(c, seed))
    return out


def per_client_aucs(scores: np.ndarray, member: np.ndarray, clients: np.ndarray) -> pd.DataFrame:
    rows = []
    for cid in np.unique(clients):
        sel = clients == cid
        y = member[sel].astype(bool)
        rows.append({"client": int(cid), "auc": st.auc(scores[sel], y), "n_members": int(y.sum()),
                     "n_nonmembers": int((~y).sum())})
    return pd.DataFrame(rows, columns=["client", "auc", "n_members", "n_nonmembers"])


def per_client_auc_summary(scores: np.ndarray, member: np.ndarray, clients: np.ndarray) -> dict:
    values = per_client_aucs(scores, member, clients)["auc"].dropna().to_numpy()
    if len(values) == 0:
        return {"n": 0}
    q = np.percentile(values, [0, 25, 50, 75, 100])
    return {"n": int(len(values)), "mean": float(values.mean()), "min": float(q[0]), "q1": float(q[1]),
            "median": float(q[2]), "q3": float(q[3]), "max": float(q[4])}


