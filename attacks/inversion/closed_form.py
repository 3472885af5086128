"""The closed-form stage of the gradient attacks: what an upload fixes exactly, before any optimisation.

Each method declares, beside its replay, what its upload gives away in closed form
(``Replay.closed_form``); ``derive`` computes it from the observation alone and every gradient
attack uses it through ``attacks.inversion.forward_model.GradientMatcher`` (recorded in the trace under
``closed_form``):

* ``"last-linear"`` — when the extractor takes **one unaugmented SGD step on one image** (the
  textbook victim), its last linear layer z = W a + b has the update ΔW = −lr·δ aᵀ and
  Δb = −lr·δ, δ = ∂L/∂z. So the layer's input a = ΔWᵀΔb / ‖Δb‖² (each weight row divided by its
  bias entry) and δ (up to the update's known scale) are exact, whatever lies above the layer: a
  private head (FedPer, FedRep), a prototype term. The layers below receive the gradient
  Jₐᵀ Wᵀ δ, with W the layer's weight before the step (the download): their update is a function of
  the image alone, **no head is needed** (``head_free``). The attack then matches the dummy's
  update computed with this known signal, and its input at the layer against the recovered a
  (relative squared error, weight ``LAST_LINEAR_WEIGHT``). FedPAC does not declare it: its head is
  known and its replay exact, and the extra term trapped 3 of 8 tuning targets in local minima.
  With **one step on B > 1 images** and a head the server does not hold (a private head after round 0:
  ``UpdateTarget.unknown``), ΔW = −lr·Σ_i δ_i a_iᵀ and Δb = −lr·Σ_i δ_i: [ΔW Δb] has rank B and its
  row space is the span of the inputs [a_i 1]. The inputs are no longer read one by one, but for the
  dummy's inputs the signals δ_i are the least-squares solution of those equations
  (``closed_form_terms.ClosedFormTerms._head_free_batch``), exact at the true images: everything the
  head does to the base's update is fitted in closed form, and the residual of that fit holds the
  dummy's inputs to the update's row space. In round 0 the initial head is the client's, and the
  forward model keeps it (it is exact and carries the labels).

* ``"statistics"`` — FedPAC's uploaded statistics are class means of features: ``h_k / p_k``
  (p_k = n_k/n from the uploaded counts) is the class-k mean feature of the client's images under
  the **downloaded** extractor, the prototype c_k the same under the **uploaded** one. For a
  one-image client they *are* the image's features. In the method mode (where the target is the
  update Δ, so the uploaded extractor is before + Δ) the attack matches the dummy's class-mean
  features under both extractors against them (relative squared error each, weight
  ``STATISTICS_WEIGHT``; rows of classes the client does not hold are left out).

* ``"classifier-row-space"`` — every loss FedeCouple's classifier phase minimises (CE and the
  distillation KL) has the weight gradient Σᵢ eᵢ fᵢᵀ, so the rows of the classifier's weight update
  lie in the span of the features fᵢ it was trained on (under the extractor the phase ran on: the
  client's kept one): rank 1 per image, 2 with one augmented copy. The span's basis (the update's
  leading right singular vectors, as many as images the phase trained on) is read from the update
  and the features of the dummy images that phase trained on (its step's images and their augmented
  copies; with DA the later phases' copies are not in the span) are held to it: the term is the share
  of each such feature's squared norm outside the span, weight ``ROW_SPACE_WEIGHT``. Only in the method mode, with the
  victim's steps (``steps_per_phase``) and one classifier step.

* ``"classifier-features"`` — the features themselves, for one classifier step (here on one image): they lie
  in that span, z_i = V a_i, and the method's classifier step (``ClassifierStep``) on them must
  give the observed weight and bias update, (d + 1)·C equations in rank² unknowns
  (``classifier_features``: least squares from starts around the rank-1 reading ΔWᵀΔb/‖Δb‖², exact
  without augmentation). With DA this yields the features of the image *and* of its augmented copy,
  in an order the update does not fix. The forward check reports their error against the image's
  true features (attack.csv's ``input_error``): what the upload gives away in closed form. They are
  not matched: on the tuning federation (seed 1, FedeCouple with DA, n = 8) matching them, as the
  better of the two orders (19.02 dB) or one order per start (18.01 dB), did not beat the row space
  alone (19.16 dB), and at weight 10 fell to 13.31 dB.
  With **B > 1 images** (their labels from the counts below) the rows are the B images, then their
  copies, each with its image's label (rank B·2 with DA; rows of one label in an order the update does
  not fix), and the first start is the minimum-norm solution of −(rows/lr)·ΔW = Σ_i (p̄ − y_i) f_iᵀ, every
  row's signal taken at the rows' mean prediction p̄ (which the bias update gives; ``_feature_starts``).
  On the tuning federation (seed 1, the audit preset's two-image cell, 4 targets) that start converged
  on every target, each true feature row within 4e-4 of a solved one.

* ``"extractor-linear-input"`` — FedeCouple at round 0 (the classifier phase and the extractor phase start
  from the same extractor; here one image): the rows of the update of the extractor's last linear layer
  z = act(W a + b) span the inputs a of every image the extractor phase trained on (rank 4 with DA: the
  image and a fresh copy in each of its two steps), and the image's solved feature (above) fixes its a
  there: W V c + b = act⁻¹(z), d equations in rank unknowns (``extractor_linear_input``; 1e-6 to 1e-3
  relative on the main job). The attack matches the dummy's input at the layer against the nearest
  candidate (one per solved feature row whose input lies in the span; both where the copies coincide),
  relative squared error, weight ``LINEAR_INPUT_WEIGHT``. On its own that input does not give the image
  back (a signed-Adam inversion from it reached 8-15 dB: two max-pools lie below), but beside the
  replayed update it lifted IG on the tuning federation. An L-BFGS inversion
  (``attacks.inversion.layer_inputs``, as a malicious server's readout does) gets further, and the image it
  rebuilds from a closed-form layer input (this one, or ``"last-linear"``'s) is DLG's and IG's first start
  (``GradientMatcher.closed_form_start``).
  With **B > 1 images** each image takes the solved row of its label whose input lies in the span (its
  own: the extractor phase drew fresh copies; ``_inputs_per_image``), every image's must, and the term
  matches the dummy's B inputs against the nearest of the orders the labels leave open (``arrangements``);
  the first start holds all B rebuilt images. Tuning federation (seed 1, two-image cell, 4 targets):
  the inputs within 1e-3 relative of the truth, the rebuilt images 12.5-22.8 dB (grey: 6.3 dB), IG
  15.1 dB → 18.4 dB (prior 12.1 dB).

* ``"labels"`` (and every method whose upload holds the classifier's update or class counts) —
  the per-class label counts of the images one step trained on (``label_counts``): from an
  uploaded ``class_counts`` field where there is one (exact), else for one image iDLG's rule on the
  classifier's weight update (``attacks.inversion.idlg_rule.idlg_labels``), else, for one plain step of a
  classifier sent in the download, from its bias update: Δb = −lr·(p̄ − n/B), so
  n̂ = B·(p̂ + Δb/lr) with p̂ the downloaded model's mean prediction, estimated at the public pixel
  mean image (exact after rounding whenever |p̂ − p̄| < 1/(2B)); rounded to B by largest
  remainders. The attacks fix a batch's labels to these counts; attack.csv reports the count error.
  Where a method declares ``"classifier-features"``, one image's label is also checked by that solve:
  only the true label's features reproduce the classifier's update, so if iDLG's reading fails the solve,
  the other classes are tried (``solve_classifier_step``): FedeCouple's label at trained rounds, where
  the distillation term outweighs the label's push and iDLG's rule misreads it.
  For several images and a method whose classifier phase is one ``ClassifierStep.classifier_step``
  (FedeCouple, ``_classifier_step_counts``): the same bias reading over the rows that step trained on
  (the images and their copies) with the mean prediction of the kept extractor and the classifier before
  the step (the distillation term moves no bias where the personal classifier is the teacher: round 0);
  the counts are kept only where the features solved under them reproduce the update.

The check that the update really is one such step: ΔW must be the rank-1 product Δb·aᵀ to
``RANK1_TOLERANCE`` (relative, float32 rounding of the weights allowed for); the residual is in the
trace and a larger one leaves the stage out with a note (e.g. a client that trained on several images).
The classifier-feature solve holds its own check: no features under the labels reproduce the update to
``FEATURE_TOLERANCE``, and its stage is left out with a note.
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fedecouple.methods.base import phase_steps
from fedecouple.methods.facets import ClassifierStep, Replay, facet, local_phases, trains_plain_sgd
from fedecouple.methods.prototypes import prototype_table, prototypes_in
from fedecouple.models import group_of

from ..base import LocalHyperparameters, Observation
from .observation import kept_model

# weight of ‖a(x) − a‖²/‖a‖² in the attack objective. Chosen on the tuning federation (seed 1,
# round 19, FedPer, textbook victim)
LAST_LINEAR_WEIGHT = 1.0
RANK1_TOLERANCE = 1e-3
# weight of each class-mean feature term (FedPAC's h/p and prototypes). Chosen on the tuning
# federation (seed 1, round 0, FedPAC)
STATISTICS_WEIGHT = 1.0
# weight of the share of the classifier batch's features outside the classifier update's row space.
# Chosen on the tuning federation (seed 1, round 0, FedeCouple with DA, one start): weight 0 17.95 dB,
# weight 1 19.07 dB
ROW_SPACE_WEIGHT = 1.0
# the classifier-feature solve: starts spread around the rank-1 reading (fractions of its norm), and the
# relative residual of the classifier's update below which the solved features are taken as exact
FEATURE_START_SPREADS = (0.05, 0.2, 0.5)
FEATURE_TOLERANCE = 1e-4
# the extractor's last linear layer's input from the solved features: the relative residual (in the
# features' units) below which a solved feature row's input is taken to lie in the layer update's span
LINEAR_INPUT_TOLERANCE = 2e-2
# weight of the nearest candidate's ‖a(x) − a‖²/‖a‖². Chosen on the tuning federation (seed 1, round 0,
# FedeCouple with DA, IG, 8 targets): 0.03 19.41 dB, 0.1 21.31, 0.3 20.43, 1 13.82
LINEAR_INPUT_WEIGHT = 0.1
# several images: the orders of their solved layer inputs the term takes the nearest of (all B! up to this)
MAX_ARRANGEMENTS = 24


@dataclass
class LastLinear:
    """The extractor's last linear layer and what one step on one image fixed there."""

    position: int  # index of the layer among the extractor's children (a Sequential)
    weight: str  # parameter names, with the ``extractor.`` prefix
    bias: str
    below: list[str]  # the extractor's parameters that feed the layer
    input: torch.Tensor  # a, the layer's input for the client's image (in_features,), or candidates for it (k, in_features)
    head_free: bool  # the classifier the step used is not known exactly: the signal δ replaces it
    residual: float  # ‖ΔW − Δb aᵀ‖ / ‖ΔW‖ (0 for one step on one image, up to rounding)
    term_weight: float = LAST_LINEAR_WEIGHT  # of ‖a(x) − a‖²/‖a‖² in the attack objective
    # images of the one step: above 1, ``input`` is None (the update fixes only the inputs' span) and the
    # signals δ_i are solved from the update for the dummy's inputs (``head_free_signals``); or, solved
    # from the classifier step's features ("extractor-linear-input"), the images' inputs (P, B, in_features)
    # in each of the orders the labels leave open (``arrangements``)
    images: int = 1


