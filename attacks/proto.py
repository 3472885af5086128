"""Prototype inversion: rebuild a class-typical image from an uploaded class prototype.

FedProto and FedPAC upload, for every class a client holds, a *prototype*: the mean feature
vector f(x) of the client's training images of that class. A curious server can search for an
input whose feature matches it; the result is an image typical of that client's class (not one
particular training image), which is what this attack returns and what its score means.

Objective, per prototype p (feature dimension D), for an image x in [0, 1]:

    L(x) = ‖f(x) − p‖² / max(‖p‖², ε)  +  β·(1 − cos(f(x), p))  +  γ·TV(x)

* the squared error is *relative* to ‖p‖², so one weight setting works whatever the scale of the
  features (random-init and trained extractors differ by orders of magnitude);
* the cosine term (β = ``COSINE_WEIGHT``) keeps the direction right when the magnitude cannot be
  matched (a prototype is a mean of features, which a single image may not reach exactly);
* TV(x) is the anisotropic total variation (mean absolute difference of horizontally and
  vertically adjacent pixels, as in Inverting Gradients), γ = ``TV_WEIGHT``.

Optimisation: pixels are parametrised as x = sigmoid(z) (box-constrained to [0, 1] by
construction), Adam with learning rate ``LR`` and a step decay (×0.1 at 3/8, 5/8 and 7/8 of the
iterations, Inverting Gradients' schedule), ``budget.iterations`` steps. ``budget.restarts``
independent starts (uniform noise around grey) run for every prototype; the start with the
lowest final objective is kept. All prototypes × restarts are optimised as one batch: the
objective is a sum of per-image terms and Adam acts element-wise, so this is exactly the same as
separate runs, only faster.

Which extractor f (the threat model; written into ``notes`` and ``trace["extractor_source"]``):

* the client's *uploaded* extractor when the upload carries the full extractor (FedPAC): the
  prototypes are computed with the client's trained local extractor, which is exactly the one
  uploaded alongside them;
* otherwise the extractor the server *sent* in this round's download, when the download carries
  one;
* otherwise (FedProto uploads no weights at all) the model the server initialised the federation
  with, ``observation.make_model()``. The harness must build that model with the federation's
  initial weights. This is a weaker threat model: the client's prototypes come from its locally
  trained extractor, which the server never sees, so the inversion runs on a mismatched network.

One image per uploaded prototype is returned, labelled with the prototype's class.
``budget.batch`` does not apply (the number of images is the number of prototypes uploaded).
"""
from __future__ import annotations

import re
import time

import torch
import torch.nn.functional as F

from fedecouple.methods import make_method
from fedecouple.methods.base import FieldSpec
from fedecouple.models import SplitModel, set_params

from .base import AttackResult, Budget, NotApplicable, Observation

LR = 0.1
TV_WEIGHT = 0.02
COSINE_WEIGHT = 1.0
INIT_NOISE = 0.5  # std of the logits z at the start (x = sigmoid(z) ≈ 0.5 ± 0.12)

GRADIENT_ATTACKS_HINT = ("its upload carries model weights, not prototypes: use the gradient attacks "
                         "(`fedsec attack dlg|idlg|ig`) and `labels` instead")


# ------------------------------------------------------------------------------------------------
# reading an upload through a method's manifest


def per_class_pattern(spec: FieldSpec) -> re.Pattern:
    """A regex matching the sent names of a per-class field (``name.format(k=class)``); group 1 is
    the class id."""
    if "{k}" not in spec.name:
        raise ValueError(f"per-class field {spec.name!r} has no '{{k}}' placeholder")
    prefix, suffix = spec.name.split("{k}", 1)
    return re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix.replace("{k}", "")) + r"\Z")


def method_manifest(observation: Observation) -> list[FieldSpec]:
    return make_method(observation.method).manifest(observation.make_model())


def per_class_values(tensors: dict[str, torch.Tensor], specs: list[FieldSpec]) -> dict[int, torch.Tensor]:
    """{class id: tensor} for the per-class fields ``specs`` found in ``tensors``."""
    found: dict[int, torch.Tensor] = {}
    for spec in specs:
        pattern = per_class_pattern(spec)
        for key, value in tensors.items():
            m = pattern.match(key)
            if m:
                found[int(m.group(1))] = value
    return found


def uploaded_prototypes(observation: Observation, manifest: list[FieldSpec] | None = None) -> dict[int, torch.Tensor]:
    """The prototypes in the upload, by class (per-class fields, or one (C, D) matrix whose
    all-zero rows are classes the client does not hold)."""
    manifest = method_manifest(observation) if manifest is None else manifest
    specs = [s for s in manifest if s.kind == "prototype"]
    protos = per_class_values(observation.upload, [s for s in specs if s.per_class])
    for spec in specs:
        if not spec.per_class and spec.name in observation.upload:
            matrix = observation.upload[spec.name]
            if matrix.ndim == 2:
                for k, row in enumerate(matrix):
                    if bool(row.abs().sum() > 0):
                        protos.setdefault(k, row)
    return {k: v.detach().float().flatten() for k, v in sorted(protos.items())}


def _full_group(tensors: dict[str, torch.Tensor], model: SplitModel, group: str) -> dict[str, torch.Tensor] | None:
    names = [n for n, _ in model.named_parameters() if n.startswith(group + ".")]
    if names and all(n in tensors for n in names):
        return {n: tensors[n] for n in names}
    return None


