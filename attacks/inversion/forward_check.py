"""Whether an attack's forward model was right: checked after the attack, with the ground truth
the harness hands in (never seen by the attack itself).

Two checks per target:

* ``replay_cosine`` / ``replay_relative_error``: the method's replay (``Replay.replay``) run on the
  client's true images, true batch order and true augmentation draws, against the update the
  server observed: cosine and relative error of Δ over the attacked weights. About 1 (and 0) when
  the replay is the client's computation; this measures the method's replay, not the attack's
  guesses. Where the attack used a head-free closed form (``attacks.inversion.closed_form``) instead of the
  replay, that computation on the true image.
* ``objective_truth`` / ``objective_reconstruction``: the attack's own data-matching term (DLG's
  distance, IG's 1 − cosine; the image prior is left out so that a smoothness prior cannot decide
  it) evaluated at the truth — the true images, the augmented copies the client really trained on
  (whatever model of the copies the attack uses: free images, or the augmentation family, which
  holds torchvision's draws only approximately), the true labels — and at the reconstruction. ``mis_specified`` is True
  when the truth matches the observation worse than the reconstruction does: then the optimum of
  what the attack minimises is not the client's data, and a low PSNR says nothing about privacy.
  ``not_converged`` is the other way round: the truth matches better than the reconstruction, so
  the optimiser stopped short of an answer its own objective prefers; the PSNR is then a lower
  bound set by the attack's budget, not by the method. Both need the larger term above a floor:
  ``OBJECTIVE_FLOOR``, or twice what the upload's own float32 rounding gives (``rounding_floor``),
  whichever is higher; below it the two are a tie.

Where the forward model has parts the server does not hold and the attack fits them (a private head
after round 0: ``GradientMatcher.private_names``, or the head-free closed form's error signals), the
check judges the **fitted** model: the reconstruction's term at the parameters the attack fitted, the
truth's with those parameters fitted again to the true images (``fit_unknowns``, from the attack's fit
and from the stand-in; the head-free closed form refits its signals for any images by construction).
The client's true head is not used: the question is whether the objective the attack minimises (over
the images *and* the head) prefers the truth, so both sides are taken at their own best head; scoring
the truth at the true head and the reconstruction at a fitted one would compare two objectives. The
fit is local (L-BFGS from two starts), so the truth's term is an upper bound on its best head's: a
fit that falls short can call a right model mis-specified, never hide a wrong one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fedecouple.methods.facets import Replay
from fedecouple.methods.replay import Step
from fedecouple.methods.replay import features as replay_features

from ..base import AttackResult, Observation
from .observation import UpdateTarget, update_target
from .forward_model import GradientMatcher, batch_augmenter, replay_context
from .optimise import fit_unknowns, iterations_for
from .prototypes import choose_extractor, set_objective, uploaded_prototypes, uploads_extractor

# below this the matching term is float rounding: a truth and a reconstruction both at it are equal
OBJECTIVE_FLOOR = 1e-6
# a term below this multiple of what the upload's own float32 rounding gives (``rounding_floor``) is a
# tie as well: a client whose update is a few ulps of its weights shows the truth at that term
ROUNDING_MARGIN = 2.0


def replay_on_truth(obs: Observation, images: torch.Tensor, labels: torch.Tensor,
                    records: list) -> tuple[dict, UpdateTarget]:
    """(the method's replay of the client's local training on the truth: its true images, batch order and
    augmentation draws (``BatchRecord``s), the observed update ``update_target(obs)``)."""
    target = update_target(obs)
    steps = [Step(r.phase, tuple(int(p) for p in r.positions)) for r in records]
    context = replay_context(obs, target.before, steps)
    augmenter = batch_augmenter(images.shape[-1])
    copies = [None if r.draws is None else augmenter.apply(images[torch.from_numpy(r.positions)], r.draws)
              for r in records]
    with torch.no_grad():
        return obs.method.replay(obs.make_model(), context, images, labels, copies), target


def update_agreement(simulated: dict, target: UpdateTarget) -> tuple[float, float]:
    """(cosine, relative error) of a simulated upload's update against the observed one, over the
    attacked weights, in float64."""
    a = torch.cat([(simulated[n] - target.before[n]).reshape(-1).double() for n in target.names])
    b = torch.cat([target.delta[n].reshape(-1).double() for n in target.names])
    return float(F.cosine_similarity(a, b, dim=0)), float((a - b).norm() / b.norm().clamp_min(1e-30))


def replay_agreement(obs: Observation, images: torch.Tensor, labels: torch.Tensor, records: list) -> dict:
    """The method's replay on the truth against the observed update: {"replay_cosine",
    "replay_relative_error"} (None where the method has no replay or the server does not know the
    learning rate). At float32 a replay of many steps through a piecewise-linear network can part from
    the client where a pre-activation lies within the rounding of a kink: a cosine a little below 1 after
    many steps is that, not a wrong model (``tests/test_replay.py`` holds the model at float64)."""
    if not isinstance(obs.method, Replay) or obs.known_hyperparameters is None:
        return {"replay_cosine": None, "replay_relative_error": None}
    cosine, relative = update_agreement(*replay_on_truth(obs, images, labels, records))
    return {"replay_cosine": cosine, "replay_relative_error": relative}


def head_free_agreement(matcher: GradientMatcher, images: torch.Tensor) -> dict:
    """``replay_agreement`` for a head-free closed form (``attacks.inversion.closed_form``): its update on the
    client's true image (the signal read from the observed update) against the observed update."""
    with torch.no_grad():
        dummy = matcher.dummy(images, torch.zeros(len(images), dtype=torch.int64))
    n = len(matcher.names)
    a = torch.cat([d.reshape(-1).double() for d in dummy[:n]])
    b = torch.cat([t.reshape(-1).double() for t in matcher.target[:n]])
    return {"replay_cosine": float(F.cosine_similarity(a, b, dim=0)),
            "replay_relative_error": float((a - b).norm() / b.norm().clamp_min(1e-30))}


