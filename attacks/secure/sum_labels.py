"""``sum-labels``: the label histogram of a whole round, read from its secure sum.

A curious server under secure aggregation cannot tell one client's labels from another's, but the sum
still counts them all: FedProto's clients add their class counts (the histogram, exactly), and the
FedAvg family's clients add their weighted models, whose classifier-bias update is a known function of
the round's labels and the model's predictions on them (the rule is
``attacks.secure.observation.round_counts``; for one client it is the closed form's label counts,
``attacks.inversion.closed_form.label_counts``, and the same reasoning as label-count inference,
``attacks.inversion.label_distribution``). The predictions on the clients' images are estimated by the
sent model's mean prediction on the server's public data (``--aux-data``, else the pooled data set
without any client's training images).

Result: no images; ``trace`` holds ``label_counts`` ((C,) integers: the round's histogram over the
survivors' training images), ``raw_counts`` (before rounding), ``label_distribution`` (the same as
proportions), ``source``/``mode`` and ``count_error_bound`` (what the protocol's quantisation alone can
move a count by, at worst). The harness scores it against the survivors' true histogram (exact or not,
Σₖ|n̂ₖ − nₖ|).
"""
from __future__ import annotations

import time

import torch

from ..base import AttackResult, Budget
from ..registry import RoundAttackSpec
from .observation import RoundObservation, round_counts


def count_error_bound(obs: RoundObservation, source: str) -> float:
    """The most the quantisation can move one count: the summed value is off by at most
    ``len(survivors) * quantum``, times what turns it into a count: max_weight, and for the bias rule
    1/lr and (1 + |b|) (the summed bias and the summed weight times the sent bias b are both off)."""
    error = len(obs.survivors) * obs.quantum * obs.max_weight
    sent = obs.sent()
    if source.startswith("summed classifier") and obs.known_hyperparameters is not None and sent is not None:
        error *= (1 + float(sent["classifier.bias"].abs().max())) / obs.known_hyperparameters.lr
    return float(error)


def sum_labels(observation: RoundObservation, budget: Budget, seed: int) -> AttackResult:
    """The round's label histogram from its sum (module docstring). ``budget`` and ``seed`` are unused:
    the reading is analytic and deterministic."""
    start = time.perf_counter()
    read = round_counts(observation)
    counts = read.counts.to(torch.int64)
    total = max(int(counts.sum()), 1)
    bound = count_error_bound(observation, read.source)
    notes = list(read.notes)
    if bound >= 0.5:
        notes.append(f"the protocol's quantisation alone can move a count by up to {bound:.2f} (at worst): "
                     f"a count may round the wrong way; --sa-max-weight near the largest client's sample count "
                     f"or a larger --sa-quantization-range narrows it")
    trace = {"label_counts": counts.tolist(), "raw_counts": read.raw.tolist(),
             "label_distribution": (counts.double() / total).tolist(), "source": read.source, "mode": read.source,
             "count_error_bound": bound, "seconds": time.perf_counter() - start}
    return AttackResult(images=torch.zeros((0, *observation.image_shape)), labels=torch.zeros(0, dtype=torch.int64),
                        trace=trace, notes=notes)


def summary_lines(summary: dict) -> list[str]:
    """The histogram's exactness over the attacked rounds, under the headline."""
    h = summary.get("histogram") or {}
    if not h.get("rounds"):
        return []
    return [f"  round label histogram exact in {h['exact_rounds']} of {h['rounds']} rounds; mean count error "
            f"{h['mean_count_error']:.2f} images per round (sum over classes of |predicted - true|)"]


SPEC = RoundAttackSpec("sum-labels", attack_round=sum_labels, default_victim_batch=0,
                       applies_to=frozenset({"classifier", "class_counts"}), scoring="labels",
                       needs="classifier or class counts in the sum",
                       hint="its secure sum carries no label information", summary_lines=summary_lines)
