"""Where an inversion starts, and which of several starts it keeps.

A start's images: uniform noise (``uniform``), the per-channel mean image the model's normalisation
carries (``mean_image``), noise around a centre image (``around``), or an image a closed form rebuilt
in place of the first ones (``with_closed_form``); label logits from a standard normal (``normal``).
Every draw is made on the CPU from the start's own seeded generator (``generator``, ``mix_seed``), so
that a start is the same on every device. ``BestOfStarts`` keeps, per target, the start with the lowest
final objective, and ``result_from_best`` turns the kept iterate into an ``AttackResult``, with the
variables the forward-model check reads (``check_inputs``).
"""
from __future__ import annotations

import numpy as np
import torch

from ...base import AttackResult


def mix_seed(*parts: int) -> int:
    """A 32-bit seed mixed from integers (a start's generator)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(int(seed))


def uniform(shape: tuple, gen: torch.Generator, device: str | torch.device = "cpu") -> torch.Tensor:
    """Images uniform in [0, 1], drawn on the CPU, then moved to ``device``."""
    return torch.rand(shape, generator=gen).to(device)


def normal(shape: tuple, gen: torch.Generator, device: str | torch.device = "cpu", scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (label logits) times ``scale``, drawn on the CPU, then moved to ``device``."""
    draw = torch.randn(shape, generator=gen)
    return (draw if scale == 1.0 else scale * draw).to(device)


def mean_image(mean: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Images of ``shape`` (B, C, H, W) at the per-channel ``mean`` (C,) (a fresh tensor)."""
    return mean.reshape(1, -1, 1, 1).expand(shape).clone()


def around(centre: torch.Tensor, shape: tuple, std: float, gen: torch.Generator) -> torch.Tensor:
    """``centre`` broadcast to ``shape`` plus Gaussian noise of standard deviation ``std``."""
    return centre.expand(shape) + std * torch.randn(shape, generator=gen)


def with_closed_form(x: torch.Tensor, rebuilt: torch.Tensor) -> torch.Tensor:
    """``x`` with its first images replaced by ``rebuilt`` (a closed form's images), as a copy."""
    x = x.clone()
    x[:len(rebuilt)] = rebuilt
    return x


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


def check_inputs(images: torch.Tensor, probs: torch.Tensor | None,
                 copy_parameters: torch.Tensor | None = None,
                 private: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """What the forward-model check (``attacks.inversion.forward_check``) reads at a kept iterate: every
    dummy image (the reconstructions, then any free augmented copies), the label probability rows,
    the copies' family parameters and the fitted private parameters (None without them)."""
    return {"images": images, "labels": probs, "copy_parameters": copy_parameters, "private": private}


def result_from_best(matcher, best: dict | None, *, shape: tuple, originals: int, num_classes: int,
                     notes: list[str], setup_trace: dict, trace: dict) -> AttackResult:
    """The ``AttackResult`` of a target's kept iterate: the matcher's (``GradientMatcher``)
    reconstructions from its dummy images (``shape``: the originals and the free copies), its labels
    (-1 where the matcher does not use them), and the variables the forward-model check reads (with
    the private parameters fitted, ``GradientMatcher.split_z``, those of the kept z). ``best``
    None (every start diverged at once): a grey image, said in the notes. The trace: ``setup_trace``,
    the kept objective, ``trace``."""
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
    z = best.get("copy_parameters")
    private = matcher.split_z(z)[1] if getattr(matcher, "private_size", 0) and z is not None else None
    return AttackResult(images=rebuilt.clamp(0, 1), labels=labels[:len(rebuilt)],
                        trace={**setup_trace, "objective": best["objective"], **trace}, notes=notes,
                        variables=check_inputs(best["images"], probs, z, private))
