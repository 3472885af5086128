"""Data leakage in federated averaging (Dimitrov, Balunović, Konstantinov and Vechev, TMLR 2022):
rebuild every image a client trained on from an update of several local steps and epochs.

The attack simulates the client's local training (known learning rate, batch size, epochs and
sample count: the "hyperparameters known" threat model) differentiably, from the before-state the
server knows, on dummy images, and matches the simulated update to the observed one:

* **the forward model** is the method's own (``attacks.inversion.forward_model.GradientMatcher``): plain
  cross-entropy SGD for FedAvg (``replay``), ``Replay.replay`` for FedPer, FedRep, FedPAC and
  FedeCouple (``method``: phases, frozen parts, uploaded statistics, free augmented copies);
* **the unknown batch order**: the client reshuffles every epoch, so each epoch gets its own copy of
  the image set (``attacks.inversion.forward_model.plan_layout``: slot = place in that epoch's shuffle). The
  copies are tied by an **epoch-order-invariant term** (``epoch_order_term``): each later copy is
  matched one to one to the first (``scipy.optimize.linear_sum_assignment``), and the term is the
  mean squared distance of the matched images to their mean — zero exactly when every copy holds
  the same images in any order. The reconstructions are the aligned copies' means;
* **labels first**: the per-class label counts of one epoch are fixed before the images
  (``label_counts``): from an uploaded ``class_counts`` field, or, for plain SGD on a downloaded
  classifier with a bias, from the bias update summed over the T steps,
  Δb = −(lr/B)·Σ_steps Σ_batch (p_i − y_i), with the model's mean prediction at every step estimated
  at the weights interpolated between the download and the upload, ω_t = ω_0 + (t/T)·Δ (the paper's
  estimate of the unobserved intermediate models), at the public pixel-mean image. Which slot holds
  which label is not known: each epoch's soft labels are kept at exactly those counts by Sinkhorn
  scaling of free logits (rows sum to one, columns to the counts) and rounded at the end by a one to
  one assignment that keeps the counts exact;
* **the objective**: 1 − cos(simulated Δ, observed Δ) over all attacked weights (plus the method's
  uploaded statistics, as in IG's method mode) + ``TV_WEIGHT``·TV + ``ORDER_WEIGHT``·order term,
  minimised by the template's Adam on the sign of the gradient (``attacks.inversion.optimise``, as IG),
  learning rate ×0.1 at 3/8, 5/8 and 7/8 of the budget; from the first drop on, a start whose objective
  improved by less than ``STALL_TOLERANCE`` over a window (it stopped moving) takes its next drop early,
  and in the last phase stops (``STALL_AFTER_DROPS``); further starts
  are skipped once the data term is below ``SOLVED_DATA_TERM`` (``RECIPE`` declares the optimiser, the
  prior and the budget).

* **the layer inputs first** (``attacks.inversion.disaggregation``): for plain SGD with each image used
  once, every slot's label and input at the extractor's last linear layer (at its step's weights) are
  solved from the update where the fit is exact; then the labels are fixed, the first start is rebuilt
  from those inputs, the inputs are matched (``INPUT_WEIGHT``; zero at the truth), and IG's final stage
  polishes the kept start.

Every image of the client's epoch (the ``(n // B)·B`` it trains on; a ragged last batch is dropped
by the client too) is rebuilt and scored one to one against the client's images (``scoring
"images"``). Not from the paper's code: written from its description.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch.func import functional_call

from fedecouple.methods.facets import trains_plain_sgd
from fedecouple.methods.replay import differentiated_outside

from ..base import AttackResult, Budget, NotApplicable, Observation
from .batching import Batch, build_each
from .closed_form import round_to_total
from .disaggregation import LayerInputs, disaggregate, input_term, replayed, start_images
from .forward_check import OBJECTIVE_FLOOR
from .closed_form_terms import START_ITERATIONS
from .forward_model import GradientMatcher, combine_epoch_copies
from .optimise import (ITERATION_SHARE, TEMPERATURES, BestOfStarts, Recipe, SignedAdam, TotalVariation,
                       check_inputs, generator, normal, polish, run_adam, uniform)
from ..registry import GRADIENT_HINT, WEIGHT_KINDS, ClientAttackSpec

STALL_TOLERANCE = 1e-3
# the stop rule watches from the first learning-rate drop on: on the small-client command of
# bench/results.py (cell leak-small-clients, seed 0, 4 targets) that took 298 s at 22.99 dB where
# watching the last phase only took 377 s at 23.01 dB (the two runs side by side on 2 cores)
STALL_AFTER_DROPS = 1
# the TV weight was chosen among {0.01, 0.03, 0.1} on a tuning federation (seed 1, weak, 6 training images
# per client, batch 2, one epoch, clients 0 and 1, 1000 iterations: mean 11.1 / 14.6 / 14.1 dB, data term
# lowest at 0.03); reported on seed 0 (docs/real-training.md)
RECIPE = Recipe("1 - cos(simulated update, observed update) + input term + TV + order term",
                SignedAdam(lr=0.1, stall_tolerance=STALL_TOLERANCE, stall_after_drops=STALL_AFTER_DROPS),
                TotalVariation(0.03, "mean"))
LR = RECIPE.optimiser.lr
TV_WEIGHT = RECIPE.prior.weight
ORDER_WEIGHT = 1.0  # set, not tuned: it is zero at the truth, whatever its weight
SINKHORN_ITERATIONS = 30
SOLVED_DATA_TERM = 1e-3
ABSENT = -1e4  # logit of a class the counts exclude (exp underflows to 0 without NaN)
# with the layer inputs solved (``attacks.inversion.disaggregation``): the weight of their term. Chosen with
# the first start's learning rate on a tuning federation (seed 1, weak, --train-images 4, batches of 2, one
# epoch, 4 clients, 16 images): (weight, lr) (0, 0.01) 20.28,
# (0.1, 0.01) 22.74, (1, 0.01) 22.70, (1, 0.03) 23.45, (1, 0.1) 24.06, (3, 0.1) 23.09 dB: the start from the
# solved inputs takes LR like every other start
INPUT_WEIGHT = 1.0


def epoch_order_term(images: torch.Tensor, copies: int) -> torch.Tensor:
    """Mean squared distance of each epoch copy's images to the mean of the copies, after matching every
    later copy one to one to the first (the matching is not differentiated): zero exactly when the copies
    hold the same images in any order. ``images``: (copies · m, C, H, W)."""
    if copies <= 1:
        return images.new_zeros(())
    sets = images.reshape(copies, -1, *images.shape[1:])
    reference = sets[0].detach().flatten(1).double()
    aligned = [sets[0]]
    for later in sets[1:]:
        cost = torch.cdist(reference, later.detach().flatten(1).double()).pow(2).cpu().numpy()
        rows, cols = linear_sum_assignment(cost)
        aligned.append(later[torch.from_numpy(cols[np.argsort(rows)]).to(images.device)])
    stacked = torch.stack(aligned)
    return (stacked - stacked.mean(0, keepdim=True)).pow(2).mean()


def sinkhorn_labels(logits: torch.Tensor, counts: torch.Tensor, copies: int,
                    iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """(copies · m, C) label probability rows from free logits, scaled (in log space) so that in every
    epoch copy each row sums to 1 and each class column to its count."""
    m = logits.shape[0] // copies
    log_counts = torch.log(counts.to(logits.dtype).clamp_min(1e-30))
    masked = torch.where(counts > 0, logits, torch.full_like(logits, ABSENT)).reshape(copies, m, -1)
    for _ in range(iterations):
        masked = masked - torch.logsumexp(masked, dim=2, keepdim=True)
        masked = masked - torch.logsumexp(masked, dim=1, keepdim=True) + log_counts
    masked = masked - torch.logsumexp(masked, dim=2, keepdim=True)
    return masked.exp().reshape(copies * m, -1)


def hard_labels(probs: torch.Tensor, counts: torch.Tensor | None, copies: int) -> torch.Tensor:
    """Class ids per slot: with counts, the most probable assignment that holds them exactly in every
    epoch copy (``linear_sum_assignment`` on −log p with each class repeated count times); else argmax."""
    if counts is None:
        return probs.argmax(dim=-1)
    classes = torch.repeat_interleave(torch.arange(len(counts)), counts.cpu())
    out = []
    for block in probs.detach().cpu().reshape(copies, -1, probs.shape[-1]):
        cost = -torch.log(block.double().clamp_min(1e-30))[:, classes].numpy()
        rows, cols = linear_sum_assignment(cost)
        labels = torch.empty(len(block), dtype=torch.int64)
        labels[torch.from_numpy(rows)] = classes[torch.from_numpy(cols)]
        out.append(labels)
    return torch.cat(out)


def label_counts(matcher: GradientMatcher) -> tuple[torch.Tensor | None, str]:
    """(per-class counts of the images one epoch trains on, how) or (None, why not); see the module
    docstring."""
    obs, hp, update = matcher.observation, matcher.hyperparameters, matcher.update
    m = matcher.reconstructed
    uploaded = obs.upload.get("class_counts")
    if uploaded is not None and uploaded.numel() == obs.num_classes:
        return round_to_total(uploaded.double(), m), "uploaded class counts"
    if (not trains_plain_sgd(obs.method) or "classifier.bias" not in update.names
            or "classifier.bias" not in obs.download):
        return None, "no plain SGD on a downloaded classifier with a bias"
    model = matcher.model
    if any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in model.modules()):
        return None, "a BatchNorm model has no prediction for one image on its own (batch statistics)"
    steps, bs = int(hp.steps), min(int(hp.batch_size), m)
    before = update.before
    mean_image = model.normalize.mean.reshape(1, -1, 1, 1).expand(1, *obs.image_shape).to(torch.float32)
    predicted = torch.zeros(obs.num_classes, dtype=torch.float64, device=mean_image.device)
    with torch.no_grad():
        for t in range(steps):  # the unobserved model of step t, interpolated between download and upload
            params = {n: v + (t / steps) * update.delta[n] if n in update.delta else v for n, v in before.items()}
            predicted += torch.softmax(functional_call(model, params, (mean_image,)), dim=-1)[0].double()
    total = bs * predicted + (bs / hp.lr) * update.delta["classifier.bias"].double()
    return round_to_total(total / matcher.epoch_copies, m), "classifier bias update over the steps, " \
        "mean prediction at the interpolated models"


@dataclass
class _Setup:
    matcher: GradientMatcher
    target: list[torch.Tensor]
    counts: torch.Tensor | None
    trace: dict
    notes: list[str] = field(default_factory=list)
    layer: LayerInputs | None = None  # each slot's label and input at the last linear layer, solved first

    @property
    def slots(self) -> int:
        return self.matcher.originals


def _setup(observation: Observation, mode: str = "auto") -> _Setup:
    hp = observation.known_hyperparameters
    if hp is None:
        raise NotApplicable("the FedAvg leakage attack simulates the client's local training: it needs the "
                            "'hyperparameters known' threat model (lr, batch size, epochs, sample count)")
    if hp.steps_per_phase is not None or observation.known_schedule is not None:
        matcher = GradientMatcher(observation, mode)
    else:
        plain = mode == "auto" and trains_plain_sgd(observation.method)
        matcher = GradientMatcher(observation, "replay" if plain else mode)
    if matcher.originals is None:  # a plain layout without a sample count: the slots are the batch
        matcher.originals = matcher.reconstructed = int(hp.samples or hp.batch_size)
    if matcher.reconstructed is None:
        matcher.reconstructed = matcher.originals
    if matcher.copy_parameters:
        raise NotApplicable("the FedAvg leakage attack models augmented copies as free images: use --augmentations "
                            "free (or oracle)")
    closed = matcher.closed.label_counts
    counts, how = ((closed, matcher.closed.trace["label_counts_source"]) if closed is not None
                   and matcher.epoch_copies == 1 and int(closed.sum()) == matcher.originals else label_counts(matcher))
    if counts is not None and int(counts.sum()) != matcher.originals // matcher.epoch_copies:
        counts, how = None, f"counts of {int(counts.sum())} images for {matcher.originals} slots"
    trace = {"mode": matcher.mode, "attacked_parameters": list(matcher.names), "optimizer": "Adam (signed)",
             "epoch_copies": matcher.epoch_copies, "slots": matcher.originals,
             "closed_form": {**matcher.closed.trace, "label_counts": None if counts is None else counts.tolist(),
                             "label_counts_source": how},
             "label_source": (f"counts fixed first ({how}); slots by Sinkhorn-scaled logits" if counts is not None
                              else f"joint (label logits optimised with the images; no counts: {how})")}
    layer, layer_trace = disaggregate(matcher, counts)
    trace["closed_form"]["layer_inputs"] = layer_trace
    notes = list(matcher.notes)
    if layer is not None:
        trace["label_source"] = f"counts fixed first ({how}); slots by the layer-input solve"
        notes.append(f"closed form: every slot's label and input at {layer_trace['layer']} solved from the update "
                     f"({layer_trace['splits']} label splits into the steps tried, relative residual "
                     f"{layer.residual:.1e}): the first start is rebuilt from them and they are matched "
                     f"(weight {INPUT_WEIGHT:g})")
    elif layer_trace.get("applied"):
        notes.append(f"closed form: the layer inputs were not solved ({layer_trace['why']}): the attack runs "
                     f"without them")
    if matcher.epoch_copies > 1:
        notes.append(f"the {matcher.epoch_copies} epoch copies are tied by the epoch-order-invariant term "
                     f"(weight {ORDER_WEIGHT:g})")
    return _Setup(matcher, [t.detach() for t in matcher.target], counts, trace, notes, layer)


def _labels(setup: _Setup, logits: torch.Tensor) -> torch.Tensor:
    if setup.layer is not None:
        return F.one_hot(setup.layer.labels, logits.shape[-1]).to(logits.dtype)
    if setup.counts is None:
        return torch.softmax(logits, dim=-1)
    return sinkhorn_labels(logits, setup.counts.to(logits.device), setup.matcher.epoch_copies)


def _terms(setup: _Setup, x: torch.Tensor, logits: torch.Tensor, tv_weight: float,
           order_weight: float, private: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, data term) at images ``x`` (slots, then free copies), label logits and the fitted
    private parameters (``GradientMatcher.fitted_before``)."""
    matcher = setup.matcher
    if setup.layer is None:
        data = matcher.cosine_objective(matcher.dummy(x, _labels(setup, logits), private=private), setup.target)
        extra = 0.0
    else:  # the plain replay (no other closed-form term: ``disaggregation.applies``), read at every step
        dummy, states = replayed(matcher, x, _labels(setup, logits))
        data = matcher.cosine_objective(dummy, setup.target)
        extra = INPUT_WEIGHT * input_term(matcher, setup.layer, states, x)
    slots = x[:setup.slots]
    prior = TotalVariation(tv_weight, RECIPE.prior.kind)
    total = data + extra + prior(x) + order_weight * epoch_order_term(slots, matcher.epoch_copies)
    return total, data


