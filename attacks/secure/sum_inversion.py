"""``sum-inversion``: gradient inversion of a round's secure sum, as one batch of every survivor's images.

Why one batch: under FedAvg-family weighting (wᵢ = nᵢ/max_weight) a client that takes one plain SGD
step on its nᵢ images contributes wᵢ·Δθᵢ = −(lr/max_weight)·Σⱼ ∇ℓ(xⱼ), so the sum's weighted-average
update Σ wᵢΔθᵢ / Σ wᵢ = −lr·(1/N)·Σⱼ ∇ℓ(xⱼ) is exactly one SGD step on the union batch of all
N = Σ nᵢ images, at the model the server sent. The server therefore holds the gradient of a batch of
N images (10 one-image clients: a batch of 10), which is what batch gradient inversion attacks; the
literature reports such batches to be far harder than one image, so the expected answer is a result
at the prior (the data set's mean image), reported as measured; the harness's forward-model check
(``truth_objective``: the data term at the true batch) says whether the optimiser stopped short of it.
With several local steps per client the sum is no single batch gradient, and the attack says so.

The attack builds the union as one virtual client (download: the sent model; upload: the weighted
average model; one step of lr on N images) and matches a dummy batch's gradient to it through
``attacks.inversion.forward_model.GradientMatcher`` (scaled-gradient mode), with Inverting Gradients'
objective (Geiping et al. 2020, "Inverting Gradients - How easy is it to break privacy in federated
learning?"): 1 − cosine over all summed weights plus total variation, declared as a ``Recipe`` on the
optimisation template (``attacks.inversion.optimise``: signed Adam, the step schedule, the starts and
best-keeping). The labels are fixed to the round's histogram (``attacks.secure.observation.round_counts``,
as ``sum-labels`` reads it) where the sum gives one, else optimised jointly as label logits.

Result: N images and labels; ``trace`` also holds ``label_counts`` (scored as ``sum-labels``'s) and
``data_term`` (the cosine term at the kept iterate).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..base import AttackResult, Budget, LocalHyperparameters, NotApplicable, Observation
from ..inversion.forward_model import GradientMatcher
from ..inversion.optimise import (IG_ADAM, IG_PRIOR, BestOfStarts, Recipe, generator, mix_seed, normal,
                                  result_from_best, run_adam, uniform)
from ..registry import WEIGHT_KINDS, RoundAttackSpec
from .observation import SAMPLE_COUNT, RoundObservation, round_counts, sample_total, weight_of

RECIPE = Recipe("1 - cos(dummy batch's gradient, the sum's weighted-average update) over all summed weights + TV",
                dataclasses.replace(IG_ADAM, stall_tolerance=1e-3), IG_PRIOR)
MAX_BATCH = 64  # a larger union is one optimisation the attack refuses (its memory grows with the batch)


def union_client(obs: RoundObservation) -> Observation:
    """The round's survivors as one virtual client that took one step on the union of their images: the
    sent model as its download, the weighted-average model (Σ wᵢθᵢ / Σ wᵢ) as its upload."""
    sent, weight, counts = obs.sent(), weight_of(obs.total), obs.sample_counts()
    # N: the sum of the clear sample counts where they travel in the clear, else read from the summed weight
    n = sample_total(obs.total, obs.max_weight) if counts is None else sum(counts.values())
    if sent is None or weight is None or not weight > 0:
        raise NotApplicable(f"{obs.method.name}'s secure sum is not a weighted sum of one model every client was "
                            f"sent: there is no union batch gradient to invert")
    names = [k for k in obs.total if k != SAMPLE_COUNT and k in sent]
    upload = {k: (obs.total[k] / weight).to(device=obs.device, dtype=torch.float32) for k in names}
    upload[SAMPLE_COUNT] = torch.tensor(float(n))
    hp = obs.known_hyperparameters
    known = None if hp is None else LocalHyperparameters(lr=hp.lr, steps=1, batch_size=n, epochs=1, samples=n)
    return Observation(method=obs.method, round=obs.round, client_id=-1, download=sent, upload=upload,
                       previous_upload=None, make_model=obs.make_model, image_shape=obs.image_shape,
                       num_classes=obs.num_classes, known_hyperparameters=known, device=obs.device)


def _labels(obs: RoundObservation, n: int, notes: list[str], trace: dict) -> torch.Tensor | None:
    """The union batch's labels from the round's histogram, sorted by class (None: optimised jointly)."""
    try:
        read = round_counts(obs)
    except NotApplicable as exc:
        notes.append(f"no label histogram ({exc}): the labels are optimised jointly with the images")
        return None
    trace["label_counts"] = read.counts.tolist()
    trace["label_source"] = read.source
    if int(read.counts.sum()) != n:
        return None
    return torch.repeat_interleave(torch.arange(obs.num_classes), read.counts).to(obs.device)


def sum_inversion(observation: RoundObservation, budget: Budget, seed: int) -> AttackResult:
    """Invert the round's sum as one batch of every survivor's images (module docstring)."""
    start_time = time.perf_counter()
    client = union_client(observation)
    n = int(client.upload[SAMPLE_COUNT])
    if n > MAX_BATCH:
        raise NotApplicable(f"the round's sum is made of {n} images, more than the {MAX_BATCH} one inversion takes")
    matcher = GradientMatcher(client, "scaled")
    notes = [f"the sum is inverted as one batch of the {n} images of {len(observation.survivors)} survivors "
             f"(the weighted-average update is one SGD step on their union)"] + list(matcher.notes)
    hp = observation.known_hyperparameters
    if hp is not None and hp.steps != 1:
        notes.append(f"the clients take {hp.steps} local steps: the sum is no single batch gradient, and matching "
                     f"it as one is an approximation")
    trace: dict = {"mode": "union-batch", "attacked_parameters": list(matcher.names), "optimizer": "Adam (signed)",
                   "lr": RECIPE.optimiser.lr, "tv_weight": RECIPE.prior.weight, "batch": n}
    labels = _labels(observation, n, notes, trace)
    shape = (n, *observation.image_shape)
    iterations, restarts = max(1, int(budget.iterations)), max(1, int(budget.restarts))
    starts = BestOfStarts(1)
    for restart in range(restarts):
        variables = _start(matcher, shape, labels, seed, restart)
        run = run_adam(RECIPE.optimiser, variables, lambda: _evaluate(matcher, variables, labels), iterations)
        best = _iterate(matcher, variables, labels)
        starts.offer(0, best["objective"], run.history[0] if run.history else [], best)
    kept = starts.best[0]
    trace.update({"data_term": None if kept is None else kept["data_term"], "restart_objectives": starts.objectives[0],
                  "seconds": time.perf_counter() - start_time})
    result = result_from_best(matcher, kept, shape=shape, originals=n, num_classes=observation.num_classes,
                              notes=notes, setup_trace={}, trace=trace)
    return dataclasses.replace(result, images=result.images.cpu(), labels=result.labels.cpu())


def _start(matcher: GradientMatcher, shape: tuple, labels: torch.Tensor | None, seed: int,
           restart: int) -> list[torch.Tensor]:
    """A seeded start: uniform images (and standard-normal label logits where the labels are not fixed)."""
    gen = generator(mix_seed(seed, restart, 0x5A))
    device = matcher.observation.device
    variables = [uniform(shape, gen).to(device)]
    if labels is None:
        variables.append(normal((shape[0], matcher.observation.num_classes), gen).to(device))
    return [v.requires_grad_(True) for v in variables]


def _probabilities(matcher: GradientMatcher, variables: list[torch.Tensor], labels: torch.Tensor | None):
    if labels is not None:
        return torch.nn.functional.one_hot(labels, matcher.observation.num_classes).to(torch.float32)
    return torch.softmax(variables[1], dim=-1)


def _data_term(matcher: GradientMatcher, variables: list[torch.Tensor], labels: torch.Tensor | None) -> torch.Tensor:
    return matcher.cosine_objective(matcher.dummy(variables[0], _probabilities(matcher, variables, labels)),
                                    matcher.target)


def _evaluate(matcher: GradientMatcher, variables: list[torch.Tensor], labels: torch.Tensor | None):
    """(the objective as a (1,) tensor, its gradient in each variable) for the template's Adam."""
    value = _data_term(matcher, variables, labels) + RECIPE.prior(variables[0])
    return value.detach().reshape(1), list(torch.autograd.grad(value, variables))


