"""Deep Leakage from Gradients (Zhu et al., 2019) and improved DLG (Zhao et al., 2020).

**DLG.** A dummy batch of images x (uniform noise in [0, 1], pixel space: the model normalises
inside) and dummy label logits ŷ (standard normal; the soft label is softmax(ŷ)) are optimised
jointly with L-BFGS (learning rate 1, torch's default of up to 20 function evaluations per step,
no line search, as in the paper's code) to minimise Σ_layers ‖∇W(x, ŷ) − ∇W(true)‖², the squared
distance between the dummy's gradient and the observed one (in the method mode: the sum over the
upload's weight groups and statistics of ‖a_g − b_g‖²/‖b_g‖², ``GradientMatcher.l2_objective``). ``budget.iterations`` is the number of
L-BFGS steps (the paper's 300), ``budget.restarts`` independent starts keep the lowest objective,
and within a start the lowest-objective iterate is returned (at least one step is taken). A start
stops early when it has converged (objective 1e-12 of its first value) or stalled (less than 1 %
improvement over 15 steps; this also ends a start whose L-BFGS has met its own gradient tolerance,
as every later step then returns at once): DLG on these models either converges or stalls. Pixels
are not constrained during the optimisation (as in DLG); the result is clamped to [0, 1].

The observed "gradient" comes from ``attacks.inversion.forward_model.GradientMatcher``: the upload's update
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
The rule is read only from an update with that signature (``idlg_applies``: the most negative row
holds ≥ ``IDLG_SHARE`` of the negative row sums); otherwise, e.g. FedeCouple's personal classifier in a
trained round, whose update is mostly its distillation towards the global classifier, the label is
optimised jointly and a note says why.
Without a classifier update (private head) iDLG falls back to DLG's joint label and says so.

**Many targets.** ``plan``/``plan_idlg`` prepare a list of observations. Targets that share a
model (``attacks.inversion.batching``) are optimised together: torch's L-BFGS algorithm with one state per
target, vectorised (``BatchedLBFGS``), their objectives evaluated in one ``torch.func.vmap`` call.
One target (``dlg``, or a group of one) runs torch's own ``LBFGS`` (``_optimise_one``), which
``BatchedLBFGS`` reproduces.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch.func import grad_and_value, vmap

from ..base import STARTS, AttackResult, Budget, Observation
from .batching import Batch, BatchedLBFGS, plan_by_model, stack_targets
from ..registry import GRADIENT_HINT, WEIGHT_KINDS, AttackSpec, register
from .forward_model import FAMILY_PARAMETERS, GradientMatcher, family_start
from .restarts import BestOfStarts, result_from_best

LBFGS_LR = 1.0
# a start whose best objective improved by less than 1 % over the last 15 L-BFGS steps (up to 300
# evaluations) is stopped: its best iterate is kept (DLG either converges or stalls on our models).
# Was 0.1 % over 25 steps: on the main job (FedeCouple, 8 targets) the same mean PSNR to 0.1 dB in
# 55 % of the time
STALL_STEPS = 15
STALL_TOLERANCE = 1e-2


def mix_seed(*parts: int) -> int:
    """A 32-bit seed mixed from integers (a restart's generator; the attack modules share it)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


# iDLG's rule reads one image's cross-entropy gradient, whose only row with a negative sum is the true
# class's. Where the negative sums spread over several rows the update is not that gradient (a personal
# classifier distilled towards the global one in a trained round: FedeCouple's KL term outweighs a
# cross-entropy the classifier already fits) and the rule picks a wrong class; the most negative row must
# hold at least this share of the negative mass (below 1 for the float rounding of rows near zero). Seen:
# 1.000 on every one-image target of FedAvg, FedPAC and FedeCouple at round 0 and FedPAC at round 19;
# 0.15-0.46 on FedeCouple's at round 19, where the rule read 1 of 8 labels right
IDLG_SHARE = 0.9


def idlg_share(weight_gradient: torch.Tensor) -> float:
    """The most negative row sum's share of all negative row sums of a classifier weight gradient (C, D)
    (1.0: one image's cross-entropy signature, iDLG's rule applies; nan: no negative row)."""
    rows = weight_gradient.detach().to(torch.float64).sum(dim=1)
    negative = (-rows).clamp_min(0)
    return float(negative.max() / negative.sum()) if float(negative.sum()) > 0 else float("nan")


def idlg_applies(weight_gradient: torch.Tensor) -> bool:
    """Whether iDLG's rule can read one image's label from this update (``IDLG_SHARE``)."""
    return idlg_share(weight_gradient) >= IDLG_SHARE


IDLG_NOT_APPLICABLE = (f"the classifier's update is not one image's cross-entropy gradient (its negative row sums are "
                       f"spread: the most negative holds < {IDLG_SHARE:.0%} of them: the trace's idlg_share; e.g. "
                       f"a personal classifier distilled towards the global one): iDLG's rule does not apply, the "
                       f"label is optimised jointly with the image")


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
    counts = torch.tensor(counts, dtype=torch.int64, device=negative.device)
    labels = torch.repeat_interleave(negative, counts)
    return labels, notes


def counted_labels(matcher: GradientMatcher, budget: Budget) -> torch.Tensor | None:
    """For a batch of several images, labels from the closed-form per-class counts
    (``attacks.inversion.closed_form.label_counts``), class by class; for one image only where the
    classifier-step solve confirmed its label (the features under it reproduce the update; else iDLG's
    rule applies); None without counts."""
    counts = matcher.closed.label_counts
    b = matcher.originals or max(1, int(budget.batch))
    if counts is None or int(counts.sum()) != b or matcher.epoch_copies != 1:
        return None
    if b == 1 and matcher.closed.classifier_features is None:
        return None
    return torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)


