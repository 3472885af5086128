"""Update-based membership inference by the server, in the spirit of FedMIA (Zhu et al., arXiv
2402.06289, "the other clients' updates are free OUT references").

Registry entry ``update``: inputs → one score per record, higher = more likely a member of the
client that owns it.

* Inputs: for every client j that uploaded in one round, each record's loss under the model the
  server sent j (``loss_down[j]``) and under the model j uploaded (``loss_up[j]``), shape
  (clients, n); and the position of each record's owner in that client axis (``owner``, (n,)).
* Signal: the loss decrease s_j(x) = loss_down[j](x) − loss_up[j](x): local training on x lowers
  x's loss more than training on other data does.
* A record belongs to at most one client, so the other clients' decreases on x are draws from
  "x was OUT" for the same record and round. Score(x) = (s_owner(x) − mean_{j≠owner} s_j(x)) /
  sd_{j≠owner} s_j(x), the one-sided Gaussian test of FedMIA with per-record mean and standard
  deviation (Bessel-corrected; floored at 1e-3 of the pooled one, so a record every reference
  agrees on does not explode). Needs at least three clients (two references).

Pure functions over numpy arrays; no training.
"""
from __future__ import annotations

import numpy as np

MIN_CLIENTS = 3
STD_FLOOR_FRACTION = 1e-3


def loss_decrease(loss_down, loss_up) -> np.ndarray:
    """s_j(x) = loss under the download − loss under the upload, per client row and record column."""
    return np.asarray(loss_down, np.float64) - np.asarray(loss_up, np.float64)


def update_scores(decrease, owner) -> np.ndarray:
    """z-score of the owner's loss decrease on each record against the other clients' (see module)."""
    s = np.asarray(decrease, np.float64)
    own = np.asarray(owner, np.int64).ravel()
    clients, n = s.shape
    if clients < MIN_CLIENTS:
        raise ValueError(f"the update test needs uploads of at least {MIN_CLIENTS} clients in the round, got {clients}")
    if len(own) != n or own.min(initial=0) < 0 or own.max(initial=0) >= clients:
        raise ValueError("owner must give, for every record, a row of the decrease matrix")
    columns = np.arange(n)
    target = s[own, columns]
    others = np.ones_like(s, dtype=bool)
    others[own, columns] = False
    refs = s.T[others.T].reshape(n, clients - 1)
    mean = refs.mean(axis=1)
    std = refs.std(axis=1, ddof=1)
    pooled = float(np.sqrt(np.mean(std ** 2))) if n else 1.0
    std = np.maximum(std, STD_FLOOR_FRACTION * pooled if pooled > 0 else 1e-12)
    return (target - mean) / std