@dataclass
class FeatureMeans:
    """Class-mean features an upload fixes: under the extractor before training ("before") or the
    uploaded one ("upload"); rows of absent classes are zero."""

    source: str
    means: torch.Tensor  # (C, d)
    field: str


@dataclass
class ClosedForm:
    last_linear: LastLinear | None = None
    feature_means: list[FeatureMeans] = field(default_factory=list)
    row_space_rank: int = 0  # > 0: the dummy's features are held to the classifier update's row space
    # (rank, d): the features of the images one classifier step trained on, solved from its update
    # (reported against the truth by the forward check, not matched)
    classifier_features: torch.Tensor | None = None
    label_counts: torch.Tensor | None = None  # (C,) int64 counts of the images one step trained on
    trace: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def last_linear_layer(model) -> tuple[int, str] | None:
    """(position, child name) of the extractor's last ``nn.Linear`` with a bias, when the extractor is
    a Sequential with that layer as a direct child and no parameter after it; else None."""
    extractor = model.extractor
    if not isinstance(extractor, nn.Sequential):
        return None
    children = list(extractor.named_children())
    for position in range(len(children) - 1, -1, -1):
        name, module = children[position]
        if isinstance(module, nn.Linear) and module.bias is not None:
            after = [p for _, m in children[position + 1:] for p in m.parameters()]
            return None if after else (position, name)
        if any(True for _ in module.parameters()):
            return None
    return None


