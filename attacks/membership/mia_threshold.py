"""Membership inference without reference models: LOSS, modified entropy, population threshold.

Registry entries (name: inputs → one score per record, higher = more likely a member):

* ``loss`` (Yeom et al., CSF 2018): the target model's logits and the records' labels →
  −cross-entropy. No parameters.
* ``entropy`` (Song & Mittal, USENIX Security 2021, "modified entropy"): logits and labels →
  −Mentr(x, y), Mentr = −(1 − p_y)·log p_y − Σ_{y'≠y} p_{y'}·log(1 − p_{y'}). No parameters.
* ``population`` ("Attack-P", Ye et al., CCS 2022): the target model's loss on each record and on
  population records known not to be members, grouped (e.g. by client, so each record is compared
  with population records of its own client's label mix) → the fraction of same-group population
  records whose loss is higher than the record's (ties count ½). A threshold at population
  quantile α is exactly "score ≥ 1 − α", so the score is Attack-P's test for every α at once. No
  parameters. A record that is itself a population record is compared with itself like any other
  (a tie): every score of a group then has the same denominator, which keeps the ranking of
  records exact (leaving x out would give it a denominator one smaller).

Pure functions over numpy arrays or tensors; no training.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..registry import MembershipSpec
from ..statistics import per_group

PROB_FLOOR = 1e-30  # keeps log(0) finite for saturated softmax outputs


def _logits(logits) -> torch.Tensor:
    return torch.as_tensor(np.asarray(logits) if not isinstance(logits, torch.Tensor) else logits).to(torch.float64)


def _labels(labels) -> torch.Tensor:
    return torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels).to(torch.int64)


def cross_entropy(logits, labels) -> np.ndarray:
    """Per-record cross-entropy −log softmax(logits)_y (float64)."""
    return F.cross_entropy(_logits(logits), _labels(labels), reduction="none").numpy()


def loss_scores(logits, labels) -> np.ndarray:
    """LOSS attack: −cross-entropy (members have lower loss)."""
    return -cross_entropy(logits, labels)


def modified_entropy(logits, labels) -> np.ndarray:
    """Song & Mittal's Mentr(x, y) per record (lower for confident, correct predictions)."""
    z, y = _logits(logits), _labels(labels)
    p = torch.softmax(z, dim=1)
    log_p = torch.log_softmax(z, dim=1)
    log_not_p = torch.log1p(-p).clamp_min(np.log(PROB_FLOOR))  # log(1 − p), finite when p → 1
    p_y = p.gather(1, y[:, None]).squeeze(1)
    true_term = -(1 - p_y) * log_p.gather(1, y[:, None]).squeeze(1)
    others = -(p * log_not_p)
    others = others.sum(1) - others.gather(1, y[:, None]).squeeze(1)
    return (true_term + others).numpy()


def entropy_scores(logits, labels) -> np.ndarray:
    """Modified-entropy attack: −Mentr."""
    return -modified_entropy(logits, labels)


def population_scores(loss_x, loss_z, x_group=None, z_group=None) -> np.ndarray:
    """Attack-P: for each record x, the fraction of population records z of the same group with
    loss(z) > loss(x), ties counting ½. A record whose group has no population record gets NaN."""
    def above(x: np.ndarray, pop: np.ndarray) -> np.ndarray:
        right = np.searchsorted(pop, x, side="right")
        left = np.searchsorted(pop, x, side="left")
        return ((len(pop) - right) + 0.5 * (right - left)) / len(pop)

    return per_group(loss_x, loss_z, x_group, z_group, above)


def _population(inputs) -> np.ndarray:
    loss = cross_entropy(inputs.logits, inputs.labels)
    z = inputs.population
    return population_scores(loss, loss[z], inputs.owner, inputs.owner[z])


LOSS = MembershipSpec("loss", lambda i: loss_scores(i.logits, i.labels), references=False)
ENTROPY = MembershipSpec("entropy", lambda i: entropy_scores(i.logits, i.labels), references=False)
POPULATION = MembershipSpec("population", _population, references=False)
