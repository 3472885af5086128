"""Inverting Gradients (Geiping et al., 2020).

Objective, for a dummy batch x in [0, 1] (pixel space; the model normalises inside):

    L(x) = 1 − cos(ĝ(x), g)  +  α·TV(x)

with ĝ and g the dummy's and the observed gradient-like update over *all attacked layers at once*
(one cosine of the concatenated vectors, the paper's "equal weights"), and TV the anisotropic
total variation, mean |x[i+1, j] − x[i, j]| + mean |x[i, j+1] − x[i, j]| (over batch and
channels). The cosine ignores the update's scale, so the attack works whether or not the learning
rate is known. ``g`` comes from ``attacks.observation.GradientMatcher`` (scaled-gradient or replay
mode, named in the trace).

Optimisation as in the paper: Adam (lr 0.1, in pixel units) on the *sign* of the objective's
gradient, learning rate ×0.1 at 3/8, 5/8 and 7/8 of ``budget.iterations``, pixels projected to
[0, 1] after every step, ``budget.restarts`` starts from uniform noise, the start with the lowest
final objective kept.

TV weight α = ``TV_WEIGHT`` = 0.01. Published configurations of the authors' code range from 1e-6
to 1e-1 (on normalised images) and the weight is data-dependent. Because the cosine is almost
blind to the image's contrast (the models are nearly positively homogeneous), a strong TV prior
lowers the contrast of the result: at 0.1 the digits come out recognisable but grey, ≈21 dB. The
weight was chosen among {0.1, 0.01, 0.001} on a *tuning* federation (mnist5k, seed 1, 4 clients,
round 0, one image, one step, 1000 iterations: 21.8 / 33.9 / 30.1 dB) and is reported on seed 0
(BENCHMARKS.md, with the whole sweep).

Labels: for one image with a classifier update, iDLG's rule (``attacks.dlg.idlg_labels``);
otherwise label logits are optimised jointly with the images (same optimiser), as in the authors'
code for batches.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .base import AttackResult, Budget, Observation
from .dlg import _seed, idlg_labels
from .observation import GradientMatcher, flat

LR = 0.1
TV_WEIGHT = 0.01


def total_variation(x: torch.Tensor) -> torch.Tensor:
    return (x[..., :, 1:] - x[..., :, :-1]).abs().mean() + (x[..., 1:, :] - x[..., :-1, :]).abs().mean()


def cosine_objective(dummy: list[torch.Tensor], target_flat: torch.Tensor) -> torch.Tensor:
    return 1.0 - F.cosine_similarity(flat(dummy), target_flat, dim=0, eps=1e-20)


def milestones(iterations: int) -> list[int]:
    return sorted({max(1, int(iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})


def inverting_gradients(observation: Observation, budget: Budget, seed: int, mode: str = "auto",
                        tv_weight: float = TV_WEIGHT, lr: float = LR) -> AttackResult:
    start_time = time.perf_counter()
    matcher = GradientMatcher(observation, mode)
    target = flat([t.detach() for t in matcher.target])
    notes = list(matcher.notes)
    b = max(1, int(budget.batch))
    c, h, w = observation.image_shape
    k = observation.num_classes
    trace: dict = {"mode": matcher.mode, "attacked_parameters": list(matcher.names), "optimizer": "Adam (signed)",
                   "lr": lr, "tv_weight": tv_weight}

    labels = None
    weight = matcher.classifier_weight_target()
    if b == 1 and weight is not None:
        labels, _ = idlg_labels(weight, 1)
        trace["label_source"] = "idlg-rule"
    else:
        trace["label_source"] = "joint (label logits optimised with the images)"
        if weight is None:
            notes.append("no classifier update is available (private or excluded head): the label is optimised "
                         "jointly with the image")

    best = {"objective": float("inf")}
    restart_objectives, histories = [], []
    iterations = max(1, int(budget.iterations))
    for restart in range(max(1, int(budget.restarts))):
        gen = torch.Generator().manual_seed(_seed(seed, restart, 0x16))
        x = torch.rand((b, c, h, w), generator=gen).requires_grad_(True)
        variables = [x]
        y_logits = None
        if labels is None:
            y_logits = torch.randn((b, k), generator=gen).requires_grad_(True)
            variables.append(y_logits)
        opt = torch.optim.Adam(variables, lr=lr)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones(iterations), gamma=0.1)

        def objective():
            y = labels if labels is not None else torch.softmax(y_logits, dim=-1)
            return cosine_objective(matcher.dummy(x, y), target) + tv_weight * total_variation(x)

        history = []
        for it in range(iterations):
            opt.zero_grad()
            loss = objective()
            if not torch.isfinite(loss):
                notes.append(f"restart {restart}: the objective became non-finite at step {it}; stopped there")
                break
            loss.backward()
            for v in variables:
                v.grad.sign_()
            opt.step()
            sched.step()
            with torch.no_grad():
                x.clamp_(0.0, 1.0)
            if it % max(1, iterations // 50) == 0:
                history.append(float(loss.detach()))
        final = float(objective().detach())
        restart_objectives.append(final)
        histories.append(history)
        if final < best["objective"] or "images" not in best:
            best = {"objective": final, "images": x.detach().clone(),
                    "labels": labels.clone() if labels is not None else y_logits.detach().argmax(dim=-1)}
    trace.update({"objective": best["objective"], "restart_objectives": restart_objectives, "history": histories,
                  "seconds": time.perf_counter() - start_time})
    return AttackResult(images=best["images"].clamp(0, 1), labels=best["labels"].to(torch.int64), trace=trace,
                        notes=notes)
