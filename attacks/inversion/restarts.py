"""What DLG and IG share around their optimisers: several seeded starts per target, the start with the
lowest final objective kept (``BestOfStarts``), and the kept iterate turned into an ``AttackResult``
(``result_from_best``)."""
from __future__ import annotations

import torch

from ..base import AttackResult
from .forward_model import GradientMatcher


class BestOfStarts:
    """Per target: every start's final objective and history, and the iterate of the start with the
    lowest final objective (``best[k]``: a dict with ``objective``, ``images``, ``labels``, ``probs``
    and ``copy_parameters``; None while no start has produced one)."""

    def __init__(self, targets: int) -> None:
        self.best: list[dict | None] = [None] * targets
        self.objectives: list[list[float]] = [[] for _ in range(targets)]
        self.histories: list[list] = [[] for _ in range(targets)]

    def offer(self, k: int, objective: float, history: list, iterate: dict | None) -> None:
        """Record one finished start of target ``k``; keep its ``iterate`` (None: it produced none) when
        it is the first kept or its objective is strictly lower than the kept one."""
        self.objectives[k].append(objective)
        self.histories[k].append(history)
        kept = self.best[k]
        if iterate is not None and (kept is None or objective < kept["objective"]):
            self.best[k] = iterate


def result_from_best(matcher: GradientMatcher, best: dict | None, *, shape: tuple, originals: int, num_classes: int,
                     notes: list[str], setup_trace: dict, trace: dict) -> AttackResult:
    """The ``AttackResult`` of a target's kept iterate: the matcher's reconstructions from its dummy
    images (``shape``: the originals and the free copies), its labels (-1 where the matcher does not
    use them), and the variables the forward-model check reads. ``best`` None (every start diverged
    at once): a grey image, said in the notes. The trace: ``setup_trace``, the kept objective, ``trace``."""
    if best is None:
        device = matcher.observation.device
        best = {"objective": float("nan"), "images": torch.full(shape, 0.5, device=device),
                "labels": torch.full((originals,), -1, dtype=torch.int64, device=device), "probs": None}
        notes = notes + ["the optimisation failed from every start: the output is a grey image"]
    labels = best["labels"].to(torch.int64)
    probs = best.get("probs")
    if probs is None and bool((labels >= 0).all()):
        probs = torch.nn.functional.one_hot(labels, num_classes).to(torch.float32)
    rebuilt = matcher.reconstructions(best["images"])
    if matcher.labels_unused:  # no label was inferred
        labels = torch.full_like(labels, -1)
    return AttackResult(images=rebuilt.clamp(0, 1), labels=labels[:len(rebuilt)],
                        trace={**setup_trace, "objective": best["objective"], **trace}, notes=notes,
                        variables={"images": best["images"], "labels": probs,
                                   "copy_parameters": best.get("copy_parameters")})