def _start(setup: _Setup, budget: Budget, seed: int, restart: int, tv_weight: float, order_weight: float) -> dict:
    """One start from seeded uniform noise (the first from the solved layer inputs' images, where they
    were solved) by the template's signed Adam (see the module docstring for the schedule and the stop)."""
    matcher, iterations = setup.matcher, max(1, int(budget.iterations))
    gen = generator(seed * 1009 + restart)
    shape = (setup.slots + matcher.free_copies, *matcher.observation.image_shape)
    device = matcher.observation.device
    x = uniform(shape, gen, device)
    if restart == 0 and setup.layer is not None:  # the first start: the images rebuilt from the solved inputs
        x = start_images(matcher, setup.layer, START_ITERATIONS).to(device)
    x.requires_grad_(True)
    logits = normal((setup.slots, matcher.observation.num_classes), gen, device, scale=0.01)
    logits.requires_grad_(True)
    private = matcher.private_start().requires_grad_(True)  # the unknown private head, from its stand-in
    variables = [x, logits] + ([private] if matcher.private_size else [])

    def evaluate() -> tuple[torch.Tensor, list]:
        with differentiated_outside():  # the replay's gradients in plain autograd, as the outer one
            total, _ = _terms(setup, x, logits, tv_weight, order_weight, private)
            gradients = torch.autograd.grad(total, variables, allow_unused=True)
        return torch.tensor([float(total.detach())], dtype=torch.float64), list(gradients)

    def nonfinite(_: int, it: int) -> None:
        setup.notes.append(f"start {restart}: the objective became non-finite at step {it}; stopped there")

    run = run_adam(RECIPE.optimiser, variables, evaluate, iterations, on_nonfinite=nonfinite)
    with torch.no_grad():
        total, data = _terms(setup, x, logits, tv_weight, order_weight, private)
    return {"objective": float(total), "data_term": float(data), "images": x.detach(),
            "probs": _labels(setup, logits).detach(), "steps": run.steps, "history": run.history[0],
            "private": private.detach()}


