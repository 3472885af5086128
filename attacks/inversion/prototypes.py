"""The uploaded prototypes and what inverts them: reading per-class fields of an upload through a
method's manifest (``per_class_values``, ``uploaded_prototypes``), the extractor the server inverts them
with (``choose_extractor``; with public data, a surrogate it trains, ``fit_surrogate``; whether the server
holds the client's extractor at all, ``uploads_extractor``), and the objective
of an image set against one prototype (``set_objective``). Prototype inversion
(``attacks.inversion.proto``), label inference (``attacks.inversion.label_distribution``), its forward
check (``attacks.inversion.forward_check``) and the recorded run's round prototypes read them.

The objective, for a set of images x_1..x_M and one prototype p, with m = (1/M)·Σ f(x_i) the set's mean
feature:

    L = ‖m − p‖² / ‖p‖²  +  β·(1 − cos(m, p))  +  γ·mean_i TV(x_i)

(β = ``COSINE_WEIGHT``; TV the smoothed per-image total variation, ε = ``TV_EPS``, γ = ``TV_WEIGHT``;
see ``attacks.inversion.proto`` for why each term).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fedecouple.methods.base import FieldSpec
from fedecouple.models import SplitModel, set_params

from ..base import Observation
from .optimise import TotalVariation

COSINE_WEIGHT = 1.0
TV_WEIGHT = 0.005
TV_EPS = 0.01
# the set's prior: the smoothed per-image total variation (L-BFGS sees a differentiable objective),
# averaged over the set
PRIOR = TotalVariation(TV_WEIGHT, "smoothed", TV_EPS)


def per_class_values(tensors: dict[str, torch.Tensor], specs: list[FieldSpec]) -> dict[int, torch.Tensor]:
    """{class id: tensor} for the per-class fields ``specs`` found in ``tensors``."""
    found: dict[int, torch.Tensor] = {}
    for spec in specs:
        pattern = spec.pattern
        for key, value in tensors.items():
            m = pattern.match(key)
            if m:
                found[int(m.group(1))] = value
    return found


def uploaded_prototypes(observation: Observation, manifest: list[FieldSpec] | None = None) -> dict[int, torch.Tensor]:
    """The prototypes in the upload, by class (per-class fields, or one (C, D) matrix whose
    all-zero rows are classes the client does not hold)."""
    manifest = observation.manifest() if manifest is None else manifest
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


SURROGATE_STEPS = 300
SURROGATE_BATCH = 128
SURROGATE_LR = 1e-3


def fit_surrogate(model: SplitModel, images: torch.Tensor, labels: torch.Tensor, prototypes: dict[int, torch.Tensor],
                  steps: int = SURROGATE_STEPS, seed: int = 0) -> SplitModel:
    """A surrogate extractor: ``model``'s, trained on the server's public data the way a FedProto client
    trains its extractor towards the published prototypes: each image's features pulled to its class's
    prototype (squared distance relative to the prototypes' mean squared norm; Adam, mini-batches).
    Only classes with a prototype take part. Returns the trained copy."""
    surrogate = copy.deepcopy(model).train()
    keep = torch.tensor([int(y) in prototypes for y in labels.tolist()], dtype=torch.bool)
    x, y = images[keep], labels[keep]
    if len(y) == 0:
        return surrogate.eval()
    table = torch.zeros(int(y.max()) + 1, model.feature_dim)
    for k, proto in prototypes.items():
        if k < len(table):
            table[k] = proto.float()
    scale = torch.stack([p.float() for p in prototypes.values()]).pow(2).sum(dim=1).mean().clamp_min(1e-12)
    params = list(surrogate.extractor.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=SURROGATE_LR)
    gen = torch.Generator().manual_seed(int(seed))
    for _ in range(max(0, int(steps))):
        pick = torch.randint(0, len(y), (min(SURROGATE_BATCH, len(y)),), generator=gen)
        loss = (surrogate.features(x[pick]) - table[y[pick]]).pow(2).sum(dim=1).mean() / scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return surrogate.eval()


def uploads_extractor(manifest: list[FieldSpec]) -> bool:
    """Whether a method's upload carries an extractor (a field of kind "extractor" in its manifest):
    if not, the server never holds the extractor a client computed its prototypes with (they are
    computed after local training; FedProto), whatever it inverts them with is a surrogate of its own,
    and the forward check does not apply (the NO MODEL verdict, ``attacks.verdicts``)."""
    return any(spec.kind == "extractor" for spec in manifest)


def choose_extractor(observation: Observation) -> tuple[SplitModel, str, str]:
    """The extractor to invert (see the module docstring): (model, source, sentence for the user). The
    client's uploaded extractor whenever the upload carries it (the server holds the model that
    computed the prototypes: no surrogate can do better); else, with public data, a surrogate trained
    on it; else the extractor sent this round; else the initial model."""
    model = observation.make_model()
    uploaded = _full_group(observation.upload, model, "extractor")
    if uploaded is not None:
        set_params(model, uploaded)
        return model, "upload", ("Inverted with the client's uploaded extractor, the one that computed its "
                                 "prototypes (the server sees it in the same upload).")
    name = observation.method.name
    if observation.auxiliary is not None and observation.round_prototypes:
        downloaded = _full_group(observation.download, model, "extractor")
        if downloaded is not None:
            set_params(model, downloaded)
        images, labels = observation.auxiliary
        surrogate = fit_surrogate(model, images, labels, observation.round_prototypes,
                                  seed=observation.round * 7919 + observation.client_id)
        return surrogate, "surrogate", (
            f"NO MODEL: {name} uploads no extractor, so the server holds no model of the client; it inverted with "
            f"a surrogate extractor it trained on its {len(labels)} public images so that their features match the "
            f"prototypes it aggregated this round ({len(observation.round_prototypes)} classes), the way a {name} "
            f"client trains towards them (auxiliary-data threat model): the figures are this surrogate attacker's "
            f"estimate.")
    downloaded = _full_group(observation.download, model, "extractor")
    if downloaded is not None:
        set_params(model, downloaded)
        return model, "download", ("Inverted with the extractor the server sent this round; the client computed "
                                   "its prototypes with its own trained copy, so the match is approximate.")
    return model, "initial", (
        f"NO MODEL: {name} uploads no model weights, so the server inverts the prototypes with the model it "
        "initialised the federation with; the client's prototypes come from its locally trained extractor, "
        "which the server never sees: the figures are an estimate with that surrogate (give the server public "
        "data, --aux-data, for a trained one), a lower bound on what leaks.")


def set_objective(model: SplitModel, x: torch.Tensor, target: torch.Tensor,
                  tv_weight: float = TV_WEIGHT, cosine_weight: float = COSINE_WEIGHT,
                  match_norm: bool = True) -> torch.Tensor:
    """L of the module docstring for one set of images x (M, C, H, W) and one prototype (D,); with
    ``match_norm`` False only its direction is matched (a target known up to scale)."""
    mean_feature = model.features(x).mean(0)
    cos = F.cosine_similarity(mean_feature, target, dim=0, eps=1e-12)
    value = cosine_weight * (1.0 - cos) + TotalVariation(tv_weight, PRIOR.kind, PRIOR.eps)(x)
    if match_norm:
        value = value + (mean_feature - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-12)
    return value