def _iterate(matcher: GradientMatcher, variables: list[torch.Tensor], labels: torch.Tensor | None) -> dict:
    """The finished start as ``BestOfStarts`` keeps it."""
    with torch.no_grad():
        probs = _probabilities(matcher, variables, labels).detach()
    data = float(_data_term(matcher, variables, labels).detach())
    images = variables[0].detach().clone()
    return {"objective": data + RECIPE.prior.at(images), "data_term": data, "images": images,
            "labels": labels.clone() if labels is not None else probs.argmax(dim=-1), "probs": probs,
            "copy_parameters": None}


def truth_objective(observation: RoundObservation, images: torch.Tensor, labels: torch.Tensor) -> float:
    """``RoundAttackSpec.truth_objective``: the cosine data term the attack minimises, at the round's true union
    batch (the forward-model check: near 0 when the union-batch model of the sum is right)."""
    matcher = GradientMatcher(union_client(observation), "scaled")
    device = observation.device
    probs = torch.nn.functional.one_hot(labels.to(device), observation.num_classes).to(torch.float32)
    with torch.no_grad():
        return float(matcher.cosine_objective(matcher.dummy(images.to(device, torch.float32), probs), matcher.target))


def summary_lines(summary: dict) -> list[str]:
    """The round histogram the labels were fixed to, under the headline."""
    h = summary.get("histogram") or {}
    if not h.get("rounds"):
        return []
    return [f"  labels fixed to the round's histogram, exact in {h['exact_rounds']} of {h['rounds']} rounds"]


SPEC = RoundAttackSpec("sum-inversion", attack_round=sum_inversion, truth_objective=truth_objective,
                       default_victim_batch=0, applies_to=WEIGHT_KINDS, scoring="images",
                       needs="model weights in the sum", hint="its secure sum holds no model to invert; try sum-labels",
                       estimate_rate=0.02, estimate_per="target", summary_lines=summary_lines)
