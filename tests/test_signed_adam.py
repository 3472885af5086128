"""The template's signed Adam: torch's Adam and step schedule to the bit, one optimisation per stacked
target, and the stop rule that lets a stalled target take its learning-rate drops early."""
from __future__ import annotations

import torch

from attacks.inversion.optimise import SignedAdam, run_adam
from attacks.inversion.optimise.adam import milestones

CENTRES = torch.tensor([[0.2, 0.7, 0.4], [0.9, 0.1, 0.5]], dtype=torch.float64)


def _objective(x: torch.Tensor, centres: torch.Tensor = CENTRES) -> torch.Tensor:
    return ((x - centres) ** 2).sum(dim=1)


def _evaluate(x: torch.Tensor, centres: torch.Tensor = CENTRES):
    def evaluate():
        with torch.enable_grad():
            values = _objective(x, centres)
            (g,) = torch.autograd.grad(values.sum(), x)
        return values.detach(), [g]
    return evaluate


def test_without_a_stop_rule_it_is_torchs_adam_and_multisteplr():
    iterations = 40
    x = torch.full((2, 3), 0.5, dtype=torch.float64, requires_grad=True)
    run = run_adam(SignedAdam(lr=0.1), [x], _evaluate(x), iterations)
    ref = torch.full((2, 3), 0.5, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([ref], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones(iterations), gamma=0.1)
    for _ in range(iterations):
        (g,) = torch.autograd.grad(_objective(ref).sum(), ref)
        ref.grad = g.sign()
        opt.step()
        sched.step()
        with torch.no_grad():
            ref.clamp_(0, 1)
    assert run.steps == iterations
    assert torch.equal(x.detach(), ref.detach())


def test_a_stalled_target_takes_its_drops_early_and_stops_while_the_other_goes_on():
    iterations = 400
    centres = torch.stack([torch.full((3,), 1.5, dtype=torch.float64), CENTRES[1]])
    # target 0 sits on the bound nearest its minimum (outside [0, 1]): the projection holds it there
    x = torch.stack([torch.ones(3, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64)]).requires_grad_(True)
    adam = SignedAdam(lr=0.1, stall_tolerance=1e-3, stall_after_drops=1)
    run = run_adam(adam, [x], _evaluate(x, centres), iterations)
    window, first_drop = max(10, iterations // 20), milestones(iterations)[0]
    # target 0 never improves: one window into the first drop it takes the second, one more the third,
    # one more and it stops; its objective history ends there
    stop = first_drop + 3 * window
    assert len(run.history[0]) == len(range(0, stop + 1, max(1, iterations // 50)))
    assert torch.equal(x.detach()[0], torch.ones(3, dtype=torch.float64))
    # target 1 runs as it would alone under the same rule
    alone = torch.full((1, 3), 0.5, dtype=torch.float64, requires_grad=True)
    run_alone = run_adam(adam, [alone], _evaluate(alone, centres[1:]), iterations)
    assert torch.equal(alone.detach()[0], x.detach()[1])
    assert run.steps == run_alone.steps


def test_with_the_default_rule_a_target_is_watched_only_in_the_last_phase():
    iterations = 400
    centres = torch.stack([torch.full((3,), 1.5, dtype=torch.float64), CENTRES[1]])
    x = torch.stack([torch.ones(3, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64)]).requires_grad_(True)
    run = run_adam(SignedAdam(lr=0.1, stall_tolerance=1e-3), [x], _evaluate(x, centres), iterations)
    last = milestones(iterations)[-1]
    window = max(10, iterations // 20)
    assert len(run.history[0]) == len(range(0, last + window + 1, max(1, iterations // 50)))