def slot_positions(matcher: GradientMatcher, n: int, records: list) -> list[int] | None:
    """For each of the attack's dummy images (slots), the position in the client's training set of the
    image the client really used there: the image itself where the slots are the images (victim
    setting, oracle, plain modes); in real local training, the image at that place of the client's
    true batch. None when the attack's steps do not line up with the client's."""
    slots = matcher.originals if matcher.originals is not None else n
    hp = matcher.hyperparameters
    # real local training laid out by the attack (``plan_layout``): slot s is the image at place s of
    # the client's shuffle, even when the slots are as many as the images (one epoch, n a multiple of
    # the batch size); taking slot s for image s there scored the truth in the wrong batches
    shuffled = (hp is not None and hp.steps_per_phase is None and matcher.originals is not None
                and getattr(matcher.observation, "known_schedule", None) is None)
    if not shuffled and matcher.epoch_copies == 1 and slots == n:
        return list(range(n))
    steps = matcher.context.steps if matcher.mode == "method" else None
    if steps is None:  # the plain replay (``GradientMatcher._replay``): batches of min(bs, slots), cycling
        bs = max(1, min(matcher.hyperparameters.batch_size, slots))
        steps = [Step("plain", tuple(range((i * bs) % slots, min((i * bs) % slots + bs, slots))))
                 for i in range(len(records))]
    where = [-1] * slots
    for step, record in zip(steps, records):
        if len(record.positions) != len(step.members):
            return None
        for slot, position in zip(step.members, record.positions.tolist()):
            where[slot] = int(position)
    return None if min(where, default=0) < 0 else where


def true_copies(matcher: GradientMatcher, images: torch.Tensor, records: list, where: list[int]) -> list | None:
    """The augmented copies the client really trained on, laid out as the attack's steps: for each
    augmented step, each member's recorded draw applied to its true image (``where``: slot →
    position). None without copies."""
    if matcher.mode != "method" or not any(matcher.augmented):
        return None
    augmenter, copies = batch_augmenter(images.shape[-1]), []
    for i, (step, augmented) in enumerate(zip(matcher.context.steps, matcher.augmented)):
        record = records[i] if i < len(records) else None
        if not augmented:
            copies.append(None)
            continue
        rows = []
        for m in step.members:
            p = where[m]
            j = [] if record is None or record.draws is None else [k for k, q in enumerate(record.positions) if q == p]
            rows.append(augmenter.apply(images[p:p + 1], [record.draws[j[0]]])[0] if j else images[p])
        copies.append(torch.stack(rows))
    return copies


