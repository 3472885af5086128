"""Deep Leakage from Gradients (Zhu et al., 2019) and improved DLG (Zhao et al., 2020).

**DLG.** A dummy batch of images x (uniform noise in [0, 1], pixel space: the model normalises
inside) and dummy label logits ŷ (standard normal; the soft label is softmax(ŷ)) are optimised
jointly with L-BFGS (learning rate 1, torch's default of up to 20 function evaluations per step,
no line search, as in the paper's code) to minimise Σ_layers ‖∇W(x, ŷ) − ∇W(true)‖², the squared
distance between the dummy's gradient and the observed one. ``budget.iterations`` is the number of
L-BFGS steps (the paper's 300), ``budget.restarts`` independent starts keep the lowest objective,
and within a start the lowest-objective iterate is returned. A start stops early when it has
converged (objective 1e-12 of its first value, or L-BFGS's own gradient tolerance) or stalled
(less than 0.1 % improvement over 25 steps): DLG on these models either converges or stalls. Pixels are not constrained during
the optimisation (as in DLG); the result is clamped to [0, 1].

The observed "gradient" comes from ``attacks.observation.GradientMatcher``: the upload's update
Δ read as g = −Δ/(lr·steps) ("scaled-gradient"), or T local SGD steps replayed on the dummy
("replay"). When the hyperparameters are unknown only the direction of Δ is known: the objective
then fits the scale in closed form, ‖a − s·b‖² with s = max(⟨a, b⟩, 0)/‖b‖².

**iDLG.** For one image and cross-entropy, the classifier's weight gradient is
∂L/∂W_k = (p_k − 1[k = y])·h with h the features. With non-negative features only the true
class's row has a negative sum, so y = argmin_k Σ_j ∂L/∂W_kj; then DLG runs with the label fixed.
Our models use LeakyReLU(0.01) before the classifier: features can be slightly negative, but
Σ_j h_j stays positive unless almost all features are negative, so the rule still holds in
practice (the trace records the row sums; the bias gradient, p_k − 1[k = y], gives the same sign
pattern exactly). For a batch of B > 1 images (not covered by iDLG) the classes with negative row
sums are taken, B labels spread over them in proportion to |row sum| (a heuristic, noted).
Without a classifier update (private head) iDLG falls back to DLG's joint label and says so.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .base import AttackResult, Budget, Observation
from .observation import GradientMatcher

LBFGS_LR = 1.0
# a start whose best objective improved by less than 0.1 % over the last 25 L-BFGS steps (up to 500
# evaluations) is stopped: its best iterate is kept (DLG either converges or stalls on our models)
STALL_STEPS = 25
STALL_TOLERANCE = 1e-3


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


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
    counts = torch.tensor(counts, dtype=torch.int64)
    labels = torch.repeat_interleave(negative, counts)
    return labels, notes


def gradient_distance(dummy: list[torch.Tensor], target: list[torch.Tensor], scale_known: bool) -> torch.Tensor:
    """Σ_layers ‖a − b‖², or with an unknown scale min_s≥0 Σ ‖a − s·b‖² (s in closed form)."""
    if scale_known:
        return sum(((a - b) ** 2).sum() for a, b in zip(dummy, target))
    dot = sum((a * b).sum() for a, b in zip(dummy, target))
    bb = sum((b * b).sum() for b in target)
    s = dot.clamp_min(0.0) / bb.clamp_min(1e-30)
    return sum(((a - s * b) ** 2).sum() for a, b in zip(dummy, target))


class _Diverged(Exception):
    pass


def _run_dlg(obs: Observation, budget: Budget, seed: int, mode: str, fixed_labels: bool, name: str) -> AttackResult:
    start_time = time.perf_counter()
    matcher = GradientMatcher(obs, mode)
    target = [t.detach() for t in matcher.target]
    notes = list(matcher.notes)
    b = max(1, int(budget.batch))
    c, h, w = obs.image_shape
    k = obs.num_classes
    trace: dict = {"attack": name, "mode": matcher.mode, "attacked_parameters": list(matcher.names),
                   "optimizer": "L-BFGS", "lr": LBFGS_LR}

    labels = None
    if fixed_labels:
        weight = matcher.classifier_weight_target()
        if weight is None:
            notes.append("no classifier update is available (private or excluded head): iDLG cannot read the "
                          "label, so the label is optimised jointly as in DLG")
            fixed_labels = False
        else:
            labels, label_notes = idlg_labels(weight, b)
            notes += label_notes
            trace["classifier_row_sums"] = weight.detach().sum(dim=1).tolist()
            trace["label_source"] = "idlg-rule"
    if not fixed_labels:
        trace["label_source"] = "joint (soft label optimised with the image)"

    best = {"objective": float("inf"), "images": None, "labels": None}
    restart_objectives, histories, evaluations, stalled = [], [], 0, []
    for restart in range(max(1, int(budget.restarts))):
        gen = torch.Generator().manual_seed(_seed(seed, restart, 0xD16))
        x = torch.rand((b, c, h, w), generator=gen).requires_grad_(True)
        variables = [x]
        y_logits = None
        if not fixed_labels:
            y_logits = torch.randn((b, k), generator=gen).requires_grad_(True)
            variables.append(y_logits)
        opt = torch.optim.LBFGS(variables, lr=LBFGS_LR)
        run = {"objective": float("inf"), "images": None, "labels": None, "evals": 0}

        def closure():
            opt.zero_grad()
            y = labels if fixed_labels else torch.softmax(y_logits, dim=-1)
            loss = gradient_distance(matcher.dummy(x, y), target, matcher.scale_known)
            value = float(loss.detach())
            run["evals"] += 1
            if not np.isfinite(value):
                raise _Diverged
            if value < run["objective"]:
                run["objective"] = value
                run["images"] = x.detach().clone()
                run["labels"] = labels.clone() if fixed_labels else y_logits.detach().argmax(dim=-1)
            loss.backward()
            return loss

        history = []
        first = None
        for _ in range(int(budget.iterations)):
            try:
                opt.step(closure)
            except _Diverged:
                notes.append(f"restart {restart}: the objective became non-finite; the best iterate before it is kept")
                break
            history.append(run["objective"])
            first = run["objective"] if first is None else first
            if run["objective"] <= 1e-12 * max(first, 1e-30) or run["objective"] == 0.0:
                break  # converged to the observed gradient
            if len(history) > STALL_STEPS and run["objective"] > (1 - STALL_TOLERANCE) * history[-1 - STALL_STEPS]:
                stalled.append(len(history))
                break  # stuck: the best iterate so far is what more steps would return
        evaluations += run["evals"]
        restart_objectives.append(run["objective"])
        histories.append(history)
        if run["images"] is not None and run["objective"] < best["objective"]:
            best = run
    if best["images"] is None:  # every start diverged at once
        best = {"objective": float("nan"), "images": torch.full((b, c, h, w), 0.5),
                "labels": torch.full((b,), -1, dtype=torch.int64)}
        notes.append("the optimisation failed from every start: the output is a grey image")
    trace.update({"objective": best["objective"], "restart_objectives": restart_objectives,
                  "history": histories, "evaluations": evaluations, "stalled_at_steps": stalled,
                  "seconds": time.perf_counter() - start_time})
    return AttackResult(images=best["images"].clamp(0, 1), labels=best["labels"].to(torch.int64), trace=trace,
                        notes=notes)


def dlg(observation: Observation, budget: Budget, seed: int, mode: str = "auto") -> AttackResult:
    """DLG: image and soft label optimised jointly (see module docstring)."""
    return _run_dlg(observation, budget, seed, mode, fixed_labels=False, name="dlg")


def idlg(observation: Observation, budget: Budget, seed: int, mode: str = "auto") -> AttackResult:
    """iDLG: label from the classifier's weight-gradient rows, then DLG with the label fixed."""
    return _run_dlg(observation, budget, seed, mode, fixed_labels=True, name="idlg")
