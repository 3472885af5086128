"""L-BFGS over seeded starts: the optimisation of the gradient attacks that match with L-BFGS (DLG and
iDLG, ``attacks.inversion.dlg``), for one target with one start with torch's own ``LBFGS``
(``optimise_one``), otherwise with every (target, start) a slot of one ``BatchedLBFGS`` (each slot its
own L-BFGS state) and the slots' objectives evaluated by ``torch.func.vmap`` (``Lockstep``), which
reproduces the first to float rounding. A slot that is paused, finished or dropped is not evaluated.

Within a start: up to ``iterations`` L-BFGS steps; the lowest-objective iterate seen at any evaluation
is kept (at least one step is taken); the start ends early when ``LBFGS.verdict`` says it converged or
stalled, or when its objective is not finite (the best iterate before it is kept).

Over a target's starts (``restarts`` > 1):

* the first start (the one a one-start run takes, e.g. DLG's closed-form image) runs to its end, and is
  evaluated in a vmapped call of its own with the other targets' first starts: its path is the
  one-start run's, bit for bit, whatever the other starts do;
* the other starts race by successive halving: all run ``FIRST_RUNG`` steps, the better half by the
  best objective so far (at that same step count, or final for a start that already ended) goes on to
  twice as many, and so on until one runs to its end (``halving_rungs``). Judged at equal steps, a
  start is not favoured for having taken more; the cost stays within a few one-start runs;
* the kept start: the lowest objective of the first start and the race's survivors, except that an
  informed first start (``Problem.informed_first_start``: a closed form's image) is kept unless
  another start's objective is ``INFORMED_MARGIN`` times lower. Measured on the main job (DLG, 8
  FedeCouple targets, 8 starts each run to their ends): every start stalled; within the 7 noise starts
  of a target the lowest objective picked nearly the best image (15.9 dB, best 16.0, average 14.5), but
  against the closed-form start it picked a worse one (16.7 dB against the closed-form start's 17.9,
  which was the best image in 7 of 8 targets at an objective up to 1.9 times higher).

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

# the racing starts' first rung, in L-BFGS steps (then 2x, 4x, ...). On the main job (DLG, 8 FedeCouple
# targets, 7 noise starts each, every one run to its end) the race replayed on those runs kept survivors of
# mean PSNR 15.0 dB with a first rung of 2 steps, 15.2 with 3, 15.5 with 4, 15.8 with 8 (the lowest final
# objective: 15.9), for 1.5x, 1.9x, 2.3x, 3.3x the steps of the one-start run on top of it. With 3,
# --restarts 8 took 2.4x the wall time of --restarts 1 (bench/restarts.py), within the 3x allowed it
FIRST_RUNG = 3
# an informed first start (a closed form's image) is kept over a drawn start unless the drawn one's
# objective is this many times lower. On the main job every start stalled; the lowest objective was a
# drawn start's in 6 of 8 targets, at down to 1/1.9 of the closed-form start's, and its image was worse in
# 5 of them (by up to 3.1 dB), better in one (0.5 dB): mean PSNR 16.7 dB against the closed-form start's
# 17.9. Among stalled starts of different kinds a lower objective is not a better image; a start that
# matches the upload (converging) is orders of magnitude lower
INFORMED_MARGIN = 10.0



class Problem(Protocol):
    """One target's matching problem. ``labels``: fixed labels, or None (label logits optimised);
    ``target``: its observed tensors; ``notes``: the sentences so far; ``device``: where it computes;
    ``informed_first_start``: whether start 0 is an informed guess (a closed form's image), not a draw."""

    labels: torch.Tensor | None
    target: list[torch.Tensor]
    notes: list[str]
    device: torch.device | str
    informed_first_start: bool

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
             seeds: Sequence[int], rungs: Sequence[int] | None = None) -> list[AttackResult]:
    """Every problem (targets that share a model) optimised at once: one target with one start alone with
    torch's L-BFGS, otherwise every (target, start) a slot of one lockstep run (module docstring)."""
    if len(problems) == 1 and max(1, int(restarts)) == 1:
        return [optimise_one(problems[0], lbfgs, iterations, restarts, seeds[0])]
    return Lockstep(problems, lbfgs, iterations, restarts, seeds, rungs).run()


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


