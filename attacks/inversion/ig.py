"""Inverting Gradients (Geiping et al., 2020).

Objective, for a dummy batch x in [0, 1] (pixel space; the model normalises inside):

    L(x) = 1 − cos(ĝ(x), g)  +  α·TV(x)

with ĝ and g the dummy's and the observed gradient-like update over *all attacked layers at once*
(one cosine of the concatenated vectors, the paper's "equal weights"), and TV the anisotropic
total variation, mean |x[i+1, j] − x[i, j]| + mean |x[i, j+1] − x[i, j]| (over batch and
channels). The cosine ignores the update's scale, so the attack works whether or not the learning
rate is known. ``g`` comes from ``attacks.inversion.forward_model.GradientMatcher`` (scaled-gradient, replay or
method mode, named in the trace); in the method mode ĝ and g are the replayed and the observed
update Δ, and each statistic the method uploads adds its relative squared error to the objective.

Optimisation as in the paper: Adam (lr 0.1, in pixel units) on the *sign* of the objective's
gradient, learning rate ×0.1 at 3/8, 5/8 and 7/8 of ``budget.iterations``, pixels projected to
[0, 1] after every step, ``budget.restarts`` starts from uniform noise: the first for every target,
the others (all stacked in one pass) only for the targets whose data term the first left above
``SOLVED_DATA_TERM``; the start with the lowest final objective kept. Where the closed form fixed the
input of the extractor's last linear layer for every rebuilt image, the first start's images are those
rebuilt from it (``GradientMatcher.closed_form_start``), as in DLG.

Final stage (``attacks.inversion.optimise.polish``), for every target whose kept data term is above the
forward check's floor and at most ``FINAL_STAGE_CEILING`` (near the truth): the data term alone (no
TV), from the kept start's images, by L-BFGS-B within [0, 1] through the model with its LeakyReLU
and max-pool kinks smoothed at decreasing temperatures and then exact, ``budget.iterations /
ITERATION_SHARE`` iterations per temperature; a target takes its new images only where its exact
data term fell (the trace's ``final_stage``). The targets of one
batch are one L-BFGS-B problem there (the sum of their data terms, each scaled to 1 at the start),
so unlike the first stage this stage's steps depend on the batch: batched and one-by-one runs can
end differently (neither ever raises a target's data term).

TV weight α = ``TV_WEIGHT`` = 0.01 (``attacks.inversion.optimise.IG_PRIOR``, where the choice is
explained): chosen on a *tuning* federation and reported on seed 0 (docs/attacks.md).

The optimisation is the template's (``attacks.inversion.optimise``): IG declares its objective, its
signed Adam and its prior (``RECIPE``); the Adam loop, the starts, the best-keeping and the final
stage's L-BFGS-B are the template's.

Many targets: ``plan`` groups the targets that share a model
(``attacks.inversion.batching``) as one stacked batch; Adam and the sign step are element-wise, so each target
gets the same optimisation as alone. One target is simply a batch of one.

Labels: for one image with a classifier update, iDLG's rule (``attacks.inversion.idlg_rule.idlg_labels``) where
the update has one image's cross-entropy signature (``idlg_applies``);
otherwise label logits are optimised jointly with the images (same optimiser), as in the authors'
code for batches.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..base import AttackResult, Budget, Observation
from .batching import Batch, plan_by_model, stack_targets
from ..registry import GRADIENT_HINT, WEIGHT_KINDS, ClientAttackSpec
from .forward_check import OBJECTIVE_FLOOR
from .forward_model import FAMILY_PARAMETERS, GradientMatcher, family_start
from .idlg_rule import IDLG_NOT_APPLICABLE, counted_labels, idlg_applies, idlg_labels, idlg_share
from .optimise.per_target import stacked_grad_and_value, stacked_value
from .optimise import (IG_ADAM, IG_PRIOR, ITERATION_SHARE, TEMPERATURES, BestOfStarts, Recipe, TotalVariation,
                       generator, mix_seed, normal, polish, result_from_best, run_adam, uniform, with_closed_form)

# in the last learning-rate phase, a target whose objective improved by less than 1e-3 (relative) over
# a window of max(10, iterations/20) steps has stopped moving: it stops there. (Watching from the
# second drop on, a stalled target taking its next drop early, cut the photographs' bench by a fifth
# at +0.3 dB but FedPAC's round-0 attack by 3.5 dB: its images still gain from the steps that follow)
RECIPE = Recipe("1 - cos(dummy update, observed update) over all attacked weights + TV",
                dataclasses.replace(IG_ADAM, stall_tolerance=1e-3), IG_PRIOR)
LR = RECIPE.optimiser.lr
TV_WEIGHT = RECIPE.prior.weight
# a target whose kept data term (the matching term, no prior) is at or below this needs no further
# start (tuning federation, seed 1, FedPAC round 0: the 4 of 8 reconstructions with a data term below
# 3e-3 were all above 44 dB, the 4 above it 18-44 dB)
SOLVED_DATA_TERM = 3e-3
# the final stage polishes only starts this near the truth. Tuning federation (seed 1): on FedPAC it took data terms of 4e-7 to 4e-4 lower (2 of 8 to the forward check's floor,
# +0.9 dB mean), but the one FedPAC target above 3e-3 (8e-3, 35.8 dB: another basin) and FedeCouple's 8
# targets (DA on, 6e-3 to 4e-2) fell by a third or less with their PSNR unchanged (19.16 dB both ways),
# for 30 % more time on FedeCouple
FINAL_STAGE_CEILING = SOLVED_DATA_TERM


@dataclass
class _Setup:
    matcher: GradientMatcher
    target: list[torch.Tensor]  # the observed update (and, in the method mode, uploaded statistics)
    labels: torch.Tensor | None  # fixed labels (iDLG's rule) or None (label logits optimised jointly)
    notes: list[str]
    trace: dict


def _setup(observation: Observation, budget: Budget, mode: str, tv_weight: float, lr: float) -> _Setup:
    matcher = GradientMatcher(observation, mode)
    notes = list(matcher.notes)
    trace: dict = {"mode": matcher.mode, "attacked_parameters": list(matcher.names), "optimizer": "Adam (signed)",
                   "lr": lr, "tv_weight": tv_weight}
    trace["closed_form"] = matcher.closed.trace
    labels = None
    weight = matcher.classifier_weight_target()
    b = matcher.originals or max(1, int(budget.batch))
    one_image = b == 1
    if matcher.labels_unused:
        labels = torch.zeros(b, dtype=torch.int64)
        trace["label_source"] = "none (the head-free closed form does not depend on the label)"
    elif counted_labels(matcher, budget) is not None:
        labels = counted_labels(matcher, budget)
        trace["label_source"] = f"closed-form counts ({matcher.closed.trace['label_counts_source']})"
    elif one_image and weight is not None and idlg_applies(weight):
        labels, _ = idlg_labels(weight, 1)
        trace["label_source"] = "idlg-rule"
    else:
        trace["label_source"] = "joint (label logits optimised with the images)"
        if weight is not None and one_image:
            notes.append(IDLG_NOT_APPLICABLE)
            trace["idlg_share"] = idlg_share(weight)
        if weight is None:
            notes.append("no classifier update is available (private or excluded head): the label is optimised "
                         "jointly with the image")
    labels = None if labels is None else labels.to(observation.device)
    return _Setup(matcher, [t.detach() for t in matcher.target], labels, notes, trace)


def _recipe(tv_weight: float, lr: float) -> Recipe:
    """IG's recipe with the prior's weight and the learning rate given."""
    return dataclasses.replace(RECIPE, optimiser=dataclasses.replace(RECIPE.optimiser, lr=lr),
                               prior=dataclasses.replace(RECIPE.prior, weight=tv_weight))


def _optimise(setups: Sequence[_Setup], budget: Budget, seeds: Sequence[int], tv_weight: float,
              lr: float) -> list[AttackResult]:
    """IG on targets that share a model (``setups[0]``'s), as one Adam over their stacked images.

    Adam and the sign step act element-wise and the targets' objectives are independent, so this is
    the same optimisation per target as running each alone (a batch of one)."""
    return _StackedIG(setups, budget, seeds, _recipe(tv_weight, lr)).run()


class _StackedIG:
    """The targets' images (and label logits) stacked into one variable; their objectives evaluated
    in one call (``_transforms``); the template's signed Adam over the stack."""

    def __init__(self, setups: Sequence[_Setup], budget: Budget, seeds: Sequence[int], recipe: Recipe):
        self.setups, self.seeds, self.recipe = list(setups), list(seeds), recipe
        lead = setups[0]
        self.n, self.fixed = len(setups), lead.labels is not None
        self.originals = lead.matcher.originals or max(1, int(budget.batch))
        self.shape = (self.originals + lead.matcher.free_copies, *lead.matcher.observation.image_shape)
        self.num_classes = lead.matcher.observation.num_classes
        self.device = lead.matcher.observation.device
        self.iterations, self.restarts = max(1, int(budget.iterations)), max(1, int(budget.restarts))
        self.targets = stack_targets([s.target for s in setups])
        self.labels = torch.stack([s.labels for s in setups]) if self.fixed else None
        self.copies = lead.matcher.copy_parameters // FAMILY_PARAMETERS  # family-modelled augmented copies
        self.has_z = lead.matcher.z_size > 0  # z: those copies' parameters and any fitted private parameters
        self.transform, self.data_term, self.data_gradient = _transforms(lead.matcher, self.fixed, recipe.prior)
        self.final: list[dict | None] = [None] * self.n
        self.steps: list[list[int]] = [[] for _ in setups]
        self.notes = [list(s.notes) for s in setups]
        self.starts = BestOfStarts(self.n)

    def _variables(self, restarts: list[int], active: list[int]) -> list[torch.Tensor]:
        """The seeded starts (start ``restarts[j]`` of target ``active[j]``), stacked: images, then label
        logits (unless fixed), then z when there is one: the augmented copies' family parameters at the
        identity and the private parameters at their stand-in (``GradientMatcher.z_start``)."""
        xs, ys = [], []
        for i, restart in zip(active, restarts):
            gen = generator(mix_seed(self.seeds[i], restart, 0x16))
            xs.append(uniform(self.shape, gen))  # drawn on the CPU: the same starts on every device
            rebuilt = self.setups[i].matcher.closed_form_start if restart == 0 else None
            if rebuilt is not None:  # the images the closed form rebuilt (``GradientMatcher.closed_form_start``)
                xs[-1] = with_closed_form(xs[-1], rebuilt.cpu())
            if not self.fixed:
                ys.append(normal((self.originals, self.num_classes), gen))
        variables = [torch.stack(xs).to(self.device)] + ([] if self.fixed else [torch.stack(ys).to(self.device)])
        if self.has_z:
            z = self.setups[0].matcher.z_start(self.device)
            variables.append(z.repeat(len(active), *[1] * z.dim()))
        return [v.requires_grad_(True) for v in variables]

    def _inputs(self, variables: list[torch.Tensor], active: list[int]):
        """(x, y, z, targets) of the ``active`` targets for the vmapped functions."""
        index = torch.tensor(active, device=self.device)
        z = variables[-1].detach() if self.has_z else family_start(0, self.device).repeat(len(active), 1, 1)
        y = self.labels[index] if self.fixed else variables[1].detach()
        targets = self.targets if active == list(range(self.n)) else [t[index] for t in self.targets]
        return variables[0].detach(), y, z, targets

    def _evaluate(self, variables: list[torch.Tensor], active: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(objective values, gradients of ``variables``) for the ``active`` targets."""
        grads, values = self.transform(*self._inputs(variables, active))
        return values, list(grads)[:len(variables)]

    def _start(self, restarts: list[int], active: list[int]) -> None:
        """Start ``restarts[j]`` of target ``active[j]``, for every j at once (a target may appear more
        than once, with different starts), by the template's signed Adam (``run_adam``: a target stops
        at a non-finite objective or once it stopped moving in the last phase)."""
        variables = self._variables(restarts, active)

        def nonfinite(j: int, it: int) -> None:
            self.notes[active[j]].append(f"restart {restarts[j]}: the objective became non-finite at step {it}; "
                                         f"stopped there")

        run = run_adam(self.recipe.optimiser, variables, lambda: self._evaluate(variables, active), self.iterations,
                       on_nonfinite=nonfinite)
        self._keep_best(variables, run.history, active, run.steps)

    def _keep_best(self, variables: list[torch.Tensor], history: list[list[float]], active: list[int],
                   steps: int) -> None:
        finals, _ = self._evaluate(variables, active)
        with torch.no_grad():
            data = self.data_term(*self._inputs(variables, active))
        for j, i in enumerate(active):
            final = float(finals[j])
            self.steps[i].append(steps)
            probs = (F.one_hot(self.labels[i], self.num_classes).to(torch.float32) if self.fixed
                     else torch.softmax(variables[1][j].detach(), dim=-1))
            self.starts.offer(i, final, history[j], {
                "objective": final, "data_term": float(data[j]), "images": variables[0][j].detach().clone(),
                "labels": self.labels[i].clone() if self.fixed else variables[1][j].detach().argmax(dim=-1),
                "probs": probs, "copy_parameters": variables[-1][j].detach().clone() if self.has_z else None})

    def _restart_targets(self) -> list[int]:
        """The targets a further start may still improve: those whose kept data term is above
        SOLVED_DATA_TERM (the rest already match the observation to float rounding)."""
        best = self.starts.best
        return [i for i in range(self.n) if best[i] is None or not best[i]["data_term"] <= SOLVED_DATA_TERM]

    def _final_stage(self) -> None:
        """The final stage (the template's ``polish``) on every target whose kept data term is above the
        forward check's floor and at most FINAL_STAGE_CEILING: the data term alone, from the kept start's
        images, with its labels (probability rows) and copy parameters held; the kept images change only
        where the data term fell."""
        rows = [i for i, b in enumerate(self.starts.best)
                if b is not None and OBJECTIVE_FLOOR < b["data_term"] <= FINAL_STAGE_CEILING]
        iterations = self.iterations // ITERATION_SHARE
        if not rows or iterations < 1:
            return
        kept = [self.starts.best[i] for i in rows]
        index = torch.tensor(rows, device=self.device)
        probs = torch.stack([b["probs"] for b in kept])
        z = (torch.stack([b["copy_parameters"] for b in kept]) if self.has_z
             else family_start(0, self.device).repeat(len(rows), 1, 1))
        targets = [t[index] for t in self.targets]

        def evaluate(x: torch.Tensor, some: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gradients, values = self.data_gradient(x, probs[some], z[some], [t[some] for t in targets])
            return values, gradients

        stage = polish(evaluate, self.setups[0].matcher.model, torch.stack([b["images"] for b in kept]), iterations,
                       floor=OBJECTIVE_FLOOR)
        for j, (i, best) in enumerate(zip(rows, kept)):
            before, after = float(stage.before[j]), float(stage.after[j])
            self.final[i] = {"temperatures": list(TEMPERATURES), "iterations_per_temperature": iterations,
                             "evaluations": stage.evaluations, "data_term_before": before, "data_term_after": after}
            if after < before:
                images = stage.images[j].detach().clone()
                best.update(images=images, data_term=after, objective=after + self.recipe.prior.at(images))

    def run(self) -> list[AttackResult]:
        start_time = time.perf_counter()
        self._start([0] * self.n, list(range(self.n)))
        # the further starts of every target the first did not solve run together, as one stack: per
        # start the same optimisation as alone, in one pass instead of one per start (an evaluation of
        # a few stacked starts costs about as much as one's)
        unsolved = self._restart_targets() if self.restarts > 1 else []
        if unsolved:
            rows = [(i, r) for i in unsolved for r in range(1, self.restarts)]
            self._start([r for _, r in rows], [i for i, _ in rows])
        self._final_stage()
        share = (time.perf_counter() - start_time) / self.n
        results = []
        for i, setup in enumerate(self.setups):
            best = self.starts.best[i]
            trace = {"data_term": None if best is None else best["data_term"],
                     "restart_objectives": self.starts.objectives[i], "final_stage": self.final[i],
                     "steps_per_start": self.steps[i], "history": self.starts.histories[i], "seconds": share}
            if self.n > 1:
                trace["batched_with"] = self.n
            results.append(result_from_best(setup.matcher, best, shape=self.shape, originals=self.originals,
                                            num_classes=self.num_classes, notes=self.notes[i],
                                            setup_trace=setup.trace, trace=trace))
        return results


def _transforms(matcher: GradientMatcher, fixed: bool, prior: TotalVariation):
    """The stacked functions (``optimise.per_target``: vmap, or plain autograd for a stack of one) of
    one target's (x, y, z, target): the objective's gradient (in x[, y], z) and value, the data term
    alone (no prior), and the data term's gradient and value at label probability rows (for the final
    stage)."""

    def data_term(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, target: list[torch.Tensor]) -> torch.Tensor:
        soft = y if fixed else torch.softmax(y, dim=-1)
        return matcher.cosine_objective(matcher.dummy(x, soft, z, target=target), target)

    def objective(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, target: list[torch.Tensor]) -> torch.Tensor:
        return data_term(x, y, z, target) + prior(x)

    def data_term_of_probabilities(x: torch.Tensor, probs: torch.Tensor, z: torch.Tensor,
                                   target: list[torch.Tensor]) -> torch.Tensor:
        return matcher.cosine_objective(matcher.dummy(x, probs, z, target=target), target)

    return (stacked_grad_and_value(objective, argnums=(0, 2) if fixed else (0, 1, 2)), stacked_value(data_term),
            stacked_grad_and_value(data_term_of_probabilities))


def inverting_gradients(observation: Observation, budget: Budget, seed: int, mode: str = "auto",
                        tv_weight: float = TV_WEIGHT, lr: float = LR) -> AttackResult:
    """IG on one target (see the module docstring)."""
    (result,) = _optimise([_setup(observation, budget, mode, tv_weight, lr)], budget, [seed], tv_weight, lr)
    return result


def _optimise_group(budget: Budget, tv_weight: float, lr: float, setups: Sequence[_Setup],
                    seeds: Sequence[int]) -> list[AttackResult]:
    return _optimise(setups, budget, seeds, tv_weight, lr)


def plan(observations: Sequence[Observation], budget: Budget, mode: str = "auto", batched: bool = True,
         tv_weight: float = TV_WEIGHT, lr: float = LR) -> tuple[list[Batch], dict]:
    """IG on many targets: one ``Batch`` per group of targets that share a model
    (``attacks.inversion.batching``), optimised as one stacked Adam: the same optimisation per target as one by
    one, each evaluation equal to float rounding (which the sign step can occasionally flip)."""
    prepare = functools.partial(_setup, budget=budget, mode=mode, tv_weight=tv_weight, lr=lr)
    return plan_by_model(prepare, functools.partial(_optimise_group, budget, tv_weight, lr), observations, batched)


SPEC = ClientAttackSpec("ig", attack_one=inverting_gradients, plan=plan, default_victim_batch=1,
                        applies_to=WEIGHT_KINDS, scoring="images", needs="model weights", hint=GRADIENT_HINT,
                        matching="cosine")