@dataclass
class _Setup:
    """One target's attack, ready to optimise: the matcher, its observed target, the fixed labels
    (iDLG) or None (joint soft label), and what goes into the result's trace and notes."""

    matcher: GradientMatcher
    target: list[torch.Tensor]
    labels: torch.Tensor | None
    shape: tuple[int, int, int, int]
    num_classes: int
    trace: dict
    notes: list[str]
    start: str = "noise"

    def objective(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, target: list[torch.Tensor]) -> torch.Tensor:
        """DLG's objective for one target; ``y`` is the fixed labels or the label logits, ``z`` the
        augmented copies' family parameters ((0, 8) when there are none)."""
        soft = y if self.labels is not None else torch.softmax(y, dim=-1)
        return self.matcher.l2_objective(self.matcher.dummy(x, soft, z, target=target), target)

    @property
    def originals(self) -> int:
        """How many of the dummy images are reconstructions (the rest: free augmented copies)."""
        return self.shape[0] - self.matcher.free_copies

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Sizes of the flat variable's three parts: images, label logits (0 when fixed), copy parameters."""
        b, c, h, w = self.shape
        return b * c * h * w, 0 if self.labels is not None else self.originals * self.num_classes, \
            self.matcher.copy_parameters

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(images, label logits or None, copy parameters) of flat variables (..., size)."""
        i, l, e = self.sizes
        lead = flat.shape[:-1]
        y = None if l == 0 else flat[..., i:i + l].reshape(*lead, self.originals, self.num_classes)
        return (flat[..., :i].reshape(*lead, *self.shape), y,
                flat[..., i + l:i + l + e].reshape(*lead, e // FAMILY_PARAMETERS, FAMILY_PARAMETERS))

    def gradient_and_value(self):
        """torch.func transform of ``objective``: (∂/∂x[, ∂/∂y], ∂/∂z), value."""
        return grad_and_value(self.objective, argnums=(0, 2) if self.labels is not None else (0, 1, 2))


def _setup(obs: Observation, budget: Budget, mode: str, fixed_labels: bool, name: str) -> _Setup:
    matcher = GradientMatcher(obs, mode)
    notes = list(matcher.notes)
    b = matcher.originals or max(1, int(budget.batch))
    trace: dict = {"attack": name, "mode": matcher.mode, "attacked_parameters": list(matcher.names),
                   "optimizer": "L-BFGS", "lr": LBFGS_LR}
    trace["closed_form"] = matcher.closed.trace
    labels = None
    if matcher.labels_unused:
        labels = torch.zeros(b, dtype=torch.int64)
        trace["label_source"] = "none (the head-free closed form does not depend on the label)"
    elif fixed_labels and counted_labels(matcher, budget) is not None:
        labels = counted_labels(matcher, budget)
        trace["label_source"] = f"closed-form counts ({matcher.closed.trace['label_counts_source']})"
    elif fixed_labels:
        weight = matcher.classifier_weight_target()
        if weight is None:
            notes.append("no classifier update is available (private or excluded head): iDLG cannot read the "
                          "label, so the label is optimised jointly as in DLG")
        else:
            trace["classifier_row_sums"] = weight.detach().sum(dim=1).tolist()
            if b == 1 and not idlg_applies(weight):
                notes.append(IDLG_NOT_APPLICABLE)
                trace["idlg_share"] = idlg_share(weight)
            else:
                labels, label_notes = idlg_labels(weight, b)
                notes += label_notes
                trace["label_source"] = "idlg-rule"
    if labels is None:
        trace["label_source"] = "joint (soft label optimised with the image)"
    else:
        labels = labels.to(obs.device)
    if budget.start not in STARTS:
        raise ValueError(f"unknown start {budget.start!r}; choose one of: {', '.join(STARTS)}")
    trace["start"] = budget.start
    if matcher.has_closed_form_start:
        trace["start"] = f"closed form, then {budget.start}"
        notes.append("the first start is the image rebuilt from the closed form's input of the extractor's last "
                     "linear layer (attacks.layer_inversion); further starts as --start says")
    return _Setup(matcher, [t.detach() for t in matcher.target], labels, (b + matcher.free_copies, *obs.image_shape),
                  obs.num_classes, trace, notes, budget.start)


def _start(setup: _Setup, seed: int, restart: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A start's seeded dummy batch: images uniform in [0, 1] (or, with ``Budget.start`` "mean", the
    per-channel mean the model's normalisation carries), label logits standard normal (None when the
    labels are fixed), the copies' family parameters at the identity. The first start's image is the one
    the closed form rebuilt, where it rebuilt one (``GradientMatcher.closed_form_start``)."""
    gen = torch.Generator().manual_seed(mix_seed(seed, restart, 0xD16))
    device = setup.matcher.observation.device  # drawn on the CPU: the same starts on every device
    x = torch.rand(setup.shape, generator=gen).to(device)
    if setup.start == "mean":
        x = setup.matcher.model.normalize.mean.reshape(1, -1, 1, 1).expand(setup.shape).clone()
    rebuilt = setup.matcher.closed_form_start if restart == 0 else None
    if rebuilt is not None:  # the image the closed form gives back; its augmented copies as drawn above
        x = x.clone()
        x[:len(rebuilt)] = rebuilt
    y = None if setup.labels is not None else \
        torch.randn((setup.originals, setup.num_classes), generator=gen).to(device)
    return x, y, family_start(setup.matcher.copy_parameters // FAMILY_PARAMETERS, device)


def _optimise(setups: Sequence[_Setup], budget: Budget, seeds: Sequence[int]) -> list[AttackResult]:
    """DLG's L-BFGS on targets that share a model (``setups[0]``'s), all at once.

    Per target what ``_optimise_one`` does with torch's L-BFGS (``attacks.inversion.batching.BatchedLBFGS``):
    up to ``budget.iterations`` steps from each of ``budget.restarts`` starts, the lowest-objective
    iterate kept, a start ended early when it converged, stalled or diverged."""
    if len(setups) == 1:
        return [_optimise_one(setups[0], budget, seeds[0])]
    return _LockstepDLG(setups, budget, seeds).run()


class _LockstepDLG:
    """Several targets' DLG starts in lockstep: one vmapped evaluation for every running target, one
    ``BatchedLBFGS`` holding each target's own L-BFGS state."""

    def __init__(self, setups: Sequence[_Setup], budget: Budget, seeds: Sequence[int]):
        self.setups, self.budget, self.seeds = list(setups), budget, list(seeds)
        lead, n = setups[0], len(setups)
        self.lead, self.n, self.fixed = lead, n, lead.labels is not None
        size = sum(lead.sizes)
        self.transform = vmap(lead.gradient_and_value())
        self.targets = stack_targets([s.target for s in setups])
        self.labels = torch.stack([s.labels for s in setups]) if self.fixed else None
        self.lbfgs = BatchedLBFGS(n, size, lr=LBFGS_LR, device=lead.matcher.observation.device)
        self.notes = [list(s.notes) for s in setups]
        self.restart = [0] * n
        self.starts = BestOfStarts(n)
        self.runs: list[dict] = [{} for _ in setups]
        self.record = [{"evaluations": 0, "stalled": []} for _ in setups]

    def begin(self, k: int) -> None:
        x, y, z = _start(self.setups[k], self.seeds[k], self.restart[k])
        self.lbfgs.start(k, torch.cat([x.reshape(-1)] + ([] if y is None else [y.reshape(-1)]) + [z.reshape(-1)]))
        self.runs[k] = {"objective": float("inf"), "images": None, "labels": None, "evals": 0, "history": []}

    def finish(self, k: int) -> None:
        run = self.runs[k]
        self.record[k]["evaluations"] += run["evals"]
        self.starts.offer(k, run["objective"], run["history"], run if run["images"] is not None else None)
        self.restart[k] += 1
        if self.restart[k] < max(1, int(self.budget.restarts)):
            self.begin(k)
        else:
            self.lbfgs.stop(k)

    def evaluate(self, pending: list[int], rows: torch.Tensor, target: list[torch.Tensor], fixed_labels):
        """(images, label logits or None, copy parameters, objective values, gradients) at the running
        targets' iterates."""
        x, y, z = self.lead.split(self.lbfgs.x[rows])
        grads, values = self.transform(x, fixed_labels if self.fixed else y, z, target)
        return x, y, z, values, torch.cat([g.reshape(len(pending), -1) for g in grads], dim=1)

    def take(self, pending: list[int], rows: torch.Tensor, x, y, z, values: list[float]) -> tuple[list, list, list]:
        """Record each running target's value (its best iterate so far); a non-finite value ends the
        start. Returns (targets, values, row positions) to hand to L-BFGS."""
        told, losses, told_rows = [], [], []
        for j, (k, value) in enumerate(zip(pending, values)):
            run = self.runs[k]
            run["evals"] += 1
            if not np.isfinite(value):
                self.notes[k].append(f"restart {self.restart[k]}: the objective became non-finite; the best iterate "
                                     f"before it is kept")
                self.finish(k)
                continue
            if value < run["objective"]:
                run["objective"] = value
                run["images"] = x[j].detach().clone()
                run["labels"] = self.labels[rows[j]].clone() if self.fixed else y[j].argmax(dim=-1)
                run["probs"] = None if self.fixed else torch.softmax(y[j].detach(), dim=-1)
                run["copy_parameters"] = z[j].detach().clone()
            told.append(k)
            losses.append(value)
            told_rows.append(j)
        return told, losses, told_rows

    def after_step(self, k: int) -> None:
        """A target finished one torch L-BFGS step: stop its start if it converged, stalled or is done."""
        history = self.runs[k]["history"]
        history.append(self.runs[k]["objective"])
        verdict = _after_step(history)
        if verdict == "stalled":
            self.record[k]["stalled"].append(len(history))
        if verdict or len(history) >= int(self.budget.iterations):
            self.finish(k)

    def run(self) -> list[AttackResult]:
        start_time = time.perf_counter()
        for k in range(self.n):
            self.begin(k)
        members: list[int] = []
        while pending := self.lbfgs.pending():
            if pending != members:  # the running targets change rarely: select their rows only then
                members, rows = pending, torch.tensor(pending, device=self.lbfgs.x.device)
                target = [t[rows] for t in self.targets]
                fixed_labels = self.labels[rows] if self.fixed else None
            x, y, z, values, grads = self.evaluate(pending, rows, target, fixed_labels)
            told, losses, told_rows = self.take(pending, rows, x, y, z, values.tolist())
            for k in self.lbfgs.tell(told, losses, grads[told_rows]):
                self.after_step(k)
        share = (time.perf_counter() - start_time) / self.n
        return [_result(setup, self.starts.best[k], self.notes[k],
                        {"restart_objectives": self.starts.objectives[k], "history": self.starts.histories[k],
                         "evaluations": self.record[k]["evaluations"], "stalled_at_steps": self.record[k]["stalled"],
                         "seconds": share, "batched_with": self.n, "optimizer": "L-BFGS (batched)"})
                for k, setup in enumerate(self.setups)]


def _optimise_one(setup: _Setup, budget: Budget, seed: int) -> AttackResult:
    """One target with torch's own L-BFGS (the reference ``BatchedLBFGS`` reproduces)."""
    start_time = time.perf_counter()
    notes, labels = list(setup.notes), setup.labels
    fixed = labels is not None
    transform = setup.gradient_and_value()
    starts, evaluations, stalled = BestOfStarts(1), 0, []
    for restart in range(max(1, int(budget.restarts))):
        x, y, z = _start(setup, seed, restart)
        variables = [v.requires_grad_(True) for v in (x, y, z) if v is not None and v.numel()]
        opt = torch.optim.LBFGS(variables, lr=LBFGS_LR)
        run = {"objective": float("inf"), "images": None, "labels": None, "evals": 0}

        def closure():
            grads, value = transform(x.detach(), labels if fixed else y.detach(), z.detach(), setup.target)
            for v, g in zip((x,) + (() if fixed else (y,)) + (z,), grads):
                v.grad = g
            objective = float(value)
            run["evals"] += 1
            if not np.isfinite(objective):
                raise _Diverged
            if objective < run["objective"]:
                run.update(objective=objective, images=x.detach().clone(),
                           labels=labels.clone() if fixed else y.detach().argmax(dim=-1),
                           probs=None if fixed else torch.softmax(y.detach(), dim=-1),
                           copy_parameters=z.detach().clone())
            return value

        history: list[float] = []
        for _ in range(max(1, int(budget.iterations))):
            try:
                opt.step(closure)
            except _Diverged:
                notes.append(f"restart {restart}: the objective became non-finite; the best iterate before it is kept")
                break
            history.append(run["objective"])
            verdict = _after_step(history)
            if verdict == "stalled":
                stalled.append(len(history))
            if verdict:
                break
        evaluations += run["evals"]
        starts.offer(0, run["objective"], history, run if run["images"] is not None else None)
    return _result(setup, starts.best[0], notes, {"restart_objectives": starts.objectives[0],
                                                  "history": starts.histories[0],
                                        "evaluations": evaluations, "stalled_at_steps": stalled,
                                        "seconds": time.perf_counter() - start_time})


def _after_step(history: list[float]) -> str | None:
    """After an L-BFGS step: "converged" (objective 1e-12 of its first value), "stalled" (less than
    STALL_TOLERANCE better than STALL_STEPS steps ago), or None to go on."""
    if history[-1] <= 1e-12 * max(history[0], 1e-30) or history[-1] == 0.0:
        return "converged"
    if len(history) > STALL_STEPS and history[-1] > (1 - STALL_TOLERANCE) * history[-1 - STALL_STEPS]:
        return "stalled"
    return None


def _result(setup: _Setup, best: dict | None, notes: list[str], trace: dict) -> AttackResult:
    return result_from_best(setup.matcher, best, shape=setup.shape, originals=setup.originals,
                            num_classes=setup.num_classes, notes=notes, setup_trace=setup.trace, trace=trace)


class _Diverged(Exception):
    pass


def _run_dlg(obs: Observation, budget: Budget, seed: int, mode: str, fixed_labels: bool, name: str) -> AttackResult:
    return _optimise_one(_setup(obs, budget, mode, fixed_labels, name), budget, seed)


def dlg(observation: Observation, budget: Budget, seed: int, mode: str = "auto") -> AttackResult:
    """DLG: image and soft label optimised jointly (see module docstring)."""
    return _run_dlg(observation, budget, seed, mode, fixed_labels=False, name="dlg")


def idlg(observation: Observation, budget: Budget, seed: int, mode: str = "auto") -> AttackResult:
    """iDLG: label from the classifier's weight-gradient rows, then DLG with the label fixed."""
    return _run_dlg(observation, budget, seed, mode, fixed_labels=True, name="idlg")


def _optimise_group(budget: Budget, setups: Sequence[_Setup], seeds: Sequence[int]) -> list[AttackResult]:
    return _optimise(setups, budget, seeds)


def plan(observations: Sequence[Observation], budget: Budget, mode: str = "auto", batched: bool = True, *,
         fixed_labels: bool = False, name: str = "dlg") -> tuple[list[Batch], dict]:
    """DLG (or iDLG with ``fixed_labels``) on many targets: one ``Batch`` per group of targets that
    share a model (``attacks.inversion.batching``), each optimised together by ``BatchedLBFGS``."""
    prepare = functools.partial(_setup, budget=budget, mode=mode, fixed_labels=fixed_labels, name=name)
    return plan_by_model(prepare, functools.partial(_optimise_group, budget), observations, batched)


def plan_idlg(observations: Sequence[Observation], budget: Budget, mode: str = "auto",
              batched: bool = True) -> tuple[list[Batch], dict]:
    return plan(observations, budget, mode, batched, fixed_labels=True, name="idlg")


register(AttackSpec("dlg", "gradient", "Deep Leakage from Gradients: image and soft label by L-BFGS gradient matching",
                    dlg, plan, default_iterations=300, default_victim_batch=1, applies_to=WEIGHT_KINDS,
                    scoring="images", needs="model weights", hint=GRADIENT_HINT,
                    matching="l2"))
register(AttackSpec("idlg", "gradient", "improved DLG: the label from the classifier's gradient, then DLG",
                    idlg, plan_idlg, default_iterations=300, default_victim_batch=1, applies_to=WEIGHT_KINDS,
                    scoring="images", needs="model weights", hint=GRADIENT_HINT,
                    matching="l2"))