def matching_term(matcher: GradientMatcher, kind: str, images: torch.Tensor, label_probs: torch.Tensor,
                  copy_parameters: torch.Tensor | None = None, copies: list | None = None,
                  private: torch.Tensor | None = None) -> float:
    """The attack's data-matching term at (images, label probability rows, the copies' family
    parameters or the copies themselves, and the fitted private parameters)."""
    with torch.no_grad():
        return float(_term(matcher, kind, images, label_probs, copy_parameters, copies, private))


def _term(matcher: GradientMatcher, kind: str, images, label_probs, copy_parameters, copies, private) -> torch.Tensor:
    dummy = matcher.dummy(images, label_probs, copy_parameters, copies, private=private)
    target = [t.detach() for t in matcher.target]
    return matcher.l2_objective(dummy, target) if kind == "l2" else matcher.cosine_objective(dummy, target)


def fitted_truth_term(matcher: GradientMatcher, kind: str, images: torch.Tensor, label_probs: torch.Tensor,
                      copies: list | None, fitted: torch.Tensor | None) -> float:
    """The matching term at the true images with the private parameters fitted to them (module
    docstring): the lower of the fits from the attack's ``fitted`` parameters and from the stand-in."""
    starts = [matcher.private_start()] + ([] if fitted is None else [fitted.to(matcher.private_start().device)])
    _, value = fit_unknowns(lambda u: _term(matcher, kind, images, label_probs, None, copies, u), starts,
                            iterations_for(len(images)))
    return value


def rounding_floor(matcher: GradientMatcher, kind: str) -> float:
    """The matching term the upload's float32 rounding alone gives: the observed update with each
    uploaded weight moved by a seeded uniform draw within half its ulp, scored against the update.
    Near the truth no objective can tell apart what lies below it (e.g. a trained FedPer client whose
    update is 1e-5 of weights of norm 8: rounding is 2 % of the update)."""
    generator = torch.Generator().manual_seed(0)
    perturbed = list(matcher.target)
    extras = len(matcher.extra_weights)  # closed-form terms: compared (kept equal: 0) or values (set to 0)
    for j in range(matcher.extra_values, extras):
        perturbed[len(perturbed) - extras + j] = torch.zeros(())
    for i, name in enumerate(matcher.names):
        delta = matcher.update.delta[name]
        uploaded = (matcher.update.before[name] + delta).abs()
        ulp = torch.nextafter(uploaded, torch.full_like(uploaded, float("inf"))) - uploaded
        norm = float(delta.norm())
        if norm == 0.0:
            continue
        draw = torch.rand(uploaded.shape, generator=generator, dtype=torch.float32).to(uploaded.device) - 0.5
        # the target is the update up to one factor (1, or -1/lr for a gradient): scale the noise alike
        perturbed[i] = perturbed[i] + draw * ulp * (float(perturbed[i].norm()) / norm)
    with torch.no_grad():
        target = [t.detach() for t in matcher.target]
        value = matcher.l2_objective(perturbed, target) if kind == "l2" else matcher.cosine_objective(perturbed, target)
    return float(value)


def check(obs: Observation, mode: str, kind: str, result: AttackResult, images: torch.Tensor, labels: torch.Tensor,
          records: list) -> dict:
    """Both checks for one target (see the module docstring). ``images``/``labels``: the client's
    training set in its own order; ``records``: its batches."""
    out = replay_agreement(obs, images, labels, records)
    matcher = GradientMatcher(obs, mode)
    rebuilt = result.variables.get("images")
    where = slot_positions(matcher, len(images), records)
    if rebuilt is None or result.variables.get("labels") is None or where is None \
            or rebuilt.shape[0] - matcher.free_copies != len(where):
        # the attack's dummy images do not correspond to the client's: no truth to compare
        return {**out, "objective_truth": None, "objective_reconstruction": None, "mis_specified": None,
                "not_converged": None}
    index = torch.tensor(where, device=images.device)
    if matcher.labels_unused:  # the head-free closed form is the forward model the attack used
        out = head_free_agreement(matcher, images[index])
    truth_labels = F.one_hot(labels[index], obs.num_classes).to(torch.float32)
    copies = true_copies(matcher, images, records, where)
    fitted = result.variables.get("private")
    # an attack that kept the stand-in (no fitted parameters) is judged with it: that is its forward model
    truth = (fitted_truth_term(matcher, kind, images[index], truth_labels, copies, fitted)
             if matcher.private_size and fitted is not None
             else matching_term(matcher, kind, images[index], truth_labels, copies=copies))
    reconstruction = matching_term(matcher, kind, rebuilt, result.variables["labels"],
                                   result.variables.get("copy_parameters"), private=fitted)
    floor = max(OBJECTIVE_FLOOR, ROUNDING_MARGIN * rounding_floor(matcher, kind))
    out["input_error"] = classifier_feature_error(matcher, images[index])
    return {**out, "objective_truth": truth, "objective_reconstruction": reconstruction,
            "mis_specified": bool(truth > reconstruction and truth > floor),
            "not_converged": bool(reconstruction > truth and reconstruction > floor)}