def halving_rungs(candidates: int, iterations: int, first: int = FIRST_RUNG) -> list[int]:
    """The step counts at which racing candidates are compared (successive halving): ``first``, then
    doubling, until the rungs have halved ``candidates`` down to one, each below ``iterations``. One
    candidate: none."""
    rungs, alive, steps = [], max(1, int(candidates)), int(first)
    while alive > 1 and steps < iterations:
        rungs.append(steps)
        alive, steps = -(-alive // 2), 2 * steps
    return rungs


def lockstep_cost(restarts: int, iterations: int) -> float:
    """What ``restarts`` starts of ``iterations`` steps cost in one-start runs under ``Lockstep``, at most
    (a start that converges early costs less): the first start's full budget, and the race's steps (every
    racing start to the first rung, the surviving half on to each next, one to the end)."""
    racing, iterations = max(0, int(restarts) - 1), max(1, int(iterations))
    steps, alive, before = 0, racing, 0
    for rung in halving_rungs(racing, iterations):
        steps, alive, before = steps + alive * (rung - before), -(-alive // 2), rung
    return 1.0 + (steps + alive * (iterations - before)) / iterations


class Lockstep:
    """Every (target, start) of targets that share a model as one slot of one ``BatchedLBFGS`` (each
    slot its own L-BFGS state): slot ``k·K + c`` is target k's start c (K = ``restarts``; one start:
    slot k is target k). Each evaluation is one vmapped call for the running first starts and one for
    the running others, so the first starts take exactly the path of a one-start run. The other starts
    race by successive halving over ``rungs`` (module docstring); a paused, finished or dropped slot is
    not evaluated."""

    def __init__(self, problems: Sequence[Problem], lbfgs: LBFGS, iterations: int, restarts: int,
                 seeds: Sequence[int], rungs: Sequence[int] | None = None):
        self.problems, self.seeds = list(problems), list(seeds)
        self.iterations, self.settings = int(iterations), lbfgs
        self.candidates = K = max(1, int(restarts))
        self.rungs = list(halving_rungs(K - 1, self.iterations) if rungs is None else rungs)
        lead, n = problems[0], len(problems)
        self.lead, self.n, self.fixed = lead, n, lead.labels is not None
        self.slots = [(k, c) for k in range(n) for c in range(K)]
        self.transform = vmap(lead.gradient_and_value())
        self.targets = stack_targets([p.target for p in problems])
        self.labels = torch.stack([p.labels for p in problems]) if self.fixed else None
        self.lbfgs = BatchedLBFGS(len(self.slots), sum(lead.sizes), lr=lbfgs.lr, max_iter=lbfgs.max_iter,
                                  tolerance_grad=lbfgs.tolerance_grad, tolerance_change=lbfgs.tolerance_change,
                                  history_size=lbfgs.history_size, device=lead.device)
        self.notes = [list(p.notes) for p in problems]
        self.runs: list[dict] = [{} for _ in self.slots]
        self.state = ["running"] * len(self.slots)  # running, paused (at a rung), finished, dropped
        self.rung = [0] * n
        self.record = [{"evaluations": 0, "stalled": []} for _ in problems]

    def begin(self, s: int) -> None:
        k, c = self.slots[s]
        x, y, z = self.problems[k].start(self.seeds[k], c)
        self.lbfgs.start(s, torch.cat([x.reshape(-1)] + ([] if y is None else [y.reshape(-1)]) + [z.reshape(-1)]))
        self.runs[s] = {"objective": float("inf"), "images": None, "labels": None, "evals": 0, "history": []}

    def racing(self, k: int) -> range:
        """Target k's slots that race (every start but the first)."""
        return range(k * self.candidates + 1, (k + 1) * self.candidates)

    def budget(self, s: int) -> int:
        """The step count slot s runs to: the first start the full budget, a racing one its target's next
        rung (past the last rung, or alone in the race: the full budget)."""
        k, c = self.slots[s]
        return self.rungs[self.rung[k]] if c > 0 and self.rung[k] < len(self.rungs) else self.iterations

    def halt(self, s: int, state: str) -> None:
        """Slot s stops costing (``state``: paused at a rung, or finished); once none of its target's
        racing starts runs, the rung is judged."""
        self.state[s] = state
        self.lbfgs.stop(s)
        k, c = self.slots[s]
        if state == "finished":
            self.record[k]["evaluations"] += self.runs[s]["evals"]
        if c > 0 and not any(self.state[t] == "running" for t in self.racing(k)):
            self.judge(k)

    def judge(self, k: int) -> None:
        """Target k's racing starts all paused or finished: the better half by the best objective so far
        (at the rung's step count for the paused ones) stays, the rest is dropped; the paused survivors
        go on to the next rung (a lone survivor: to the full budget)."""
        alive = [s for s in self.racing(k) if self.state[s] in ("paused", "finished")]
        if not any(self.state[s] == "paused" for s in alive):
            return
        ranked = sorted(alive, key=lambda s: (self.runs[s]["objective"], s))
        kept = ranked[:-(-len(ranked) // 2)]
        for s in ranked[len(kept):]:
            if self.state[s] == "paused":
                self.record[k]["evaluations"] += self.runs[s]["evals"]
            self.state[s] = "dropped"
        self.rung[k] = self.rung[k] + 1 if len(kept) > 1 else len(self.rungs)
        for s in kept:
            if self.state[s] == "paused":
                self.state[s] = "running"
                self.lbfgs.resume(s)

    def evaluate(self, pending: list[int], rows: torch.Tensor, target: list[torch.Tensor], fixed_labels):
        """(images, label logits or None, copy parameters, objective values, gradients) at the running
        slots' iterates."""
        x, y, z = self.lead.split(self.lbfgs.x[rows])
        grads, values = self.transform(x, fixed_labels if self.fixed else y, z, target)
        return x, y, z, values, torch.cat([g.reshape(len(pending), -1) for g in grads], dim=1)

    def take(self, pending: list[int], x, y, z, fixed_labels, values: list[float]) -> tuple[list, list, list]:
        """Record each running slot's value (its best iterate so far); a non-finite value ends the
        start. Returns (slots, values, row positions) to hand to L-BFGS."""
        told, losses, told_rows = [], [], []
        for j, (s, value) in enumerate(zip(pending, values)):
            (k, c), run = self.slots[s], self.runs[s]
            run["evals"] += 1
            if not np.isfinite(value):
                self.notes[k].append(f"restart {c}: the objective became non-finite; the best iterate before it is kept")
                self.halt(s, "finished")
                continue
            if value < run["objective"]:
                run.update(_iterate(self.problems[k], value, x[j], None if self.fixed else y[j], z[j],
                                    fixed_labels[j] if self.fixed else None))
            told.append(s)
            losses.append(value)
            told_rows.append(j)
        return told, losses, told_rows

    def after_step(self, s: int) -> None:
        """A slot finished one torch L-BFGS step: it ends if it converged, stalled or spent the budget,
        and pauses at its target's rung."""
        k, history = self.slots[s][0], self.runs[s]["history"]
        history.append(self.runs[s]["objective"])
        verdict = self.settings.verdict(history)
        if verdict == "stalled":
            self.record[k]["stalled"].append(len(history))
        if verdict or len(history) >= self.iterations:
            self.halt(s, "finished")
        elif len(history) >= self.budget(s):
            self.halt(s, "paused")

    def kept(self, k: int) -> int | None:
        """Target k's kept start (module docstring): the lowest objective of the first start and the race's
        survivors, except that an informed first start gives way only to an objective ``INFORMED_MARGIN``
        times lower (None: no start produced an iterate)."""
        first = k * self.candidates
        alive = [s for s in range(first, first + self.candidates)
                 if self.state[s] != "dropped" and self.runs[s]["images"] is not None]
        best = min(alive, key=lambda s: (self.runs[s]["objective"], s), default=None)
        if (best is not None and best != first and first in alive
                and self.problems[k].informed_first_start
                and self.runs[best]["objective"] * INFORMED_MARGIN > self.runs[first]["objective"]):
            return first
        return best

    def step(self, pending: list[int], cache: dict) -> None:
        """One evaluation of the ``pending`` slots (one vmapped call) and their L-BFGS updates."""
        if pending != cache.get("members"):  # the running slots change rarely: select their rows only then
            rows = torch.tensor(pending, device=self.lbfgs.x.device)
            owners = torch.div(rows, self.candidates, rounding_mode="floor")  # slot k·K + c belongs to target k
            cache.update(members=pending, rows=rows, target=[t[owners] for t in self.targets],
                         fixed_labels=self.labels[owners] if self.fixed else None)
        x, y, z, values, grads = self.evaluate(pending, cache["rows"], cache["target"], cache["fixed_labels"])
        told, losses, told_rows = self.take(pending, x, y, z, cache["fixed_labels"], values.tolist())
        for s in self.lbfgs.tell(told, losses, grads[told_rows]):
            self.after_step(s)

    def run(self) -> list[AttackResult]:
        start_time = time.perf_counter()
        for s in range(len(self.slots)):
            self.begin(s)
        caches: tuple[dict, dict] = ({}, {})  # the first starts, the others
        while pending := self.lbfgs.pending():
            for others, cache in enumerate(caches):
                group = [s for s in pending if (self.slots[s][1] > 0) == bool(others)]
                if group:
                    self.step(group, cache)
        share = (time.perf_counter() - start_time) / self.n
        return [self.result(k, share) for k in range(self.n)]

    def result(self, k: int, seconds: float) -> AttackResult:
        s, mine = self.kept(k), range(k * self.candidates, (k + 1) * self.candidates)
        trace = {"restart_objectives": [self.runs[t]["objective"] for t in mine],
                 "history": [self.runs[t]["history"] for t in mine],
                 "evaluations": self.record[k]["evaluations"], "stalled_at_steps": self.record[k]["stalled"],
                 "seconds": seconds, "batched_with": self.n, "optimizer": "L-BFGS (batched)"}
        if self.candidates > 1:
            trace.update({"kept_start": None if s is None else self.slots[s][1], "rungs": self.rungs,
                          "steps_per_start": [len(self.runs[t]["history"]) for t in mine],
                          "dropped_starts": [self.slots[t][1] for t in mine if self.state[t] == "dropped"]})
        return self.problems[k].result(None if s is None else self.runs[s], self.notes[k], trace)
