"""A one-target objective evaluated for a stack of targets: the stacked attacks' transforms.

``torch.func.vmap`` over ``torch.func.grad_and_value`` gives every stacked target's value and
gradient in one call. For a stack of one, vmap only costs: on a CPU, the double backward through
vmap's batching rules took about 1.7× the time of plain autograd on the same objective
(``cnn28-same``, one 28×28 image, one thread). So a stack of one is evaluated with plain autograd
around the same function, its inner gradients taken with plain autograd too
(``fedecouple.methods.replay.differentiated_outside``), and the values agree with vmap's to float
rounding.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.func import grad_and_value, vmap
from torch.utils._pytree import tree_map

from fedecouple.methods.replay import differentiated_outside


def _first(tree):
    """Every tensor of ``tree`` without its leading (stack) dimension of size one."""
    return tree_map(lambda t: t[0] if isinstance(t, torch.Tensor) else t, tree)


def stacked_grad_and_value(fn: Callable[..., torch.Tensor], argnums: int | Sequence[int] = 0) -> Callable:
    """``vmap(grad_and_value(fn, argnums))`` for stacked arguments, computed with plain autograd when
    the stack holds one target. Returns (gradients: one tensor for an int ``argnums``, else a tuple in
    its order; values (m,)), as vmap's."""
    batched = vmap(grad_and_value(fn, argnums=argnums))
    single = isinstance(argnums, int)
    argnums = (argnums,) if single else tuple(argnums)

    def call(*args):
        if _stack_size(args) != 1:
            return batched(*args)
        with torch.enable_grad(), differentiated_outside():
            one = list(_first(list(args)))
            leaves = []
            for i in argnums:
                one[i] = one[i].detach().requires_grad_(True)
                leaves.append(one[i])
            value = fn(*one)
            grads = torch.autograd.grad(value, leaves, allow_unused=True)
        grads = tuple((torch.zeros_like(leaf) if g is None else g).unsqueeze(0) for g, leaf in zip(grads, leaves))
        return (grads[0] if single else grads), value.detach().unsqueeze(0)

    return call


def stacked_value(fn: Callable[..., torch.Tensor]) -> Callable:
    """``vmap(fn)`` for stacked arguments, called directly when the stack holds one target."""
    batched = vmap(fn)

    def call(*args):
        if _stack_size(args) != 1:
            return batched(*args)
        with differentiated_outside():
            return fn(*_first(list(args))).unsqueeze(0)

    return call


def _stack_size(args) -> int:
    """The leading dimension of the first tensor argument."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.shape[0]
    raise ValueError("no tensor argument to read the stack size from")
