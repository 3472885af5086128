"""Deep Leakage from Gradients (Zhu et al., 2019) and improved DLG (Zhao et al., 2020).

**DLG.** A dummy batch of images x (uniform noise in [0, 1], pixel space: the model normalises
inside) and dummy label logits ŷ (standard normal; the soft label is softmax(ŷ)) are optimised
jointly with L-BFGS (learning rate 1, torch's default of up to 20 function evaluations per step,
no line search, as in the paper's code) to minimise Σ_layers ‖∇W(x, ŷ) − ∇W(true)‖², the squared
distance between the dummy's gradient and the observed one (in the method mode: the sum over the
upload's weight groups and statistics of ‖a_g − b_g‖²/‖b_g‖², ``GradientMatcher.l2_objective``). ``budget.iterations`` is the number of
L-BFGS steps (the paper's 300), ``budget.restarts`` starts per target, and within a start the
lowest-objective iterate is returned (at least one step is taken). The first start runs to its end;
the others race by successive halving on the objective at equal step counts; the kept start is the
lowest objective, except that a first start rebuilt by the closed form (``_start``) is kept unless
another start's objective is ten times lower: among stalled starts a noise start's lower objective
was a worse image (``attacks.inversion.optimise.matching``). A start
stops early when it has converged (objective 1e-12 of its first value) or stalled (less than 1 %
improvement over 15 steps; this also ends a start whose L-BFGS has met its own gradient tolerance,
as every later step then returns at once): DLG on these models either converges or stalls. Pixels
are not constrained during the optimisation (as in DLG); the result is clamped to [0, 1].

The observed "gradient" comes from ``attacks.inversion.forward_model.GradientMatcher``: the upload's update
Δ read as g = −Δ/(lr·steps) ("scaled-gradient"), or T local SGD steps replayed on the dummy
("replay"). When the hyperparameters are unknown only the direction of Δ is known: the objective
then fits the scale in closed form, ‖a − s·b‖² with s = max(⟨a, b⟩, 0)/‖b‖².

**iDLG.** The label is read from the classifier's weight update by iDLG's sign rule
(``attacks.inversion.idlg_rule``; the trace records the row sums), then DLG runs with the label fixed.
The rule is read only from an update with one image's cross-entropy signature (``idlg_applies``);
otherwise, e.g. FedeCouple's personal classifier in a trained round, whose update is mostly its
distillation towards the global classifier, the label is optimised jointly and a note says why.
Without a classifier update (private head) iDLG falls back to DLG's joint label and says so.

**The optimisation** is the template's (``attacks.inversion.optimise.matching``): DLG declares its
objective, its L-BFGS (``RECIPE``) and its start. ``plan``/``plan_idlg`` prepare a list of
observations. Targets that share a model (``attacks.inversion.batching``) are optimised together:
torch's L-BFGS algorithm with one state per (target, start), vectorised (``BatchedLBFGS``), their
objectives evaluated by ``torch.func.vmap``, so a target's starts run concurrently with every other
target's. One target with one start (``dlg``, or a group of one) runs torch's own ``LBFGS``, which
``BatchedLBFGS`` reproduces.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.func import grad_and_value

from ..base import AttackResult, Budget, Observation
from ..choices import STARTS
from .batching import Batch, plan_by_model
from ..registry import GRADIENT_HINT, WEIGHT_KINDS, ClientAttackSpec
from .forward_model import FAMILY_PARAMETERS, GradientMatcher
from .idlg_rule import IDLG_NOT_APPLICABLE, counted_labels, idlg_applies, idlg_labels, idlg_share
from .optimise import LBFGS, Recipe, generator, mean_image, mix_seed, normal, result_from_best, uniform, \
    with_closed_form
from .optimise.matching import lockstep_cost, optimise

# torch's L-BFGS at its defaults (learning rate 1, up to 20 evaluations per step, no line search). A start
# whose best objective improved by less than 1 % over the last 15 steps (up to 300 evaluations) is stopped:
# its best iterate is kept (DLG either converges or stalls on our models). Was 0.1 % over 25 steps: on the
# main job (FedeCouple, 8 targets) the same mean PSNR to 0.1 dB in 55 % of the time
RECIPE = Recipe("sum over the attacked weights of the squared distance of the dummy's update to the observed one",
                LBFGS(lr=1.0, stall_steps=15, stall_tolerance=1e-2), prior=None)
LBFGS_LR = RECIPE.optimiser.lr


@dataclass
class _Setup:
    """One target's attack, ready to optimise (a ``matching.Problem``): the matcher, its observed target,
    the fixed labels (iDLG) or None (joint soft label), and what goes into the result's trace and notes."""

    matcher: GradientMatcher
    target: list[torch.Tensor]
    labels: torch.Tensor | None
    shape: tuple[int, int, int, int]
    num_classes: int
    trace: dict
    notes: list[str]
    start_kind: str = "noise"

    def objective(self, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, target: list[torch.Tensor]) -> torch.Tensor:
        """DLG's objective for one target; ``y`` is the fixed labels or the label logits, ``z`` the
        augmented copies' family parameters ((0, 8) when there are none)."""
        soft = y if self.labels is not None else torch.softmax(y, dim=-1)
        return self.matcher.l2_objective(self.matcher.dummy(x, soft, z, target=target), target)

    @property
    def device(self):
        return self.matcher.observation.device

    @property
    def informed_first_start(self) -> bool:
        """Whether the first start is the closed form's image rather than a random draw (the kept
        start's rule, ``attacks.inversion.optimise.matching``)."""
        return self.matcher.has_closed_form_start

    @property
    def originals(self) -> int:
        """How many of the dummy images are reconstructions (the rest: free augmented copies)."""
        return self.shape[0] - self.matcher.free_copies

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Sizes of the flat variable's three parts: images, label logits (0 when fixed), copy parameters
        (and the fitted private parameters: ``GradientMatcher.z_size``)."""
        b, c, h, w = self.shape
        return b * c * h * w, 0 if self.labels is not None else self.originals * self.num_classes, \
            self.matcher.z_size

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(images, label logits or None, copy parameters) of flat variables (..., size)."""
        i, l, e = self.sizes
        lead = flat.shape[:-1]
        y = None if l == 0 else flat[..., i:i + l].reshape(*lead, self.originals, self.num_classes)
        z = flat[..., i + l:i + l + e]
        return (flat[..., :i].reshape(*lead, *self.shape), y,
                z if self.matcher.private_size else z.reshape(*lead, e // FAMILY_PARAMETERS, FAMILY_PARAMETERS))

    def gradient_and_value(self):
        """torch.func transform of ``objective``: (∂/∂x[, ∂/∂y], ∂/∂z), value."""
        return grad_and_value(self.objective, argnums=(0, 2) if self.labels is not None else (0, 1, 2))

    def start(self, seed: int, restart: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return _start(self, seed, restart)

    def result(self, best: dict | None, notes: list[str], trace: dict) -> AttackResult:
        return result_from_best(self.matcher, best, shape=self.shape, originals=self.originals,
                                num_classes=self.num_classes, notes=notes, setup_trace=self.trace, trace=trace)


def _labels(matcher: GradientMatcher, budget: Budget, fixed_labels: bool, b: int, notes: list[str],
            trace: dict) -> torch.Tensor | None:
    """The fixed labels (iDLG: the closed form's counts, else the sign rule) or None (a joint soft label),
    the label source in ``trace``, and why in ``notes``."""
    labels = None
    if matcher.labels_unused:
        labels = torch.zeros(b, dtype=torch.int64)
        trace["label_source"] = "none (the head-free closed form does not depend on the label)"
    elif fixed_labels and counted_labels(matcher, budget) is not None:
        labels = counted_labels(matcher, budget)
        trace["label_source"] = f"closed-form counts ({matcher.closed.trace['label_counts_source']})"
    elif fixed_labels:
        weight = matcher.classifier_weight_target()
        if weight is None:
            notes.append("no classifier update is available (private or excluded head): iDLG cannot read the "
                         "label, so the label is optimised jointly as in DLG")
        else:
            trace["classifier_row_sums"] = weight.detach().sum(dim=1).tolist()
            if b == 1 and not idlg_applies(weight):
                notes.append(IDLG_NOT_APPLICABLE)
                trace["idlg_share"] = idlg_share(weight)
            else:
                labels, label_notes = idlg_labels(weight, b)
                notes += label_notes
                trace["label_source"] = "idlg-rule"
    if labels is None:
        trace["label_source"] = "joint (soft label optimised with the image)"
    return labels


def _setup(obs: Observation, budget: Budget, mode: str, fixed_labels: bool, name: str) -> _Setup:
    matcher = GradientMatcher(obs, mode)
    notes = list(matcher.notes)
    b = matcher.originals or max(1, int(budget.batch))
    trace: dict = {"attack": name, "mode": matcher.mode, "attacked_parameters": list(matcher.names),
                   "optimizer": "L-BFGS", "lr": LBFGS_LR}
    trace["closed_form"] = matcher.closed.trace
    labels = _labels(matcher, budget, fixed_labels, b, notes, trace)
    if labels is not None:
        labels = labels.to(obs.device)
    if budget.start not in STARTS:
        raise ValueError(f"unknown start {budget.start!r}; choose one of: {', '.join(STARTS)}")
    trace["start"] = budget.start
    if matcher.has_closed_form_start:
        trace["start"] = f"closed form, then {budget.start}"
        notes.append("the first start is the image rebuilt from the closed form's input of the extractor's last "
                     "linear layer (attacks.inversion.layer_inputs); further starts as --start says")
    return _Setup(matcher, [t.detach() for t in matcher.target], labels, (b + matcher.free_copies, *obs.image_shape),
                  obs.num_classes, trace, notes, budget.start)


def _start(setup: _Setup, seed: int, restart: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A start's seeded dummy batch: images uniform in [0, 1] (or, with ``Budget.start`` "mean", the
    per-channel mean the model's normalisation carries), label logits standard normal (None when the
    labels are fixed), the copies' family parameters at the identity (and the private parameters at their
    stand-in: ``GradientMatcher.z_start``). The first start's image is the one
    the closed form rebuilt, where it rebuilt one (``GradientMatcher.closed_form_start``)."""
    gen = generator(mix_seed(seed, restart, 0xD16))
    device = setup.device  # drawn on the CPU: the same starts on every device
    x = uniform(setup.shape, gen, device)
    if setup.start_kind == "mean":
        x = mean_image(setup.matcher.model.normalize.mean, setup.shape)
    rebuilt = setup.matcher.closed_form_start if restart == 0 else None
    if rebuilt is not None:  # the image the closed form gives back; its augmented copies as drawn above
        x = with_closed_form(x, rebuilt)
    y = None if setup.labels is not None else normal((setup.originals, setup.num_classes), gen, device)
    return x, y, setup.matcher.z_start(device)


def _optimise(setups: Sequence[_Setup], budget: Budget, seeds: Sequence[int]) -> list[AttackResult]:
    """DLG's L-BFGS on targets that share a model (``setups[0]``'s), all at once (the template's
    ``optimise.matching``): up to ``budget.iterations`` steps from each of ``budget.restarts`` starts, the
    starts after the first raced by successive halving, the kept start by its rule, a start ended early
    when it converged, stalled or diverged."""
    return optimise(setups, RECIPE.optimiser, budget.iterations, budget.restarts, seeds)


def _run_dlg(obs: Observation, budget: Budget, seed: int, mode: str, fixed_labels: bool, name: str) -> AttackResult:
    return _optimise([_setup(obs, budget, mode, fixed_labels, name)], budget, [seed])[0]


def dlg(observation: Observation, budget: Budget, seed: int, mode: str = "auto") -> AttackResult:
    """DLG: image and soft label optimised jointly (see module docstring)."""
    return _run_dlg(observation, budget, seed, mode, fixed_labels=False, name="dlg")


def idlg(observation: Observation, budget: Budget, seed: int, mode: str = "auto") -> AttackResult:
    """iDLG: label from the classifier's weight-gradient rows, then DLG with the label fixed."""
    return _run_dlg(observation, budget, seed, mode, fixed_labels=True, name="idlg")


def _optimise_group(budget: Budget, setups: Sequence[_Setup], seeds: Sequence[int]) -> list[AttackResult]:
    return _optimise(setups, budget, seeds)


def plan(observations: Sequence[Observation], budget: Budget, mode: str = "auto", batched: bool = True, *,
         fixed_labels: bool = False, name: str = "dlg") -> tuple[list[Batch], dict]:
    """DLG (or iDLG with ``fixed_labels``) on many targets: one ``Batch`` per group of targets that
    share a model (``attacks.inversion.batching``), each optimised together by ``BatchedLBFGS``."""
    prepare = functools.partial(_setup, budget=budget, mode=mode, fixed_labels=fixed_labels, name=name)
    return plan_by_model(prepare, functools.partial(_optimise_group, budget), observations, batched)


def plan_idlg(observations: Sequence[Observation], budget: Budget, mode: str = "auto",
              batched: bool = True) -> tuple[list[Batch], dict]:
    return plan(observations, budget, mode, batched, fixed_labels=True, name="idlg")


# an L-BFGS step runs up to 20 evaluations, but most starts stall or converge and stop well before the
# budget: per budgeted step about 2.6 Adam steps in the main job's run (8 FedeCouple targets, 300 steps
# budgeted: 69 s of attack); the time estimate's factor
LBFGS_STEP_COST = 2.6
DLG = ClientAttackSpec("dlg", attack_one=dlg, plan=plan, default_victim_batch=1, applies_to=WEIGHT_KINDS,
                       scoring="images", needs="model weights", hint=GRADIENT_HINT, matching="l2",
                       estimate_step_factor=LBFGS_STEP_COST, estimate_starts=lockstep_cost)
IDLG = ClientAttackSpec("idlg", attack_one=idlg, plan=plan_idlg, default_victim_batch=1, applies_to=WEIGHT_KINDS,
                        scoring="images", needs="model weights", hint=GRADIENT_HINT, matching="l2",
                        estimate_step_factor=LBFGS_STEP_COST, estimate_starts=lockstep_cost)
