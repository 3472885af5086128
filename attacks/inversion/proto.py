"""Prototype inversion: rebuild a class-typical image from an uploaded class prototype.

FedProto and FedPAC upload, for every class a client holds, a *prototype*: the mean feature
c_k = mean_{x in class k} f(x) of the client's training images of that class. A curious server
searches for inputs whose features reproduce it. The result is an image typical of that client's
class (not one particular training image); that is what the attack returns and what its score
means (the harness scores it against the client's images of that class, beside the data-set mean
image as the prior).

Objective. A prototype is a *mean* of features, and a single image rarely has a feature equal to
the mean of many (matching one forces saturated, noise-like images; measured on mnist5k: 7-9 dB,
below the 12 dB prior). So the attack inverts a *set* of ``ENSEMBLE`` images x_1..x_M for each
prototype p, scores the set's mean feature m = (1/M)·Σ f(x_i), and returns the pixel mean of the
set:

    L = ‖m − p‖² / ‖p‖²  +  β·(1 − cos(m, p))  +  γ·mean_i TV(x_i)

* the squared error is *relative* to ‖p‖², so one setting works whatever the feature scale
  (random-init and trained extractors differ by orders of magnitude);
* the cosine term (β = ``COSINE_WEIGHT``) keeps the direction right when the magnitude cannot be
  matched (e.g. FedProto inverted on a network that did not compute the prototype);
* TV is the anisotropic total variation with a smoothed absolute value sqrt(d² + ε²) − ε
  (ε = 0.01, so L-BFGS sees a differentiable objective), averaged over horizontal and vertical
  neighbours, γ = ``TV_WEIGHT``.

Image model. Pixels are x = clamp(G_σ * z, 0, 1): a Gaussian blur G_σ (σ = H/28 px, within
[0.5, 1.5]) of free logits z, a smoothness prior that removes the high-frequency null space of the
extractor, and a box constraint to [0, 1]. z starts at the per-channel pixel mean plus noise
(std 0.1). Optimiser: L-BFGS (strong-Wolfe line search, history 20), at most
``budget.iterations`` iterations; on this problem it reached 12.8 dB where Adam (IG's schedule,
300 steps, lr 0.05 / 0.01) reached 11.7 / 11.9 dB (mnist5k, trained extractor, 10 classes).
``budget.restarts`` independent sets per prototype; the set with the lowest objective is kept. The
objective, the prior and the reading of the upload live in ``attacks.inversion.prototypes``; the starts,
the L-BFGS run and the best-keeping are the template's (``attacks.inversion.optimise``; ``RECIPE``).

Contrast. Averaging M images lowers contrast, which PSNR punishes; the returned mean image is
rescaled per channel to the pixel mean and ``CONTRAST`` × the pixel std that the model's
``Normalize`` layer carries (public: it is part of the architecture the server defines). 0.7
because an average of one class's images has 0.66 (mnist5k) to 0.84 (digits) of the spread of
single images.

Which extractor f (``prototypes.choose_extractor``; the threat model; in ``notes`` and
``trace["extractor_source"]``):

* the client's *uploaded* extractor when the upload carries the full extractor (FedPAC): FedPAC
  computes its prototypes with the client's trained local base, after local training, which is
  exactly the base uploaded beside them; the forward check then judges the attack as usual;
* otherwise the server holds no model of the client (FedProto uploads prototypes only and computes
  them after local training), and every choice below is a surrogate of the server's own: the result
  is an estimate, the NO MODEL verdict (``attacks.verdicts``), never MIS-SPECIFIED. With public data
  (``observation.auxiliary``: ``fedsec attack --aux-data``), a surrogate extractor trained on it
  towards the prototypes the server aggregated this round (``prototypes.fit_surrogate``);
* otherwise the extractor the server *sent* in this round's download, when there is one;
* otherwise the model the server initialised the federation with, ``observation.make_model()``; the
  harness must build it with the federation's *initial* weights. FedProto clients train their whole
  model locally from those weights and never send it, so the inversion runs on a network that did
  not compute the prototypes and the result is a lower bound on what leaks.

One image per uploaded prototype is returned, labelled with the prototype's class.
``budget.batch`` does not apply (the number of images is the number of prototypes uploaded).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from fedecouple.models import SplitModel

from ..base import AttackResult, Budget, NotApplicable, Observation
from ..registry import ClientAttackSpec
from .optimise import LBFGS, BestOfStarts, Recipe, around, generator, run_lbfgs
from .prototypes import COSINE_WEIGHT, PRIOR, TV_WEIGHT, choose_extractor, set_objective, uploaded_prototypes

ENSEMBLE = 16  # images per prototype whose mean feature is matched
CONTRAST = 0.7
INIT_NOISE = 0.1
LBFGS_HISTORY = 20
# L-BFGS with a strong-Wolfe line search, its inner iterations the budget's (one step per start)
RECIPE = Recipe("relative squared error and 1 - cos of a set's mean feature against the prototype + TV",
                LBFGS(lr=1.0, history_size=LBFGS_HISTORY, line_search="strong_wolfe"), PRIOR)

GRADIENT_ATTACKS_HINT = ("its upload carries model weights, not prototypes: use the gradient attacks "
                         "(`fedsec attack dlg|idlg|ig`) and `labels` instead")


# ------------------------------------------------------------------------------------------------
# the image model


def blur_sigma(image_shape: tuple[int, int, int]) -> float:
    return min(1.5, max(0.5, image_shape[-1] / 28.0))


def gaussian_blur(sigma: float, channels: int):
    """A depth-wise Gaussian blur with replicate padding (identity for sigma <= 0)."""
    if sigma <= 0:
        return lambda z: z
    radius = max(1, int(3 * sigma))
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k1 = torch.exp(-t.pow(2) / (2 * sigma * sigma))
    k1 = k1 / k1.sum()
    kernel = (k1[:, None] * k1[None, :]).expand(channels, 1, 2 * radius + 1, 2 * radius + 1).contiguous()
    return lambda z: F.conv2d(F.pad(z, (radius,) * 4, mode="replicate"), kernel, groups=channels)


def _pixel_stats(model: SplitModel, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    norm = getattr(model, "normalize", None)
    if norm is None:
        return torch.full((1, channels, 1, 1), 0.5), torch.full((1, channels, 1, 1), 0.25)
    return norm.mean.detach().float().view(1, -1, 1, 1), norm.std.detach().float().view(1, -1, 1, 1)


def invert_prototype(model: SplitModel, target: torch.Tensor, image_shape: tuple[int, int, int],
                     iterations: int, restarts: int = 1, seed: int = 0, ensemble: int = ENSEMBLE,
                     tv_weight: float = TV_WEIGHT, cosine_weight: float = COSINE_WEIGHT,
                     contrast: float | None = CONTRAST, match_norm: bool = True,
                     details: dict | None = None) -> tuple[torch.Tensor, float, list[float]]:
    """One class-typical image (C, H, W) in [0, 1] for one prototype (D,) (or, with ``match_norm``
    False, for a feature direction: e.g. a classifier row that points like a class mean).

    Returns (image, objective of the kept set, the kept set's objective at each function evaluation);
    ``details``, when given, receives the kept set's data term (the objective without TV: what the
    forward check compares with the client's true images)."""
    model = model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    channels = image_shape[0]
    blur = gaussian_blur(blur_sigma(image_shape), channels)
    mean, std = _pixel_stats(model, channels)
    target = target.detach().float().flatten()
    gen = generator(seed)
    starts = BestOfStarts(1)
    for _ in range(max(1, int(restarts))):
        z = around(mean, (ensemble, *image_shape), INIT_NOISE, gen).clone().requires_grad_(True)
        history: list[float] = []

        def evaluate() -> torch.Tensor:
            loss = set_objective(model, blur(z).clamp(0, 1), target, tv_weight, cosine_weight, match_norm)
            history.append(float(loss.detach()))
            return loss

        run_lbfgs(RECIPE.optimiser, [z], evaluate, max_iter=max(1, int(iterations)), steps=1 if iterations > 0 else 0)
        with torch.no_grad():
            x = blur(z).clamp(0, 1)
            final = float(set_objective(model, x, target, tv_weight, cosine_weight, match_norm))
        if not math.isfinite(final):
            final = float("inf")
        starts.offer(0, final, history, {"objective": final, "images": x.detach().clone(), "history": history})
    final, x, history = (starts.best[0][key] for key in ("objective", "images", "history"))
    if details is not None:
        with torch.no_grad():
            details["data_term"] = float(set_objective(model, x, target, 0.0, cosine_weight, match_norm))
    image = x.mean(0, keepdim=True)
    if contrast is not None:
        mu = image.mean(dim=(2, 3), keepdim=True)
        sd = image.std(dim=(2, 3), keepdim=True).clamp_min(1e-6)
        image = mean + (image - mu) / sd * (std * contrast)
    return image.clamp(0, 1)[0], final, history


# ------------------------------------------------------------------------------------------------
# the attack


def prototype_inversion(observation: Observation, budget: Budget, seed: int) -> AttackResult:
    """Invert every prototype in ``observation.upload``; see the module docstring."""
    start = time.perf_counter()
    manifest = observation.manifest()
    if not any(s.kind == "prototype" for s in manifest):
        raise NotApplicable(f"{observation.method.name} uploads no prototypes; {GRADIENT_ATTACKS_HINT}.")
    protos = uploaded_prototypes(observation, manifest)
    if not protos:
        raise NotApplicable(f"client {observation.client_id}'s upload in round {observation.round} holds no "
                            "prototypes (dropped or filtered by the channel); nothing to invert.")
    model, source, sentence = choose_extractor(observation)
    classes = list(protos)
    dims = {int(protos[c].numel()) for c in classes}
    if dims != {model.feature_dim}:
        raise NotApplicable(f"the uploaded prototypes have {sorted(dims)} dimensions but the model's features have "
                            f"{model.feature_dim}; they are not features of this architecture.")
    shape = tuple(int(v) for v in observation.image_shape)
    images, objectives, histories, data_terms = [], [], [], []
    for i, c in enumerate(classes):
        details: dict = {}
        image, objective, history = invert_prototype(model, protos[c], shape, budget.iterations, budget.restarts,
                                                     seed=(int(seed) * 1009 + i) % 2**63, details=details)
        data_terms.append(details["data_term"])
        images.append(image)
        objectives.append(objective)
        histories.append(history)
    notes = [sentence,
             f"One image per uploaded prototype ({len(classes)} classes), each the pixel mean of {ENSEMBLE} images "
             "whose mean feature matches the prototype: a class-typical image for that client, not a particular "
             "training image."]
    finite = [o for o in objectives if math.isfinite(o)]
    trace = {"mode": f"{source}-extractor", "extractor_source": source, "classes": classes,
             "objective": float(sum(finite) / len(finite)) if finite else float("nan"),
             "objective_per_class": objectives, "data_term_per_class": data_terms, "loss_history": histories,
             "seconds": time.perf_counter() - start,
             "objective_definition": (f"|m-p|^2/|p|^2 + {COSINE_WEIGHT:g}(1-cos(m,p)) + {TV_WEIGHT:g} TV, m = mean "
                                      f"feature of {ENSEMBLE} images; returned image = their pixel mean, "
                                      f"contrast {CONTRAST:g}")}
    return AttackResult(images=torch.stack(images), labels=torch.tensor(classes, dtype=torch.int64),
                        trace=trace, notes=notes)


SPEC = ClientAttackSpec("proto", attack_one=prototype_inversion, default_victim_batch=0,
                        applies_to=frozenset({"prototype"}), scoring="class-images", needs="prototypes",
                        hint="prototype inversion has nothing to invert; use the gradient attacks (`fedsec attack "
                             "dlg|idlg|ig --method {method}`) or `labels` instead")
