"""A stack of one target is evaluated with plain autograd instead of vmap: the values and gradients
an attack optimises on must be vmap's, to float rounding, in every mode (gradient, replay, method)."""
from __future__ import annotations

import pytest
import torch
from torch.func import grad, grad_and_value, vmap

from attacks.inversion.forward_model import GradientMatcher
from attacks.inversion.ig import _transforms
from attacks.inversion.optimise import IG_PRIOR
from attacks.inversion.optimise.per_target import stacked_grad_and_value, stacked_value
from fedecouple.methods.replay import differentiated_outside, parameter_gradients

from test_attacks import synthetic_observation


def test_a_stack_of_one_takes_autograd_with_vmaps_values():
    def fn(x, w, target):
        return ((x * w).sum() - target[0]) ** 2 + (w ** 3).sum()

    x, w = torch.rand(1, 5, dtype=torch.float64), torch.rand(1, 5, dtype=torch.float64)
    target = [torch.rand(1, dtype=torch.float64)]
    (gx, gw), value = stacked_grad_and_value(fn, argnums=(0, 1))(x, w, target)
    (vx, vw), vvalue = vmap(grad_and_value(fn, argnums=(0, 1)))(x, w, target)
    torch.testing.assert_close(value, vvalue, rtol=0, atol=1e-12)
    torch.testing.assert_close(gx, vx, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, vw, rtol=0, atol=1e-12)
    assert not x.requires_grad and value.shape == (1,)
    single, _ = stacked_grad_and_value(fn)(x, w, target)  # an int argnums: one tensor, as vmap's
    torch.testing.assert_close(single, vx, rtol=0, atol=1e-12)
    torch.testing.assert_close(stacked_value(fn)(x, w, target), vvalue, rtol=0, atol=1e-12)


def test_an_argument_the_value_ignores_gets_a_zero_gradient():
    (gx, gz), _ = stacked_grad_and_value(lambda x, z: (x ** 2).sum(), argnums=(0, 1))(torch.ones(1, 3), torch.ones(1, 2))
    assert torch.equal(gz, torch.zeros(1, 2)) and torch.equal(gx, 2 * torch.ones(1, 3))


def test_parameter_gradients_in_plain_autograd_equal_torch_funcs():
    w = {"w": torch.tensor([0.5, -1.0, 2.0])}

    def through(x):
        return parameter_gradients(lambda p: ((p["w"] * x).sum()) ** 2, w)["w"].pow(2).sum()

    x = torch.tensor([0.3, 0.1, -0.2])
    xs = x.clone().requires_grad_(True)
    with differentiated_outside():
        (g_eager,) = torch.autograd.grad(through(xs), xs)
        g_func = grad(through)(x)  # under a transform: torch.func.grad inside, whatever the context
    # by hand: g = 2 s x with s = w·x, so |g|² = 4 s² |x|², whose gradient is 8 s |x|² w + 8 s² x
    s_ = float(w["w"] @ x)
    expected = 8 * s_ * float(x @ x) * w["w"] + 8 * s_ ** 2 * x
    torch.testing.assert_close(g_eager, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_func, expected, rtol=1e-5, atol=1e-7)
    assert not w["w"].requires_grad  # the caller's parameters are left as they were
    plain = parameter_gradients(lambda p: (p["w"] ** 2).sum(), w)["w"]  # outside the context: no graph
    assert not plain.requires_grad and torch.equal(plain, 2 * w["w"])


@pytest.mark.parametrize("mode,steps", [("scaled", 1), ("replay", 3)])
def test_igs_objective_on_one_target_equals_its_vmapped_value(digits, mode, steps):
    obs, x, y = synthetic_observation(digits, [3, 40], steps=steps)
    matcher = GradientMatcher(obs, mode)
    objective, data_term, _ = _transforms(matcher, True, IG_PRIOR)
    dummy = torch.rand(1, *x.shape, generator=torch.Generator().manual_seed(0))
    labels, z = y.unsqueeze(0), torch.zeros(1, 0, 8)
    target = [t.unsqueeze(0) for t in matcher.target]
    (gx, _), value = objective(dummy, labels, z, target)

    def reference(x_, y_, z_, t_):
        return matcher.cosine_objective(matcher.dummy(x_, y_, z_, target=t_), t_) + IG_PRIOR(x_)

    two = torch.cat([dummy, dummy])  # a stack of two goes through vmap: its rows are the reference
    (vx, _), vvalue = vmap(grad_and_value(reference, argnums=(0, 2)))(two, labels.repeat(2, 1), z.repeat(2, 1, 1),
                                                                       [t.repeat(2, *[1] * (t.dim() - 1))
                                                                        for t in target])
    torch.testing.assert_close(value[0], vvalue[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gx[0], vx[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(data_term(dummy, labels, z, target)[0] + IG_PRIOR(dummy[0]), vvalue[0],
                               rtol=1e-5, atol=1e-7)
