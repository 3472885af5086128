"""The inputs of the extractor's last linear layer for every image of a batch or of several plain SGD
steps, solved from the upload before any image is optimised (a closed-form stage of ``fedavg-leak``).

Why it works (the low-rank structure SPEAR, Dimitrov et al. 2024, and the Cocktail Party Attack,
Kariyappa et al. 2023, start from): the layer z = W a + b takes one gradient term δ_i a_iᵀ per image
and step, so over one epoch of plain SGD (each image used once) its weight update
ΔW = −lr Σ_steps (1/B) Σ_i δ_i a_iᵀ has rank at most the number of images m, and every a_i — the
image's input at the layer *at the step it was used* — lies in the span of ΔW's leading m right
singular vectors V. With a_i = V c_i the unknowns are m × m numbers, and given them the rest of the
model above the layer (the activation, the classifier) is known at the download and moves only by its
own SGD steps on those inputs: the top part's local training is simulated exactly on the candidate
inputs and must reproduce the observed update of the layer's weight and bias and of the classifier.
Which labels went to which step is not known: every split of the label counts (fixed first,
``fedavg_leakage.label_counts``) into the steps is tried, up to ``MAX_SPLITS``, each by L-BFGS in
float64 from starts around the pixel-mean image's input (``STARTS_BUDGET`` shared out, at least
``STARTS`` per split; the first exact fit ends the search); the split whose fit is best wins, and is
taken as solved when its relative residual is below ``SOLVED_RESIDUAL`` (at the truth it is float
rounding). One step on a batch is the one-split case (SPEAR's setting). Where the fit is not exact
(measured: clients of 6 images in 3 steps, and 10 images in one step) nothing of it is
used: the attack runs as without it.

The attack then knows each slot's label and its input at the layer at its time of use: the images'
first start inverts those inputs through the layers below (``attacks.inversion.layer_inputs``; at a later step
through the weights interpolated between download and upload, the server's estimate of the
unobserved intermediate model), and the images' objective gains the relative error of the dummy's
inputs, taken inside the replay at each step's own weights (zero at the truth).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedecouple.methods.facets import trains_plain_sgd

from .layer_inputs import invert_layer_inputs

from .closed_form import _names_below, inverse_activation, last_linear_layer
from .optimise import LBFGS, run_lbfgs

SOLVED_RESIDUAL = 1e-6  # Σ of the relative squared errors of the four simulated updates
MAX_SPLITS = 100  # label splits into steps tried at most (6 images in 3 steps of 2: at most 90)
STARTS = 2  # per split at least (a 4-image client of 2 steps: solved from the first)
STARTS_BUDGET = 48  # starts over all splits: one split (one step on a batch) takes up to this many
SCREEN_ITERATIONS = 60  # L-BFGS iterations of a split's screening start; the best splits then run to FINISH
FINISH_ITERATIONS = 400
FINISHED_SPLITS = 4
INVERSION_STARTS = 8  # starts of the images' inversion from the solved inputs (``start_images``)
# the fit of a split: L-BFGS with a strong-Wolfe line search in float64, its tolerances near float64's
# rounding (an exact fit is the point), its inner iterations the screening's or the finish's
FIT = LBFGS(lr=1, history_size=50, line_search="strong_wolfe", tolerance_grad=1e-15, tolerance_change=1e-18)


@dataclass
class LayerInputs:
    """Per slot (the attack's dummy image, in replay order): its class and its input at the extractor's
    last linear layer at the step it was used."""

    position: int  # the layer's index among the extractor's children
    below: list[str]  # the extractor's parameter names that feed the layer
    inputs: torch.Tensor  # (slots, in_features)
    labels: torch.Tensor  # (slots,) class ids
    residual: float


def label_splits(counts: torch.Tensor, steps: int, batch: int, limit: int = MAX_SPLITS) -> list[list[int]] | None:
    """Every distinct assignment of the labels (``counts`` per class, ``steps × batch`` in all) to the
    steps, as slot label lists (step t's labels at slots t·batch ...), ordered within a step; None if
    there are more than ``limit``."""
    out: list[list[int]] = []

    def walk(remaining: list[int], done: list[int]) -> bool:
        if len(done) == steps * batch:
            out.append(list(done))
            return len(out) <= limit
        for chosen in _multisets(remaining, batch):
            left = list(remaining)
            for c in chosen:
                left[c] -= 1
            if not walk(left, done + list(chosen)):
                return False
        return True

    return out if walk([int(k) for k in counts.tolist()], []) else None


def _multisets(remaining: list[int], size: int, first: int = 0):
    """The distinct sorted tuples of ``size`` class ids with at most ``remaining[c]`` of class c, in
    lexicographic order, generated one at a time (listing the combinations of the pool first takes
    C(100, 10) steps for 100 images in batches of 10)."""
    if size == 0:
        yield ()
        return
    if first >= len(remaining) or sum(remaining[first:]) < size:
        return
    for k in range(min(remaining[first], size), -1, -1):  # more of the smallest class first: lexicographic
        for rest in _multisets(remaining, size - k, first + 1):
            yield (first,) * k + rest


class _Top:
    """The model above the layer's input: z = W a + b, the activation, the classifier; its SGD steps on
    candidate inputs, in float64."""

    def __init__(self, matcher, position: int, child: str):
        model, before, delta = matcher.model, matcher.update.before, matcher.update.delta
        self.names = [f"extractor.{child}.weight", f"extractor.{child}.bias", "classifier.weight", "classifier.bias"]
        self.start = [before[n].double() for n in self.names]
        self.observed = [delta[n].double() for n in self.names]
        children = list(model.extractor.children())
        self.activation = children[position + 1] if position + 1 < len(children) else nn.Identity()
        hp = matcher.hyperparameters
        self.lr, self.steps = float(hp.lr), int(hp.steps)
        self.temperature = 0.0  # > 0: the activation's kink smoothed (softplus of that width)

    def activate(self, z: torch.Tensor) -> torch.Tensor:
        act = self.activation
        if self.temperature <= 0 or not isinstance(act, (nn.LeakyReLU, nn.ReLU)):
            return act(z)
        slope = float(act.negative_slope) if isinstance(act, nn.LeakyReLU) else 0.0
        return slope * z + (1 - slope) * self.temperature * F.softplus(z / self.temperature)

    def update(self, inputs: torch.Tensor, onehot: torch.Tensor) -> list[torch.Tensor]:
        w1, b1, w2, b2 = self.start
        bs = inputs.shape[0] // self.steps
        for t in range(self.steps):
            a, y = inputs[t * bs:(t + 1) * bs], onehot[t * bs:(t + 1) * bs]
            z = a @ w1.T + b1
            h = self.activate(z)
            g = (torch.softmax(h @ w2.T + b2, dim=1) - y) / bs
            dz = torch.autograd.grad(h, z, g @ w2, create_graph=True)[0] if z.requires_grad else None
            if dz is None:
                raise RuntimeError("the top part's inputs must require grad")
            w1, b1, w2, b2 = (w1 - self.lr * dz.T @ a, b1 - self.lr * dz.sum(0),
                              w2 - self.lr * g.T @ h, b2 - self.lr * g.sum(0))
        return [w1 - self.start[0], b1 - self.start[1], w2 - self.start[2], b2 - self.start[3]]

    def residual(self, inputs: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        simulated = self.update(inputs, onehot)
        return sum(((s - o).pow(2).sum() / o.pow(2).sum().clamp_min(1e-300))
                   for s, o in zip(simulated, self.observed))


def _fit(top: _Top, basis: torch.Tensor, onehot: torch.Tensor, start: torch.Tensor, iterations: int):
    coefficients = start.clone().requires_grad_(True)
    # a non-finite step raises RuntimeError: the run ends there, keeping its value
    run_lbfgs(FIT, [coefficients], lambda: top.residual(coefficients @ basis.T, onehot), max_iter=iterations,
              errors=(RuntimeError,))
    with torch.enable_grad():
        value = float(top.residual((coefficients @ basis.T).detach().requires_grad_(True), onehot).detach())
    return (value if value == value else float("inf")), coefficients.detach()


def applies(matcher) -> str | None:
    """None when the stage applies to this attack's layout, else why not."""
    hp = matcher.hyperparameters
    if hp is None or not trains_plain_sgd(matcher.observation.method) or not (
            matcher.mode == "replay" or (matcher.mode == "scaled-gradient" and int(hp.steps) == 1)):
        return "needs plain SGD with known hyperparameters (the replay, or one step's gradient)"
    if matcher.extra_weights:
        return "another closed form already fixes this layer"
    found = last_linear_layer(matcher.model)
    if found is None:
        return "the extractor does not end in a linear layer"
    position, child = found
    children = list(matcher.model.extractor.children())
    if inverse_activation(children[position + 1] if position + 1 < len(children) else None, torch.zeros(1)) is None:
        return "the layer's activation is not the identity, a ReLU or a LeakyReLU"
    names = [f"extractor.{child}.weight", f"extractor.{child}.bias", "classifier.weight", "classifier.bias"]
    if any(n not in matcher.update.names for n in names):
        return "the layer's or the classifier's update is not in the upload"
    slots, bs = int(matcher.originals or 0), int(hp.batch_size)
    if slots == 0 or int(hp.steps) * min(bs, slots) != slots:
        return "each image is not used exactly once"
    rows, cols = matcher.update.delta[names[0]].shape
    if slots >= min(rows, cols):
        return f"{slots} images: the layer's update ({rows}×{cols}) cannot hold as many inputs"
    return None


def disaggregate(matcher, counts: torch.Tensor | None) -> tuple[LayerInputs | None, dict]:
    """(the slots' labels and layer inputs, trace) or (None, trace with why not); see the module docstring."""
    why = applies(matcher) or (None if counts is not None else "no label counts")
    if why is not None:
        return None, {"applied": False, "why": why}
    hp = matcher.hyperparameters
    position, child = last_linear_layer(matcher.model)
    top = _Top(matcher, position, child)
    slots, steps = int(matcher.originals), int(hp.steps)
    bs = slots // steps
    every = counts.cpu() * int(matcher.epoch_copies)  # the counts are one epoch's; each epoch is its own slots
    if int(every.sum()) != slots:
        return None, {"applied": False, "why": f"label counts of {int(every.sum())} images for {slots} slots"}
    splits = label_splits(every, steps, bs)
    if not splits:
        return None, {"applied": False, "why": f"more than {MAX_SPLITS} ways to split the labels into the steps"}
    basis = torch.linalg.svd(top.observed[0], full_matrices=False)[2][:slots].T  # (in_features, slots)
    below = _names_below(matcher.model, matcher.update, position)
    mean_image = matcher.model.normalize.mean.reshape(1, -1, 1, 1).expand(1, *matcher.observation.image_shape)
    with torch.no_grad():
        layers = matcher.model.extractor[:position]
        centre = (layers(matcher.model.normalize(mean_image.to(torch.float32))).double() @ basis)[0]
    generator = torch.Generator().manual_seed(0)
    device = basis.device
    screened, starts = [], max(STARTS, STARTS_BUDGET // len(splits))
    for split in splits:
        onehot = F.one_hot(torch.tensor(split, device=device), matcher.observation.num_classes).double()
        best = None
        for _ in range(starts):
            noise = torch.randn((slots, slots), generator=generator, dtype=torch.float64).to(device)
            start = centre.expand(slots, slots) + 0.5 * centre.norm() * noise / slots ** 0.5
            value, coefficients = _fit(top, basis, onehot, start, SCREEN_ITERATIONS)
            if best is None or value < best[0]:
                best = (value, coefficients)
            if best[0] <= SOLVED_RESIDUAL:
                break
        screened.append((best[0], best[1], split, onehot))
        if best[0] <= SOLVED_RESIDUAL:
            break
    screened.sort(key=lambda s: s[0])
    finished = []
    for value, coefficients, split, onehot in screened[:FINISHED_SPLITS]:
        value, coefficients = _fit(top, basis, onehot, coefficients, FINISH_ITERATIONS)
        finished.append((value, coefficients, split))
        if value <= SOLVED_RESIDUAL:
            break
    value, coefficients, split = min(finished, key=lambda s: s[0])
    trace = {"applied": True, "layer": f"extractor.{child}", "splits": len(splits), "starts_per_split": starts,
             "residual": value,
             "solved": value <= SOLVED_RESIDUAL, "labels": split}
    if value > SOLVED_RESIDUAL:
        return None, {**trace, "why": f"no split reproduced the update (best residual {value:.1e})"}
    inputs = (coefficients @ basis.T).to(torch.float32)
    return LayerInputs(position, below, inputs, torch.tensor(split, device=device), value), trace


def replayed(matcher, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], list[dict]]:
    """The dummy's counterpart of the targets and the weights each step started from (one step's
    gradient: the download's)."""
    if matcher.mode == "replay":
        return matcher.replay_states(x, y)
    return matcher.dummy(x, y), [matcher.update.before]


def layer_inputs(matcher, layer: LayerInputs, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The inputs of the layer for images ``x`` under the extractor weights ``params``."""
    below = matcher.model.extractor[:layer.position]
    return functional_call(below, {n[len("extractor."):]: params[n] for n in layer.below},
                           (matcher.model.normalize(x),))


def input_term(matcher, layer: LayerInputs, states: list[dict], x: torch.Tensor) -> torch.Tensor:
    """The mean over slots of ‖a_s(x) − a_s‖² / ‖a_s‖²: each slot's input at the weights of the step
    that used it (``states``: the replay's, one per step) against the solved one; zero at the truth."""
    bs = x.shape[0] // len(states)
    got = torch.cat([layer_inputs(matcher, layer, params, x[t * bs:(t + 1) * bs]) for t, params in enumerate(states)])
    return ((got - layer.inputs).pow(2).sum(dim=1) / layer.inputs.pow(2).sum(dim=1).clamp_min(1e-12)).mean()


def start_images(matcher, layer: LayerInputs, iterations: int, starts: int = INVERSION_STARTS) -> torch.Tensor:
    """Images whose inputs at the layer approach the solved ones (``attacks.inversion.layer_inputs``), each slot
    through the weights of its step estimated between download and upload (ω_t = ω_0 + (t/T)·Δ, as the
    label counts are); from the grey image and ``starts − 1`` seeded noise images, each slot keeping the
    image whose input is nearest (the inversion through the max-pools has local minima: on the data set's
    first 8 images one start reached 18.1 dB, the best of 8 about 23)."""
    update, steps = matcher.update, int(matcher.hyperparameters.steps)
    bs = layer.inputs.shape[0] // steps
    shape, device = tuple(matcher.observation.image_shape), layer.inputs.device
    generator = torch.Generator().manual_seed(0)
    beginnings = [torch.full(shape, 0.5)] + [torch.rand(shape, generator=generator) for _ in range(starts - 1)]
    out = []
    for t in range(steps):
        params = {n: update.before[n] + (t / steps) * update.delta[n] for n in layer.below}
        target = layer.inputs[t * bs:(t + 1) * bs]
        inputs = functools.partial(layer_inputs, matcher, layer, params)
        best, error = None, None
        for beginning in beginnings:
            with torch.enable_grad():
                images = invert_layer_inputs(inputs, target, beginning.to(device), iterations)
            with torch.no_grad():
                e = (inputs(images) - target).norm(dim=1) / target.norm(dim=1).clamp_min(1e-12)
            if best is None:
                best, error = images, e
            else:
                best = torch.where((e < error).view(-1, *[1] * (images.dim() - 1)), images, best)
                error = torch.minimum(e, error)
        out.append(best)
    return torch.cat(out)