def choose_extractor(observation: Observation) -> tuple[SplitModel, str, str]:
    """The extractor to invert (see the module docstring): (model, source, sentence for the user)."""
    model = observation.make_model()
    uploaded = _full_group(observation.upload, model, "extractor")
    if uploaded is not None:
        set_params(model, uploaded)
        return model, "upload", ("Inverted with the client's uploaded extractor, the one that computed its "
                                 "prototypes (the server sees it in the same upload).")
    downloaded = _full_group(observation.download, model, "extractor")
    if downloaded is not None:
        set_params(model, downloaded)
        return model, "download", ("Inverted with the extractor the server sent this round; the client computed "
                                   "its prototypes with its own trained copy, so the match is approximate.")
    return model, "initial", (
        f"{observation.method} uploads no model weights, so the server inverts the prototypes with the model it "
        "initialised the federation with; the client's prototypes come from its locally trained extractor, "
        "which the server never sees (a weaker threat model: results are a lower bound on what leaks).")


# ------------------------------------------------------------------------------------------------
# the optimisation


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Per-image anisotropic TV: mean |Δ| over horizontal plus vertical neighbours, shape (B,)."""
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().flatten(1).mean(1)
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().flatten(1).mean(1)
    return dx + dy


def feature_objective(features: torch.Tensor, targets: torch.Tensor, images: torch.Tensor,
                      tv_weight: float = TV_WEIGHT, cosine_weight: float = COSINE_WEIGHT) -> torch.Tensor:
    """The per-image objective L(x) of the module docstring, shape (B,)."""
    rel = (features - targets).pow(2).sum(1) / targets.pow(2).sum(1).clamp_min(1e-12)
    cos = F.cosine_similarity(features, targets, dim=1, eps=1e-12)
    return rel + cosine_weight * (1.0 - cos) + tv_weight * total_variation(images)


def invert_features(model: SplitModel, targets: torch.Tensor, image_shape: tuple[int, int, int],
                    iterations: int, restarts: int = 1, seed: int = 0, lr: float = LR,
                    tv_weight: float = TV_WEIGHT, cosine_weight: float = COSINE_WEIGHT) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Images in [0, 1] whose features match each row of ``targets`` (K, D).

    Returns (images (K, C, H, W), final objective per image (K,), mean objective history)."""
    model = model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    k = targets.shape[0]
    restarts = max(1, int(restarts))
    gen = torch.Generator().manual_seed(int(seed))
    z = (torch.randn((restarts * k, *image_shape), generator=gen) * INIT_NOISE).requires_grad_(True)
    tgt = targets.detach().float().repeat(restarts, 1)
    opt = torch.optim.Adam([z], lr=lr)
    milestones = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1)
    history: list[float] = []
    for _ in range(max(0, int(iterations))):
        x = torch.sigmoid(z)
        loss = feature_objective(model.features(x), tgt, x, tv_weight, cosine_weight)
        opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        opt.step()
        sched.step()
        history.append(float(loss.detach().mean()))
    with torch.no_grad():
        x = torch.sigmoid(z)
        final = feature_objective(model.features(x), tgt, x, tv_weight, cosine_weight).view(restarts, k)
        best = final.argmin(0)
        images = x.view(restarts, k, *image_shape)[best, torch.arange(k)]
        return images.clone(), final[best, torch.arange(k)].clone(), history


# ------------------------------------------------------------------------------------------------
# the attack


def prototype_inversion(observation: Observation, budget: Budget, seed: int) -> AttackResult:
    """Invert every prototype in ``observation.upload``; see the module docstring."""
    start = time.perf_counter()
    manifest = method_manifest(observation)
    if not any(s.kind == "prototype" for s in manifest):
        raise NotApplicable(f"{observation.method} uploads no prototypes; {GRADIENT_ATTACKS_HINT}.")
    protos = uploaded_prototypes(observation, manifest)
    if not protos:
        raise NotApplicable(f"client {observation.client_id}'s upload in round {observation.round} holds no "
                            "prototypes (dropped or filtered by the channel); nothing to invert.")
    model, source, sentence = choose_extractor(observation)
    classes = list(protos)
    targets = torch.stack([protos[c] for c in classes])
    if targets.shape[1] != model.feature_dim:
        raise NotApplicable(f"the uploaded prototypes have {targets.shape[1]} dimensions but the model's features "
                            f"have {model.feature_dim}; the prototypes are not features of this architecture.")
    images, objective, history = invert_features(model, targets, tuple(observation.image_shape),
                                                 budget.iterations, budget.restarts, seed)
    notes = [sentence,
             f"One image per uploaded prototype ({len(classes)} classes): each is a class-typical image for that "
             "client, not a particular training image."]
    trace = {"extractor_source": source, "classes": classes, "objective": objective.tolist(),
             "loss_history": history, "seconds": time.perf_counter() - start,
             "objective_definition": "|f(x)-p|^2/|p|^2 + %g*(1-cos(f(x),p)) + %g*TV(x)" % (COSINE_WEIGHT, TV_WEIGHT)}
    return AttackResult(images=images, labels=torch.tensor(classes, dtype=torch.int64), trace=trace, notes=notes)
