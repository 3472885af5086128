"""L-BFGS over seeded starts, the lowest-objective iterate kept: the optimisation of the gradient
attacks that match with L-BFGS (DLG and iDLG, ``attacks.inversion.dlg``), for one target with torch's
own ``LBFGS`` (``optimise_one``) and for targets that share a model in lockstep, each with its own
L-BFGS state in one ``BatchedLBFGS`` and their objectives evaluated in one ``torch.func.vmap`` call
(``Lockstep``), which reproduces the first to float rounding.

Per target: up to ``iterations`` L-BFGS steps from each of ``restarts`` starts; within a start the
lowest-objective iterate seen at any evaluation is kept (at least one step is taken); a start ends
early when ``LBFGS.verdict`` says it converged or stalled, or when its objective is not finite (the
best iterate before it is kept); over the starts, the one with the lowest objective (``BestOfStarts``).

A problem (``Problem``) declares what is matched: its start, its objective's ``torch.func`` transform,
the layout of its variables, and how a kept iterate becomes an ``AttackResult``.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence

import numpy as np
import torch
from torch.func import vmap

from ...base import AttackResult
from ..batching import stack_targets
from .lbfgs import LBFGS, BatchedLBFGS, Diverged, run_lbfgs
from .starts import BestOfStarts


class Problem(Protocol):
    """One target's matching problem. ``labels``: fixed labels, or None (label logits optimised);
    ``target``: its observed tensors; ``notes``: the sentences so far; ``device``: where it computes."""

    labels: torch.Tensor | None
    target: list[torch.Tensor]
    notes: list[str]
    device: torch.device | str

    def start(self, seed: int, restart: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A start's (images, label logits or None, copy parameters)."""

    def gradient_and_value(self):
        """torch.func transform of the objective(x, y, z, target): (gradients of x[, y], z), value."""

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Sizes of the flat variable's three parts: images, label logits (0 when fixed), copy parameters."""

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(images, label logits or None, copy parameters) of flat variables (..., size)."""

    def result(self, best: dict | None, notes: list[str], trace: dict) -> AttackResult:
        """The ``AttackResult`` of the kept iterate (None: no start produced one)."""


def optimise(problems: Sequence[Problem], lbfgs: LBFGS, iterations: int, restarts: int,
             seeds: Sequence[int]) -> list[AttackResult]:
    """Every problem (targets that share a model) optimised at once: alone with torch's L-BFGS, several
    in lockstep (module docstring)."""
    if len(problems) == 1:
        return [optimise_one(problems[0], lbfgs, iterations, restarts, seeds[0])]
    return Lockstep(problems, lbfgs, iterations, restarts, seeds).run()


def _iterate(problem: Problem, value: float, x, y, z, fixed_labels: torch.Tensor | None) -> dict:
    """A kept iterate: its objective, images, labels (fixed, or the logits' argmax), label probability
    rows (None when fixed) and copy parameters."""
    return {"objective": value, "images": x.detach().clone(),
            "labels": fixed_labels.clone() if fixed_labels is not None else y.detach().argmax(dim=-1),
            "probs": None if fixed_labels is not None else torch.softmax(y.detach(), dim=-1),
            "copy_parameters": z.detach().clone()}


def optimise_one(problem: Problem, lbfgs: LBFGS, iterations: int, restarts: int, seed: int) -> AttackResult:
    """One target with torch's own L-BFGS (the reference ``BatchedLBFGS`` reproduces)."""
    start_time = time.perf_counter()
    notes, labels = list(problem.notes), problem.labels
    fixed = labels is not None
    transform = problem.gradient_and_value()
    starts, evaluations, stalled = BestOfStarts(1), 0, []
    for restart in range(max(1, int(restarts))):
        x, y, z = problem.start(seed, restart)
        variables = [v.requires_grad_(True) for v in (x, y, z) if v is not None and v.numel()]
        run = {"objective": float("inf"), "images": None, "labels": None, "evals": 0}
        history: list[float] = []

        def evaluate():
            grads, value = transform(x.detach(), labels if fixed else y.detach(), z.detach(), problem.target)
            objective = float(value)
            run["evals"] += 1
            if not np.isfinite(objective):
                raise Diverged
            if objective < run["objective"]:
                run.update(_iterate(problem, objective, x, y, z, labels))
            return value, grads

        def after_step() -> bool:
            history.append(run["objective"])
            verdict = lbfgs.verdict(history)
            if verdict == "stalled":
                stalled.append(len(history))
            return verdict is not None

        if not run_lbfgs(lbfgs, variables, evaluate, steps=max(1, int(iterations)), after_step=after_step):
            notes.append(f"restart {restart}: the objective became non-finite; the best iterate before it is kept")
        evaluations += run["evals"]
        starts.offer(0, run["objective"], history, run if run["images"] is not None else None)
    return problem.result(starts.best[0], notes, {"restart_objectives": starts.objectives[0],
                                                  "history": starts.histories[0],
                                                  "evaluations": evaluations, "stalled_at_steps": stalled,
                                                  "seconds": time.perf_counter() - start_time})


class Lockstep:
    """Several targets' starts in lockstep: one vmapped evaluation for every running target, one
    ``BatchedLBFGS`` holding each target's own L-BFGS state."""

    def __init__(self, problems: Sequence[Problem], lbfgs: LBFGS, iterations: int, restarts: int,
                 seeds: Sequence[int]):
        self.problems, self.seeds = list(problems), list(seeds)
        self.iterations, self.restarts, self.settings = int(iterations), int(restarts), lbfgs
        lead, n = problems[0], len(problems)
        self.lead, self.n, self.fixed = lead, n, lead.labels is not None
        size = sum(lead.sizes)
        self.transform = vmap(lead.gradient_and_value())
        self.targets = stack_targets([p.target for p in problems])
        self.labels = torch.stack([p.labels for p in problems]) if self.fixed else None
        self.lbfgs = BatchedLBFGS(n, size, lr=lbfgs.lr, max_iter=lbfgs.max_iter,
                                  tolerance_grad=lbfgs.tolerance_grad, tolerance_change=lbfgs.tolerance_change,
                                  history_size=lbfgs.history_size, device=lead.device)
        self.notes = [list(p.notes) for p in problems]
        self.restart = [0] * n
        self.starts = BestOfStarts(n)
        self.runs: list[dict] = [{} for _ in problems]
        self.record = [{"evaluations": 0, "stalled": []} for _ in problems]

    def begin(self, k: int) -> None:
        x, y, z = self.problems[k].start(self.seeds[k], self.restart[k])
        self.lbfgs.start(k, torch.cat([x.reshape(-1)] + ([] if y is None else [y.reshape(-1)]) + [z.reshape(-1)]))
        self.runs[k] = {"objective": float("inf"), "images": None, "labels": None, "evals": 0, "history": []}

    def finish(self, k: int) -> None:
        run = self.runs[k]
        self.record[k]["evaluations"] += run["evals"]
        self.starts.offer(k, run["objective"], run["history"], run if run["images"] is not None else None)
        self.restart[k] += 1
        if self.restart[k] < max(1, self.restarts):
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
                run.update(_iterate(self.problems[k], value, x[j], None if self.fixed else y[j], z[j],
                                    self.labels[rows[j]] if self.fixed else None))
            told.append(k)
            losses.append(value)
            told_rows.append(j)
        return told, losses, told_rows

    def after_step(self, k: int) -> None:
        """A target finished one torch L-BFGS step: stop its start if it converged, stalled or is done."""
        history = self.runs[k]["history"]
        history.append(self.runs[k]["objective"])
        verdict = self.settings.verdict(history)
        if verdict == "stalled":
            self.record[k]["stalled"].append(len(history))
        if verdict or len(history) >= self.iterations:
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
        return [problem.result(self.starts.best[k], self.notes[k],
                               {"restart_objectives": self.starts.objectives[k], "history": self.starts.histories[k],
                                "evaluations": self.record[k]["evaluations"],
                                "stalled_at_steps": self.record[k]["stalled"],
                                "seconds": share, "batched_with": self.n, "optimizer": "L-BFGS (batched)"})
                for k, problem in enumerate(self.problems)]
