"""The optimisation template of the inversion attacks: every attack that rebuilds images by
optimisation declares its objective, optimiser and prior (a ``Recipe``) and runs on these parts
instead of a loop of its own.

* starts (``starts``): uniform noise, the mean image, noise around an image, a closed form's images in
  place of the first ones; seeded generators drawn on the CPU;
* restarts and best-keeping by the objective (``BestOfStarts``), and the kept iterate as an
  ``AttackResult`` with the forward check's inputs (``result_from_best``, ``check_inputs``);
* the optimisers: Adam on the sign of the gradient with a step schedule (``adam``: one loop,
  ``run_adam``); L-BFGS (``lbfgs``: torch's, ``run_lbfgs``, and ``BatchedLBFGS`` for many problems at
  once; ``matching``: L-BFGS for gradient matching, every (target, start) one problem, the starts after
  the first raced by successive halving); scipy's L-BFGS-B under a continuation
  over the model's kinks (``polish``);
* the fit of a forward model's unknown parameters with the images fixed (``unknowns``: the forward
  check's private head at the truth);
* priors (``priors``): one ``total_variation`` in its three forms (sum, mean, smoothed per image), as an
  attack's weighted ``TotalVariation``; the pixels' projection onto [0, 1] (``project_``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .adam import IG_ADAM, AdamRun, SignedAdam, milestones, run_adam
from .lbfgs import LBFGS, BatchedLBFGS, Diverged, run_lbfgs
from .polish import ITERATION_SHARE, TEMPERATURES, FinalStage, polish
from .priors import IG_PRIOR, TotalVariation, project_, total_variation
from .unknowns import fit_unknowns, iterations_for
from .starts import (BestOfStarts, around, check_inputs, generator, mean_image, mix_seed, normal, result_from_best,
                     uniform, with_closed_form)


@dataclass(frozen=True)
class Recipe:
    """An inversion attack's declaration over the template: what it minimises (in words, for the
    reader and the trace), its optimiser and its image prior (None: none). Its default budget (optimiser
    steps per start, starts) is the attack's declaration's (``attacks/__init__.py``)."""

    objective: str
    optimiser: SignedAdam | LBFGS
    prior: TotalVariation | None = None


__all__ = ["IG_ADAM", "IG_PRIOR", "ITERATION_SHARE", "LBFGS", "TEMPERATURES", "AdamRun", "BatchedLBFGS",
           "BestOfStarts", "Diverged", "FinalStage", "Recipe", "SignedAdam", "TotalVariation", "around",
           "check_inputs", "fit_unknowns", "generator", "iterations_for", "mean_image", "milestones", "mix_seed",
           "normal", "polish", "project_", "result_from_best", "run_adam", "run_lbfgs", "total_variation",
           "uniform", "with_closed_form"]