def classifier_feature_error(matcher: GradientMatcher, images: torch.Tensor) -> float | None:
    """The relative error of the classifier step's features the closed form solved
    (``attacks.inversion.closed_form.classifier_features``) against the true image's features under the
    kept extractor that step ran on, its nearest solved row (the image or its copy: the update does not
    order them); with several images the largest over them; None where none were solved."""
    solved = matcher.closed.classifier_features
    if solved is None:
        return None
    with torch.no_grad():
        truth = replay_features(matcher.model, matcher.context.kept, images)
    errors = (solved.unsqueeze(0) - truth.unsqueeze(1)).norm(dim=2) / truth.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return float(errors.min(dim=1).values.max())


def prototype_check(obs: Observation, result: AttackResult, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """The forward check of prototype inversion (``attacks.inversion.proto``; its objective is
    ``attacks.inversion.prototypes.set_objective``): per inverted class, its data term
    (the objective without TV) at the client's true images of that class (their mean feature is the
    prototype when the extractor is the one that computed it) against the kept set's; summed over
    the classes. ``mis_specified``: the truth matches worse than the reconstruction (the inverted
    extractor is not the one the server holds, or its reading is wrong); ``not_converged``: the
    optimiser stopped short of the truth.

    ``model_unknown`` (the NO MODEL verdict): the method uploads no extractor
    (``prototypes.uploads_extractor``; FedProto), so the server holds no model of the client and
    inverted with one of its own (the initial model, the one it sent, or a surrogate). There is no
    forward model of what the server holds to check: ``mis_specified`` is False, ``not_converged``
    None; the two objectives are kept (the initial or sent model; a surrogate, trained per attack,
    is not fitted again) to show how far that model is from the client's."""
    empty = {"replay_cosine": None, "replay_relative_error": None, "objective_truth": None,
             "objective_reconstruction": None, "mis_specified": None, "not_converged": None}
    reconstruction = result.trace.get("data_term_per_class")
    unknown = not uploads_extractor(obs.manifest())
    verdict = {"model_unknown": unknown, **({"mis_specified": False} if unknown else {})}
    if reconstruction is None or result.trace.get("extractor_source") == "surrogate":
        return {**empty, **verdict}
    truth = _prototype_truth(obs, result, images, labels)
    if truth is None:
        return {**empty, **verdict}
    rebuilt = float(sum(reconstruction))
    out = {**empty, "objective_truth": truth, "objective_reconstruction": rebuilt}
    if unknown:
        return {**out, **verdict}
    return {**out, **verdict, "mis_specified": bool(truth > rebuilt and truth > OBJECTIVE_FLOOR),
            "not_converged": bool(rebuilt > truth and rebuilt > OBJECTIVE_FLOOR)}


def _prototype_truth(obs: Observation, result: AttackResult, images: torch.Tensor, labels: torch.Tensor) -> float | None:
    """The data term at the client's true images of every inverted class, summed (None: a class the
    client's training set lacks)."""
    model, _, _ = choose_extractor(obs)
    protos = uploaded_prototypes(obs)
    truth = 0.0
    with torch.no_grad():
        for c in result.trace["classes"]:
            own = images[labels == int(c)]
            if len(own) == 0:
                return None
            truth += float(set_objective(model.eval(), own, protos[c].float().flatten(), 0.0))
    return truth