def linear_input(delta_weight: torch.Tensor, delta_bias: torch.Tensor,
                 weight: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(a, residual): the least-squares input ΔWᵀΔb/‖Δb‖² of a rank-1 update ΔW = Δb·aᵀ, and
    ‖ΔW − Δb aᵀ‖ / (‖ΔW‖ + rounding): the residual relative to the update's size, where the rounding
    of the uploaded float32 weights (``weight``: the layer's weights, 2⁻²² of their norm) counts as
    part of the size, so that a trained model's small update is not refused for its rounding."""
    dw, db = delta_weight.double(), delta_bias.double()
    a = dw.T @ db / (db @ db).clamp_min(1e-300)
    rounding = 0.0 if weight is None else 2.0 ** -22 * float(weight.double().norm()) / RANK1_TOLERANCE
    residual = float((dw - torch.outer(db, a)).norm()) / max(float(dw.norm()) + rounding, 1e-300)
    return a.to(torch.float32), residual


def declared_facts(method) -> tuple[str, ...]:
    """What ``method`` declares an upload fixes in closed form (``Replay.closed_form``; () without a replay)."""
    replay = facet(method, Replay)
    return tuple(replay.closed_form) if replay is not None else ()


def extractor_phases(method, epochs: int) -> list[tuple[str, int, bool]]:
    """The phases of ``method``'s local training that train the extractor (``Replay.extractor_phases``; a
    method that declares no replay trains it in its one phase ``"local"``)."""
    replay = facet(method, Replay)
    trains = replay.extractor_phases if replay is not None else ("local",)
    return [(p, e, aug) for p, e, aug in local_phases(method, epochs) if p in trains]


def single_extractor_step(method, hp: LocalHyperparameters | None) -> bool:
    """Whether the extractor took exactly one unaugmented SGD step on one image (the victim setting
    with one image and one step per phase)."""
    if hp is None or hp.steps_per_phase is None:
        return False
    phases = extractor_phases(method, hp.epochs)
    samples = int(hp.samples if hp.samples is not None else hp.batch_size)
    return (len(phases) == 1 and int(hp.steps_per_phase) == 1 and samples == 1 and not phases[0][2])


def _names_below(model, update, position: int) -> list[str]:
    """The attacked parameters of the extractor's children before ``position`` (those that feed the layer)."""
    prefixes = [f"extractor.{name}." for name, _ in list(model.extractor.named_children())[:position]]
    return [n for n in update.names if any(n.startswith(p) for p in prefixes)]


def single_step_images(method, hp: LocalHyperparameters | None) -> int:
    """B when the extractor took exactly one unaugmented SGD step, on a batch of B images: the victim
    setting with one step per phase, or real local training of one epoch that holds one batch; else 0."""
    if hp is None:
        return 0
    phases = extractor_phases(method, hp.epochs)
    samples = int(hp.samples if hp.samples is not None else hp.batch_size)
    batch = min(int(hp.batch_size), samples)
    one = (len(phases) == 1 and not phases[0][2]
           and phase_steps(phases[0][1], samples, batch, hp.steps_per_phase) == 1)
    return batch if one else 0


def _span_residual(delta_weight: torch.Tensor, delta_bias: torch.Tensor, rank: int,
                   weight: torch.Tensor | None = None) -> float:
    """‖[ΔW Δb] − its best rank-``rank`` approximation‖ / (‖[ΔW Δb]‖ + rounding), as ``linear_input``."""
    both = torch.cat([delta_weight, delta_bias.unsqueeze(1)], dim=1).double()
    singular = torch.linalg.svdvals(both)
    rounding = 0.0 if weight is None else 2.0 ** -22 * float(weight.double().norm()) / RANK1_TOLERANCE
    return float(singular[rank:].norm()) / max(float(singular.norm()) + rounding, 1e-300)


def _last_linear_of_batch(update, position: int, weight: str, bias: str, images: int,
                          below: list[str]) -> tuple[LastLinear | None, list[str]]:
    """The head-free reading of one step on ``images`` > 1 images, where the head is unknown (module
    docstring: ΔW = Σ_i δ_i a_iᵀ, Δb = Σ_i δ_i has rank ``images``; the δ_i are solved for the dummy's a_i)."""
    if not any(group_of(n) == "classifier" for n in update.unknown):
        return None, []  # a known head (round 0): the exact forward model needs no reading
    residual = _span_residual(update.delta[weight], update.delta[bias], images, update.before[weight])
    if residual > RANK1_TOLERANCE:
        return None, [f"closed form: the last linear layer's update is not of rank {images} (residual "
                      f"{residual:.2g}): the unknown head is not read out of it"]
    return LastLinear(position, weight, bias, below, None, True, residual, 0.0, images), []


def _last_linear(obs: Observation, update, model) -> tuple[LastLinear | None, list[str]]:
    found = last_linear_layer(model)
    if found is None:
        return None, []
    position, child = found
    weight, bias = f"extractor.{child}.weight", f"extractor.{child}.bias"
    if weight not in update.names or bias not in update.names:
        return None, []
    images = single_step_images(obs.method, obs.known_hyperparameters)
    if images > 1 and images < min(update.delta[weight].shape):
        below = _names_below(model, update, position)
        if sorted(below + [weight, bias]) != sorted(update.names):
            return None, []
        return _last_linear_of_batch(update, position, weight, bias, images, below)
    if not single_extractor_step(obs.method, obs.known_hyperparameters):
        return None, []
    db = update.delta[bias]
    if float(db.abs().max()) == 0.0:
        return None, ["closed form: the last linear layer's bias did not move (δ = 0): its input is not fixed"]
    a, residual = linear_input(update.delta[weight], db, update.before[weight])
    if residual > RANK1_TOLERANCE:
        return None, [f"closed form: the last linear layer's update is not rank 1 (residual {residual:.2g}): "
                      f"its input is not read from it"]
    below = _names_below(model, update, position)
    head_free = not any(group_of(n) == "classifier" for n in update.names)
    if head_free and sorted(below + [weight, bias]) != sorted(update.names):
        return None, []
    return LastLinear(position, weight, bias, below, a, head_free, residual), []


def _feature_means(obs: Observation, num_features: int) -> list[FeatureMeans]:
    """FedPAC's statistics as class-mean features (module docstring): h/p under the downloaded
    extractor, the prototypes under the uploaded one."""
    upload, c = obs.upload, obs.num_classes
    out = []
    counts, h, n = upload.get("class_counts"), upload.get("h"), upload.get("sample_count")
    if counts is not None and h is not None and n is not None and tuple(h.shape) == (c, num_features):
        p = counts.to(torch.float64) / max(float(n), 1.0)
        means = torch.where(p.unsqueeze(1) > 0, h.to(torch.float64) / p.clamp_min(1e-300).unsqueeze(1), 0.0)
        out.append(FeatureMeans("before", means.to(torch.float32), "h / p"))
    table, has = prototype_table(prototypes_in(upload), c, num_features)
    if bool(has.any()):
        out.append(FeatureMeans("upload", table, "prototypes"))
    return out


def row_space(delta_weight: torch.Tensor, rank: int) -> torch.Tensor:
    """(d, rank) orthonormal basis of the leading right singular vectors of a (C, d) update."""
    _, _, vh = torch.linalg.svd(delta_weight.double(), full_matrices=False)
    return vh[:rank].T.to(torch.float32)


def _feature_starts(dw: torch.Tensor, db: torch.Tensor, basis: torch.Tensor, probs: torch.Tensor, lr: float,
                    images: int) -> list[torch.Tensor]:
    """Starts (flattened (rank, rank) coordinates in the row space ``basis``) of the classifier-feature
    solve. One image: the rank-1 reading ΔWᵀΔb/‖Δb‖² for every row, then pairs spread around it
    (``FEATURE_START_SPREADS``). Several: with every row's signal taken as e_i ≈ p̄ − y_i (p̄ the rows'
    mean prediction, which the bias update gives: Σ_i e_i = −(rows/lr)·Δb), −(rows/lr)·ΔW = Σ_i e_i f_iᵀ
    is linear in the features: its minimum-norm solution (each label's rows share their class sum), then
    seeded spreads of the same sizes around it."""
    rank = basis.shape[1]
    if images == 1:
        centre = basis.T @ (dw.T @ db / (db @ db).clamp_min(1e-300))  # (rank,)
        other = torch.linalg.svd(torch.eye(rank, dtype=torch.float64) - torch.outer(centre, centre)
                                 / (centre @ centre).clamp_min(1e-300))[0][:, :max(rank - 1, 1)]
        starts = [centre.repeat(rank)]
        for t in FEATURE_START_SPREADS if rank > 1 else ():
            for sign in (1.0, -1.0):
                shift = sign * t * float(centre.norm()) * other[:, 0]
                starts.append(torch.cat([centre + shift, centre - shift]))
        return starts
    signals = -(rank / lr) * db  # Σ_i e_i
    mean_prediction = (signals + probs.sum(dim=0)) / rank
    centre = torch.linalg.pinv(mean_prediction.unsqueeze(1) - probs.T) @ (-(rank / lr) * dw @ basis)  # (rank, rank)
    gen = torch.Generator().manual_seed(0)
    size = float(centre.norm(dim=1).mean())
    spreads = [t * size * torch.randn(centre.shape, generator=gen, dtype=torch.float64)
               for t in FEATURE_START_SPREADS for _ in range(2)]
    return [centre.reshape(-1)] + [(centre + s).reshape(-1) for s in spreads]


def classifier_features(obs: Observation, update, model, counts: torch.Tensor | None,
                        rank: int) -> tuple[torch.Tensor | None, float, str]:
    """(features (rank, d), relative residual, how) of the images one classifier step trained on (the
    B = ``counts.sum()`` images in the order of their labels, then their augmented copies in the same
    order), solved from the classifier's update, or (None, residual, why not). The features lie in the
    update's row space, z_i = V a_i; the method's own classifier step (``ClassifierStep``) on
    them, each row with its image's label, must give the observed weight and bias update: rank²
    unknowns against (d + 1)·C equations, solved by least squares from the starts of
    ``_feature_starts``. Rows of one label are solved up to their order (the update does not fix it)."""
    from scipy.optimize import least_squares

    hp = obs.known_hyperparameters
    images = 0 if counts is None else int(counts.sum())
    if images < 1 or rank % images or not isinstance(obs.method, ClassifierStep):
        return None, float("nan"), "needs the images' labels and the method's classifier step"
    names = [n for n in ("classifier.weight", "classifier.bias") if n in update.names]
    if len(names) != 2:
        return None, float("nan"), "needs the classifier's weight and bias updates"
    # on the CPU in float64 (scipy's solver works on NumPy arrays), whatever the attack's device
    device = update.delta["classifier.weight"].device
    work = copy.deepcopy(model).double().cpu()
    student = {n: update.before[n].double().cpu() for n in update.before if n.startswith("classifier.")}
    teacher = {n: v.double().cpu() for n, v in obs.download.items() if n.startswith("classifier.")}
    if set(teacher) != set(student):
        return None, float("nan"), "needs the downloaded classifier"
    observed = torch.cat([update.delta[n].double().cpu().reshape(-1) for n in names])
    scale = float(observed.norm())
    if scale == 0.0:
        return None, float("nan"), "the classifier did not move"
    basis = row_space(update.delta["classifier.weight"].cpu(), rank).double()  # (d, rank)
    labels = torch.repeat_interleave(torch.arange(len(counts)), counts.cpu()).repeat(rank // images)
    probs = torch.nn.functional.one_hot(labels, obs.num_classes).double()

    def residual(a: torch.Tensor) -> torch.Tensor:
        feats = a.reshape(rank, rank) @ basis.T
        after, _ = obs.method.classifier_step(work, student, teacher, feats, probs, hp.lr)
        predicted = torch.cat([(after[n] - student[n]).reshape(-1) for n in names])
        return (predicted - observed) / scale

    jacobian = torch.func.jacfwd(residual)  # rank² unknowns, (d + 1)·C residuals: forward mode
    dw, db = update.delta["classifier.weight"].double().cpu(), update.delta["classifier.bias"].double().cpu()
    best = None
    for start in _feature_starts(dw, db, basis, probs, hp.lr, images):
        fit = least_squares(lambda v: residual(torch.from_numpy(v)).numpy(), start.numpy(),
                            jac=lambda v: jacobian(torch.from_numpy(v)).numpy(), method="lm",
                            xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=200)
        value = float(np.linalg.norm(fit.fun))
        if best is None or value < best[0]:
            best = (value, fit.x)
        if value < FEATURE_TOLERANCE / 10:  # the update reproduced to its float32 rounding: no further start
            break
    value, a = best
    feats = (torch.from_numpy(a).reshape(rank, rank) @ basis.T).to(device=device, dtype=torch.float32)
    if value > FEATURE_TOLERANCE:
        return None, value, f"no features reproduce the classifier's update (residual {value:.1e})"
    return feats, value, "solved from the classifier's update"


def solve_classifier_step(obs: Observation, update, model, counts: torch.Tensor | None,
                          rank: int) -> tuple[torch.Tensor | None, float, str, torch.Tensor | None]:
    """``classifier_features`` for one image, with its label found too: ``counts`` (iDLG's reading) first,
    then, if no features under that label reproduce the update (at trained rounds the distillation term
    can outweigh the label's push on the classifier, and iDLG's rule misreads it), every other class in
    the order of that rule's score; the first label whose features reproduce the update is the image's
    (a wrong label leaves a residual of order 1; the true one float rounding). Returns (features, residual,
    how, the label's counts or None). Kept in ``obs.memo``: the attack and its forward check solve once."""
    key = ("classifier-step", rank, None if counts is None else tuple(counts.tolist()))
    if key in obs.memo:
        return obs.memo[key]
    feats, residual, how = classifier_features(obs, update, model, counts, rank)
    solved = counts if feats is not None else None
    if feats is None and counts is not None and int(counts.sum()) == 1 and "classifier.weight" in update.names:
        score = (-update.delta["classifier.weight"].double()).sum(dim=1)  # iDLG's: the lowest is its reading
        tried = [int(counts.argmax())]
        for k in score.argsort().tolist():
            if k in tried:
                continue
            tried.append(k)
            other = torch.nn.functional.one_hot(torch.tensor(k), obs.num_classes).to(counts)
            found, value, _ = classifier_features(obs, update, model, other, rank)
            if found is not None:
                feats, residual, solved = found, value, other
                how = f"solved from the classifier's update under class {k} ({len(tried)} labels tried)"
                break
    obs.memo[key] = (feats, residual, how, solved)
    return obs.memo[key]


def extractor_images(method, hp: LocalHyperparameters | None) -> int:
    """How many images (augmented copies included) the extractor's steps of the victim setting train on,
    all steps together; 0 outside the victim setting."""
    if hp is None or hp.steps_per_phase is None:
        return 0
    samples = int(hp.samples if hp.samples is not None else hp.batch_size)
    return sum(int(hp.steps_per_phase) * samples * (2 if aug else 1)
               for p, _, aug in extractor_phases(method, hp.epochs))


def inverse_activation(module: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pre-activation, weight per entry) for the activation that follows the last linear layer: the
    identity, a LeakyReLU (inverted; negative entries weighted by its slope, so that the solve's error is
    measured in the output's units) or a ReLU (its positive entries only); None for any other."""
    if module is None or isinstance(module, nn.Identity):
        return z, torch.ones_like(z)
    if isinstance(module, nn.LeakyReLU) and module.negative_slope > 0:
        slope = float(module.negative_slope)
        return torch.where(z >= 0, z, z / slope), torch.where(z >= 0, 1.0, slope).to(z.dtype)
    if isinstance(module, nn.ReLU):
        return z, (z > 0).to(z.dtype)
    return None


def extractor_linear_input(update, model, features: torch.Tensor, rank: int, images: int = 1,
                           labels: torch.Tensor | None = None) -> tuple[torch.Tensor | None, float, str]:
    """(candidates (k, in_features), relative residual, how) or (None, residual, why not): the input of the
    extractor's last linear layer for the client's image, from the solved features z = act(W a + b) (under
    the extractor the classifier phase ran on, which must be the one the extractor phase started from:
    round 0) and that layer's update, whose rows span the inputs of every image the extractor's steps
    trained on (``rank`` of them): a = V c, with W V c + b = act⁻¹(z), weighted least squares in c (d
    equations, rank unknowns). The solved feature rows are the image's and its augmented copy's, in an
    order the update does not fix; a row whose input lies in the span (residual ≤
    ``LINEAR_INPUT_TOLERANCE``) is a candidate for the image's: usually the image's alone (the extractor
    phase drew its copies afresh), both where the copies coincide (e.g. a flip drawn in every phase).
    Every row gets a candidate, the best one standing in for a row outside the span (one shape for
    every target), and the attack matches the nearest. Several ``images`` (``labels``: each solved row's
    label): one input per image instead (``_inputs_per_image``)."""
    found = last_linear_layer(model)
    if found is None:
        return None, float("nan"), "the extractor does not end in a linear layer"
    position, child = found
    children = list(model.extractor.children())
    activation = children[position + 1] if position + 1 < len(children) else None
    weight, bias = f"extractor.{child}.weight", f"extractor.{child}.bias"
    if weight not in update.names or bias not in update.names:
        return None, float("nan"), "the extractor's last linear layer is not in the update"
    dw = update.delta[weight].double().cpu()
    if not 0 < rank < min(dw.shape):
        return None, float("nan"), f"its update cannot have rank {rank}"
    basis = row_space(dw, rank).double()  # (in_features, rank)
    w, b = update.before[weight].double().cpu(), update.before[bias].double().cpu()
    solved = []
    for z in features.double().cpu():
        inverted = inverse_activation(activation, z)
        if inverted is None:
            return None, float("nan"), f"the layer is followed by {type(activation).__name__}, not inverted"
        target, rows = inverted
        system = rows.unsqueeze(1) * (w @ basis)
        c = torch.linalg.lstsq(system, (rows * (target - b)).unsqueeze(1)).solution[:, 0]
        residual = float((system @ c - rows * (target - b)).norm() / (rows * z).norm().clamp_min(1e-300))
        solved.append((residual, basis @ c))
    if images > 1:
        return _inputs_per_image(solved, labels, images, update.delta[weight].device)
    best = min(solved, key=lambda r: r[0])
    if best[0] > LINEAR_INPUT_TOLERANCE:
        return None, best[0], f"no solved feature has its layer input in the update's span (residual {best[0]:.1e})"
    solved.sort(key=lambda r: r[0])  # the best first: the rebuilt start (``GradientMatcher.closed_form_start``) uses it
    candidates = torch.stack([a if residual <= LINEAR_INPUT_TOLERANCE else best[1] for residual, a in solved])
    inside = sum(residual <= LINEAR_INPUT_TOLERANCE for residual, _ in solved)
    how = "solved from the features and the layer's update" + (f" ({inside} candidates)" if inside > 1 else "")
    return candidates.to(device=update.delta[weight].device, dtype=torch.float32), best[0], how


def _inputs_per_image(solved: list[tuple[float, torch.Tensor]], labels: torch.Tensor, images: int,
                      device) -> tuple[torch.Tensor | None, float, str]:
    """``extractor_linear_input`` for several images: (inputs (images, in_features) in the order of the
    first ``images`` rows' labels, the largest residual, how), each image taking the unused solved row of
    its label whose input lies nearest the update's span (its own: the extractor phase trained on the
    image, not on the classifier phase's copy of it); None where one of them lies outside it."""
    used, chosen = set(), []
    for slot in range(images):
        rows = [i for i in range(len(solved)) if i not in used and int(labels[i]) == int(labels[slot])]
        i = min(rows, key=lambda r: solved[r][0])
        used.add(i)
        chosen.append(solved[i])
    worst = max(residual for residual, _ in chosen)
    if worst > LINEAR_INPUT_TOLERANCE:
        return None, worst, (f"an image's solved features have no layer input in the update's span "
                             f"(residual {worst:.1e})")
    inputs = torch.stack([a for _, a in chosen]).to(device=device, dtype=torch.float32)
    return inputs, worst, f"solved from the features and the layer's update for each of the {images} images"


def arrangements(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(P, B, in_features): the orders of B images' layer ``inputs`` that keep each slot's label (the
    update does not order images of one label), the first ``MAX_ARRANGEMENTS`` of them, padded with the
    first to P = min(B!, MAX_ARRANGEMENTS), one shape for every target of B images."""
    blocks = [[i for i in range(len(labels)) if int(labels[i]) == k] for k in dict.fromkeys(labels.tolist())]
    orders = []
    for parts in itertools.islice(itertools.product(*[itertools.permutations(b) for b in blocks]), MAX_ARRANGEMENTS):
        order = [0] * len(labels)
        for block, part in zip(blocks, parts):
            for slot, row in zip(block, part):
                order[slot] = row
        orders.append(order)
    size = min(math.factorial(len(labels)), MAX_ARRANGEMENTS)
    orders += [orders[0]] * (size - len(orders))
    return torch.stack([inputs[order] for order in orders])


def classifier_images(method, hp: LocalHyperparameters | None) -> int:
    """How many images (augmented copies included) one classifier step of the victim setting trains
    on, when the classifier phase is one step; else 0."""
    if hp is None or hp.steps_per_phase is None or int(hp.steps_per_phase) != 1:
        return 0
    phases = [aug for p, _, aug in local_phases(method, hp.epochs) if p == "classifier"]
    samples = int(hp.samples if hp.samples is not None else hp.batch_size)
    return samples * (2 if phases[0] else 1) if len(phases) == 1 else 0


def round_to_total(values: torch.Tensor, total: int) -> torch.Tensor:
    """Non-negative integers summing to ``total``, by largest remainders of ``values`` clamped at 0."""
    values = values.double().clamp_min(0.0)
    if float(values.sum()) > 0:
        values = values * total / values.sum()
    counts = values.floor().to(torch.int64)
    order = (values - counts).argsort(descending=True)
    for k in order[:max(0, total - int(counts.sum()))].tolist():
        counts[k] += 1
    return counts


def label_counts(obs: Observation, update, model) -> tuple[torch.Tensor | None, str]:
    """(per-class label counts of the images one step trained on, how) or (None, why not)."""
    hp = obs.known_hyperparameters
    if hp is None or hp.steps_per_phase is None or int(hp.steps_per_phase) != 1:
        return None, "needs one step of known hyperparameters"
    b = int(hp.samples if hp.samples is not None else hp.batch_size)
    counts = obs.upload.get("class_counts")
    if counts is not None and counts.numel() == obs.num_classes:
        return round_to_total(counts.to(torch.float64), b), "uploaded class counts"
    if b == 1 and "classifier.weight" in update.names:  # iDLG's rule: the one row the step pushed up
        rows = (-update.delta["classifier.weight"].double()).sum(dim=1)
        return torch.nn.functional.one_hot(rows.argmin(), obs.num_classes), "iDLG rule (one image)"
    if "classifier.bias" not in update.names or "classifier.bias" not in obs.download:
        return None, "no step of a downloaded classifier with a bias"
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return None, "a BatchNorm model has no prediction for one image on its own (batch statistics)"
    if "classifier-features" in declared_facts(obs.method):
        return _classifier_step_counts(obs, update, model, b)
    if not trains_plain_sgd(obs.method):
        return None, "no plain step of a downloaded classifier with a bias"
    predicted = _mean_prediction(obs, model, update.before)
    raw = b * (predicted + update.delta["classifier.bias"].double() / (hp.lr * int(hp.steps)))
    return round_to_total(raw, b), "classifier bias update, mean prediction at the pixel-mean image"


def _mean_prediction(obs: Observation, model, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The softmax prediction of ``model`` under ``params`` at the public pixel-mean image (C,), float64."""
    model = copy.deepcopy(model)
    model.load_state_dict({**model.state_dict(), **params}, strict=False)
    with torch.no_grad():
        mean_image = model.normalize.mean.reshape(1, -1, 1, 1).expand(1, *obs.image_shape)
        return torch.softmax(model(mean_image.to(torch.float32)), dim=-1)[0].double()


def _classifier_step_counts(obs: Observation, update, model, images: int) -> tuple[torch.Tensor | None, str]:
    """The images' counts where the classifier phase is one step of ``ClassifierStep`` (FedeCouple):
    from that step's bias update as for a plain step, over the rows it trained on (the images and their
    augmented copies, which share their labels), the mean prediction that of the client's kept extractor
    and its classifier before the step. The distillation term adds nothing to the bias gradient where the
    personal classifier equals the teacher (round 0); where the feature solve runs (the method mode) it
    checks them (``_solve_features`` drops counts under which no features reproduce the update)."""
    rows = classifier_images(obs.method, obs.known_hyperparameters)
    if rows == 0 or rows % images:
        return None, "needs one classifier step of known hyperparameters"
    initial = {n: p.detach() for n, p in model.named_parameters()}
    kept = {n: v for n, v in kept_model(obs, initial).items() if n.startswith("extractor.")}
    classifier = {n: v for n, v in update.before.items() if n.startswith("classifier.")}
    predicted = _mean_prediction(obs, model, {**kept, **classifier})
    raw = rows * (predicted + update.delta["classifier.bias"].double() / obs.known_hyperparameters.lr)
    return (round_to_total(raw / (rows // images), images),
            "the classifier step's bias update over its images and their copies, mean prediction at the "
            "pixel-mean image")


def _linear_input_from_features(obs: Observation, update, model, out: ClosedForm) -> LastLinear | None:
    """``extractor_linear_input`` as a matched ``LastLinear`` (with the method's own replay: not head-free),
    recorded in ``out``'s trace and notes; None where it does not apply."""
    found = last_linear_layer(model)
    kept = kept_model(obs, {n: p.detach() for n, p in model.named_parameters() if n.startswith("extractor.")})
    if found is None or any(not torch.equal(kept[n].to(v), v) for n, v in update.before.items() if n in kept):
        out.notes.append("closed form: the extractor's last linear input is not solved: the classifier phase "
                         "ran on another extractor than the one the extractor phase started from")
        return None
    rank = extractor_images(obs.method, obs.known_hyperparameters)
    images = int(out.label_counts.sum())
    labels = torch.repeat_interleave(torch.arange(len(out.label_counts)), out.label_counts.cpu())
    rows = labels.repeat(len(out.classifier_features) // images)  # the solved rows' labels
    a, residual, how = extractor_linear_input(update, model, out.classifier_features, rank, images, rows)
    out.trace["extractor_linear_input"] = {"rank": rank, "residual": residual, "how": how, "weight": LINEAR_INPUT_WEIGHT}
    if a is None:
        out.notes.append(f"closed form: the extractor's last linear input is not solved ({how})")
        return None
    position, child = found
    below = _names_below(model, update, position)
    which = "the image" if images == 1 else f"each of the {images} images"
    out.notes.append(f"closed form: the input of extractor.{child} for {which} is solved from its solved features "
                     f"and the layer's update (rank {rank}: every image the extractor phase trained on; residual "
                     f"{residual:.1e}) and matched")
    return LastLinear(position, f"extractor.{child}.weight", f"extractor.{child}.bias", below,
                      a if images == 1 else arrangements(a, labels), False, residual, LINEAR_INPUT_WEIGHT, images)


def _solve_features(obs: Observation, update, model, out: ClosedForm, rank: int) -> None:
    """The classifier step's features (``solve_classifier_step``) into ``out``, with the label the solve
    found for one image; for several images, counts read from the classifier step's bias update
    (``_classifier_step_counts``) are dropped where no features under them reproduce the update."""
    feats, residual, how, solved = solve_classifier_step(obs, update, model, out.label_counts, rank)
    out.trace["classifier_features"] = {"rank": rank, "residual": residual, "how": how}
    if solved is not None and not torch.equal(solved.cpu(), out.label_counts.cpu()):
        out.notes.append(f"closed form: the label is class {int(solved.argmax())}, the one whose classifier-step "
                         f"features reproduce the update, not class {int(out.label_counts.argmax())} "
                         f"({out.trace['label_counts_source']})")
        out.label_counts = solved
        out.trace["label_counts"] = solved.tolist()
        out.trace["label_counts_source"] = "the classifier-step solve (the one label that reproduces the update)"
    if feats is None:
        out.notes.append(f"closed form: the classifier step's features were not solved ({how})")
        if out.trace["label_counts_source"].startswith("the classifier step's bias update"):
            out.label_counts, out.trace["label_counts"] = None, None
            out.notes.append("closed form: the label counts read from the classifier step's bias update are not "
                             "used: no features under them reproduce the update")
        return
    out.classifier_features = feats
    images = int(out.label_counts.sum())
    which = (f"the image{' and its augmented copy' if rank == 2 else ''}" if images == 1
             else f"the {images} images{' and their augmented copies' if rank > images else ''}")
    out.notes.append(f"closed form: the features of the {rank} image(s) the classifier step trained on ({which}) are "
                     f"solved from the classifier's update (relative residual {residual:.1e}); attack.csv's "
                     f"input_error is their error against the images' true features. They are reported, not "
                     f"matched: matching them did not lift IG on the tuning federation")


def derive(obs: Observation, update, model, mode: str) -> ClosedForm:
    """The closed-form facts ``obs.method`` declares (``Replay.closed_form``) that this observation
    holds, from the observation alone (``update``: its ``attacks.inversion.observation.UpdateTarget``)."""
    declared = declared_facts(obs.method)
    out = ClosedForm(trace={"declared": list(declared)})
    if "last-linear" in declared:
        out.last_linear, notes = _last_linear(obs, update, model)
        out.notes += notes
        if out.last_linear is not None and out.last_linear.images > 1:
            ll = out.last_linear
            out.trace["last_linear"] = {"layer": ll.weight.rsplit(".", 1)[0], "rank_residual": ll.residual,
                                        "head_free": True, "images": ll.images}
            out.notes.append(f"closed form: one step on {ll.images} images with a head the server does not hold: "
                             f"the update of {ll.weight.rsplit('.', 1)[0]} is of rank {ll.images} (residual "
                             f"{ll.residual:.1e}); each image's error signal there is solved from it by least "
                             f"squares for the dummy's inputs, so the unknown head is fitted exactly, not stood in")
        elif out.last_linear is not None:
            ll = out.last_linear
            out.trace["last_linear"] = {"layer": ll.weight.rsplit(".", 1)[0], "rank1_residual": ll.residual,
                                        "head_free": ll.head_free, "weight": LAST_LINEAR_WEIGHT}
            out.notes.append(f"closed form: one step on one image: the input of {ll.weight.rsplit('.', 1)[0]} is "
                             f"read from its update (weight row / bias entry, rank-1 residual {ll.residual:.1e}) "
                             f"and matched" + ("; the head enters the base's update only through that layer's "
                                               "error signal, also read from the update: no head is needed"
                                               if ll.head_free else ""))
    out.label_counts, how = label_counts(obs, update, model)
    out.trace["label_counts"] = None if out.label_counts is None else out.label_counts.tolist()
    out.trace["label_counts_source"] = how
    rank = classifier_images(obs.method, obs.known_hyperparameters)
    usable = mode == "method" and "classifier.weight" in update.names \
        and 0 < rank < min(update.delta["classifier.weight"].shape)
    if "classifier-features" in declared and usable:
        _solve_features(obs, update, model, out, rank)
    if "extractor-linear-input" in declared and out.classifier_features is not None and out.last_linear is None:
        out.last_linear = _linear_input_from_features(obs, update, model, out)
    if "classifier-row-space" in declared and usable:
        out.row_space_rank = rank
        out.trace["row_space"] = {"rank": rank, "weight": ROW_SPACE_WEIGHT}
        out.notes.append(f"closed form: the classifier's weight update spans the features it was trained on "
                         f"(rank {rank}): the dummy's features under the client's kept extractor are held to it")
    if "statistics" in declared and mode == "method":
        out.feature_means = _feature_means(obs, model.feature_dim)
        if out.feature_means:
            out.trace["feature_means"] = {"fields": [f.field for f in out.feature_means], "weight": STATISTICS_WEIGHT}
            out.notes.append("closed form: the uploaded " + " and ".join(f.field for f in out.feature_means)
                             + " are class-mean features under the downloaded and the uploaded extractor: the "
                               "dummy's are matched to them")
    return out