def leak_fedavg(observation: Observation, budget: Budget, seed: int, mode: str = "auto",
                tv_weight: float = TV_WEIGHT, order_weight: float = ORDER_WEIGHT) -> AttackResult:
    """The attack on one target (see the module docstring)."""
    return _attack(_setup(observation, mode), budget, seed, tv_weight, order_weight)


def _attack(setup: _Setup, budget: Budget, seed: int, tv_weight: float = TV_WEIGHT,
            order_weight: float = ORDER_WEIGHT) -> AttackResult:
    started = time.perf_counter()
    if int(budget.batch) > 1 and int(budget.batch) != setup.matcher.reconstructed:
        setup.notes.append(f"--images {budget.batch} does not apply: fedavg-leak rebuilds every image the client "
                           f"trained on ({setup.matcher.reconstructed})")
    starts, kept = [], BestOfStarts(1)
    for restart in range(max(1, int(budget.restarts))):
        starts.append(_start(setup, budget, seed, restart, tv_weight, order_weight))
        kept.offer(0, starts[-1]["objective"], starts[-1]["history"], starts[-1])
        if starts[-1]["data_term"] <= SOLVED_DATA_TERM:
            break
    best = kept.best[0]
    final = (_final_stage(setup, best, int(budget.iterations) // ITERATION_SHARE, tv_weight, order_weight)
             if setup.layer is not None else None)
    matcher = setup.matcher
    copies = matcher.epoch_copies
    labels = hard_labels(best["probs"], setup.counts, copies)
    if matcher.labels_unused:  # a head-free closed form: the labels never entered the objective
        labels = torch.full_like(labels, -1)
    slots = best["images"][:setup.slots]
    rebuilt = combine_epoch_copies(slots.cpu(), copies).clamp(0, 1)
    trace = {**setup.trace, "objective": best["objective"], "data_term": best["data_term"],
             "restart_objectives": [s["objective"] for s in starts], "steps_per_start": [s["steps"] for s in starts],
             "history": [s["history"] for s in starts], "final_stage": final, "seconds": time.perf_counter() - started}
    return AttackResult(images=rebuilt, labels=_aligned_labels(slots.cpu(), labels, copies), trace=trace,
                        notes=setup.notes, variables=check_inputs(best["images"], best["probs"],
                                                                  private=best["private"]))


def _final_stage(setup: _Setup, best: dict, iterations: int, tv_weight: float, order_weight: float) -> dict | None:
    """IG's final stage (the template's ``polish``) on the kept start, where the layer inputs are
    solved: the data term and the input term (both zero at the truth, no TV), by bounded L-BFGS over a
    continuation of the model's kinks; the images change only where the data term fell."""
    if iterations < 1 or best["data_term"] <= OBJECTIVE_FLOOR:
        return None
    matcher, labels = setup.matcher, best["probs"]

    def evaluate(stacked: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.enable_grad(), differentiated_outside():
            x = stacked[0].detach().requires_grad_(True)
            dummy, states = replayed(matcher, x, labels)
            value = matcher.cosine_objective(dummy, setup.target) + INPUT_WEIGHT * input_term(matcher, setup.layer,
                                                                                              states, x)
            gradient, = torch.autograd.grad(value, x)
        return value.detach().reshape(1), gradient.unsqueeze(0)

    stage = polish(evaluate, matcher.model, best["images"].unsqueeze(0), iterations, floor=OBJECTIVE_FLOOR)
    images = stage.images[0].detach().clone()
    with torch.no_grad():  # the labels are the solve's: the logits only give their shape
        total, data = _terms(setup, images, torch.zeros_like(labels), tv_weight, order_weight)
    if float(data) < best["data_term"]:
        best.update(images=images, data_term=float(data), objective=float(total))
    return {"temperatures": list(TEMPERATURES), "iterations_per_temperature": iterations,
            "evaluations": stage.evaluations, "objective_before": float(stage.before[0]),
            "objective_after": float(stage.after[0]), "data_term_after": data}


def _aligned_labels(slots: torch.Tensor, labels: torch.Tensor, copies: int) -> torch.Tensor:
    """The first epoch copy's labels: ``combine_epoch_copies`` aligns every later copy to the first."""
    return labels[:len(slots) // copies] if copies > 1 else labels


def _attack_alone(setup, budget: Budget, seeds: list[int]) -> list:
    if isinstance(setup, NotApplicable):
        return [setup]
    return [_attack(setup, budget, seeds[0])]


def plan(observations: Sequence[Observation], budget: Budget, mode: str = "auto",
         batched: bool = True) -> tuple[list[Batch], dict]:
    """One ``Batch`` per target (each its own optimisation; ``batched`` does not apply)."""
    setups = build_each(functools.partial(_setup, mode=mode), observations)
    failed = {i: s for i, s in enumerate(setups) if isinstance(s, NotApplicable)}
    return [Batch([i], functools.partial(_attack_alone, s, budget)) for i, s in enumerate(setups)
            if i not in failed], failed


SPEC = ClientAttackSpec("fedavg-leak", attack_one=leak_fedavg, plan=plan, default_victim_batch=0,
                        applies_to=WEIGHT_KINDS, scoring="images", needs="model weights", hint=GRADIENT_HINT,
                        matching="cosine")
