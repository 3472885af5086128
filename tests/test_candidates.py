"""DLG's starts as slots of one batched L-BFGS: every (target, start) its own slot, the first start on
the path of a one-start run, the others raced by successive halving, the kept start by the documented
rule; a stopped L-BFGS problem resumes where it stood."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attacks.base import Budget
from attacks.inversion.dlg import RECIPE, _setup
from attacks.inversion.optimise import BatchedLBFGS
from attacks.inversion.optimise.matching import (INFORMED_MARGIN, Lockstep, halving_rungs, lockstep_cost, optimise,
                                                 optimise_one)

from test_attacks import synthetic_observation
from helpers import TEST_THREADS

IMAGES = [40, 11, 7]
STEPS = 10


@pytest.fixture(scope="module")
def setups(digits):
    """Three DLG targets of the same round-0 model (one image each)."""
    torch.set_num_threads(TEST_THREADS)
    return [_setup(synthetic_observation(digits, [i])[0], Budget(iterations=STEPS), "auto", False, "dlg")
            for i in IMAGES]


def _informed(setup):
    """``setup`` as a problem whose first start is an informed guess (as a closed form's image is)."""
    informed = type("Informed", (type(setup),), {"informed_first_start": True})
    return informed(**{f.name: getattr(setup, f.name) for f in dataclasses.fields(setup)})


def test_halving_rungs_halve_the_racing_starts_down_to_one():
    assert halving_rungs(7, 300, 3) == [3, 6, 12]  # 7 → 4 → 2 → 1
    assert halving_rungs(8, 300, 3) == [3, 6, 12]
    assert halving_rungs(2, 300, 3) == [3]
    assert halving_rungs(1, 300, 3) == [] and halving_rungs(0, 300, 3) == []
    assert halving_rungs(16, 10, 3) == [3, 6]  # no rung at or past the budget


def test_every_start_of_every_target_is_its_own_slot(setups):
    restarts, seeds = 4, [1, 0, 2]
    lockstep = Lockstep(setups, RECIPE.optimiser, STEPS, restarts, seeds)
    assert lockstep.slots == [(k, c) for k in range(3) for c in range(restarts)]
    assert lockstep.lbfgs.x.shape[0] == 3 * restarts
    results = lockstep.run()
    assert lockstep.lbfgs.pending() == [] and set(lockstep.state) <= {"finished", "dropped"}
    for k, result in enumerate(results):
        trace = result.trace
        assert len(trace["restart_objectives"]) == restarts and all(math.isfinite(v) for v in trace["restart_objectives"])
        assert all(steps >= 1 for steps in trace["steps_per_start"])  # every start was evaluated and stepped
        assert trace["evaluations"] == sum(lockstep.runs[s]["evals"] for s in range(k * restarts, (k + 1) * restarts))
        assert trace["kept_start"] in set(range(restarts)) - set(trace["dropped_starts"])


def test_racing_starts_pass_each_rung_by_halves(setups):
    restarts, rungs = 8, [2, 4, 8]
    lockstep = Lockstep(setups, RECIPE.optimiser, STEPS, restarts, [3, 4, 5], rungs=rungs)
    for result in lockstep.run():
        racing = result.trace["steps_per_start"][1:]
        alive = len(racing)
        for rung in rungs:
            alive = -(-alive // 2)
            assert sum(steps > rung for steps in racing) <= alive, (rung, racing)
        dropped = result.trace["dropped_starts"]
        assert 0 not in dropped and len(dropped) <= restarts - 2  # the first start never races
        # a dropped start lost its rung: it ran no further than the last rung
        assert all(result.trace["steps_per_start"][c] <= rungs[-1] for c in dropped)


def test_the_first_start_takes_the_one_start_path_bit_for_bit(setups):
    seeds = [1, 0, 2]
    one = Lockstep(setups, RECIPE.optimiser, STEPS, 1, seeds).run()
    many = Lockstep(setups, RECIPE.optimiser, STEPS, 4, seeds).run()
    for a, b in zip(one, many):
        assert b.trace["history"][0] == a.trace["history"][0]
        assert b.trace["restart_objectives"][0] == a.trace["restart_objectives"][0]
    # an informed first start that no start beat past the margin is the kept one: the one-start run's
    # result exactly
    informed = [_informed(s) for s in setups]
    many = Lockstep(informed, RECIPE.optimiser, STEPS, 4, seeds).run()
    for a, b in zip(one, many):
        first, *others = b.trace["restart_objectives"]
        kept = b.trace["kept_start"]
        if kept == 0:
            assert torch.equal(b.images, a.images)
        assert (kept == 0) == all(o * INFORMED_MARGIN > first for c, o in enumerate(others, 1)
                                  if c not in b.trace["dropped_starts"])


def test_one_start_on_one_target_is_torchs_lbfgs_and_lockstep_follows_it(setups):
    """One target with one start runs torch's own L-BFGS (``optimise_one``); the lockstep run of the
    same start takes its first evaluations alike (later, rounding may part them: the optimisation is
    chaotic; after a whole step of 20 evaluations AVX2 kernels parted them by 1.6e-4)."""
    (setup,) = setups[:1]
    assert "batched_with" not in optimise([setup], RECIPE.optimiser, 1, 1, [7])[0].trace
    first = dataclasses.replace(RECIPE.optimiser, max_iter=3)  # one step of three evaluations
    reference = optimise_one(setup, first, 1, 1, 7)
    (batched,) = Lockstep([setup], first, 1, 1, [7]).run()
    torch.testing.assert_close(batched.images, reference.images, rtol=0, atol=1e-4)
    assert batched.trace["objective"] == pytest.approx(reference.trace["objective"], rel=1e-3, abs=1e-9)
    assert "kept_start" not in batched.trace  # one start: the trace of a one-start run


def _fabricated(setups, informed: bool, runs: list[tuple[float, str]]) -> Lockstep:
    """A lockstep of one target whose starts ended as ``runs`` (objective, state)."""
    problem = _informed(setups[0]) if informed else setups[0]
    lockstep = Lockstep([problem], RECIPE.optimiser, STEPS, len(runs), [0])
    for s, (objective, state) in enumerate(runs):
        lockstep.runs[s] = {"objective": objective, "images": torch.zeros(1), "history": [objective]}
        lockstep.state[s] = state
    return lockstep


def test_the_kept_start_follows_the_rule(setups):
    runs = [(0.5, "finished"), (0.1, "finished"), (0.001, "dropped"), (0.3, "finished")]
    # drawn first start: the lowest objective of the starts not dropped
    assert _fabricated(setups, False, runs).kept(0) == 1
    # informed first start: kept over starts of lower objective, within the margin
    assert 0.1 * INFORMED_MARGIN > 0.5
    assert _fabricated(setups, True, runs).kept(0) == 0
    # ... and given up for one past it, as for a start that matched the upload
    far = runs[:3] + [(0.5 / INFORMED_MARGIN / 2, "finished")]
    assert _fabricated(setups, True, far).kept(0) == 3
    assert _fabricated(setups, False, far).kept(0) == 3
    # an informed first start that is also the lowest: kept
    assert _fabricated(setups, True, [(0.01, "finished")] + runs[1:]).kept(0) == 0


def test_batched_lbfgs_resumes_a_stopped_problem_where_it_stood():
    """Stopped after its second step while a companion runs on, then resumed, a problem takes the
    iterates of an uninterrupted run, exactly."""
    def loss_and_grad(x):
        x = x.clone().requires_grad_(True)
        loss = ((1.0 - x) ** 2).sum() + 0.3 * ((x[1:] - x[:-1] ** 2) ** 2).sum()
        return float(loss.detach()), torch.autograd.grad(loss, x)[0]

    x0 = torch.randn(6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def path(pause_after: int | None) -> list[torch.Tensor]:
        lbfgs, steps, idle = BatchedLBFGS(2, 6, dtype=torch.float64), [], 0
        lbfgs.start(0, x0)
        lbfgs.start(1, 0.5 * x0)
        while len(steps) < 5:
            pending = lbfgs.pending()
            if 0 not in pending:
                idle += 1
                if idle > 3 or not pending:
                    lbfgs.resume(0)
                    continue
            losses, grads = zip(*(loss_and_grad(lbfgs.x[k]) for k in pending))
            for k in lbfgs.tell(pending, list(losses), torch.stack(grads)):
                if k == 0:
                    steps.append(lbfgs.x[0].clone())
                    if len(steps) == pause_after:
                        lbfgs.stop(0)
        return steps

    for a, b in zip(path(None), path(2), strict=True):
        assert torch.equal(a, b)


def test_batched_lbfgs_refuses_to_resume_inside_a_step():
    lbfgs = BatchedLBFGS(1, 3, dtype=torch.float64)
    lbfgs.start(0, torch.ones(3, dtype=torch.float64))
    lbfgs.tell([0], [1.0], torch.ones(1, 3, dtype=torch.float64))  # opens a step and moves: inside it
    lbfgs.stop(0)
    with pytest.raises(ValueError, match="inside a step"):
        lbfgs.resume(0)


def test_the_estimate_counts_the_race_not_every_start(digits):
    """``--restarts 8`` is estimated at the race's steps (7 starts to 3 steps, 4 to 6, 2 to 12, one to the
    end) beside the first start's, not at 8 runs; one start and a budget too short to race cost as before."""
    from fedsec import estimate
    from fedsec.jobs.attack import AttackSettings

    assert lockstep_cost(8, 300) == pytest.approx(1 + (7 * 3 + 4 * 3 + 2 * 6 + 1 * 288) / 300)
    assert lockstep_cost(1, 300) == 1.0 and lockstep_cost(8, 3) == 8.0
    one, eight = (estimate.seconds(estimate.attack_work("fedecouple", 20, 187.0,
                                                        AttackSettings(attack="dlg", restarts=k).resolved(0, 1), 0))
                 for k in (1, 8))
    assert 2.0 < eight / one < 2.5
