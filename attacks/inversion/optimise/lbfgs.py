"""L-BFGS for the inversion attacks, in one place: torch's ``LBFGS`` driven by ``run_lbfgs`` (one
problem: DLG on one target, prototype inversion, the layer-input inversion, the layer-input solve), and
``BatchedLBFGS``, torch's algorithm on K independent problems at once (DLG on targets that share a
model, ``attacks.inversion.optimise.matching``).

An attack declares its L-BFGS as an ``LBFGS``: torch's arguments (learning rate, inner iterations per
step, history, line search, tolerances) and, for attacks that take many steps, the rule that ends a
start early (``verdict``: converged, or stalled over ``stall_steps`` steps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


class Diverged(Exception):
    """Raised by an objective whose value is not finite: the L-BFGS run ends there."""


@dataclass(frozen=True)
class LBFGS:
    """torch.optim.LBFGS's arguments (its defaults unless given; ``max_iter``: inner iterations per
    step, None: given per run), and the early stop of a run of many steps: "converged" at
    ``1e-12`` of the first step's objective, "stalled" when the objective is not ``stall_tolerance``
    lower than ``stall_steps`` steps before (None: no stall rule)."""

    lr: float = 1
    max_iter: int | None = 20
    history_size: int = 100
    line_search: str | None = None
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9
    stall_steps: int | None = None
    stall_tolerance: float = 0.0

    def optimiser(self, variables: list[torch.Tensor], max_iter: int | None = None) -> torch.optim.LBFGS:
        return torch.optim.LBFGS(variables, lr=self.lr, max_iter=self.max_iter if max_iter is None else max_iter,
                                 tolerance_grad=self.tolerance_grad, tolerance_change=self.tolerance_change,
                                 history_size=self.history_size, line_search_fn=self.line_search)

    def verdict(self, history: list[float]) -> str | None:
        """After a step (``history``: the best objective after each): "converged", "stalled" or None."""
        if history[-1] <= 1e-12 * max(history[0], 1e-30) or history[-1] == 0.0:
            return "converged"
        if (self.stall_steps is not None and len(history) > self.stall_steps
                and history[-1] > (1 - self.stall_tolerance) * history[-1 - self.stall_steps]):
            return "stalled"
        return None


def run_lbfgs(lbfgs: LBFGS, variables: list[torch.Tensor], evaluate: Callable, *, max_iter: int | None = None,
              steps: int = 1, after_step: Callable[[], bool] | None = None,
              errors: tuple[type[BaseException], ...] = (Diverged,)) -> bool:
    """Up to ``steps`` torch L-BFGS steps on ``variables``. ``evaluate()`` gives the objective: a tensor
    (its gradient by autograd) or (value, the gradient of each variable) computed otherwise (e.g. by
    ``torch.func``). ``after_step()`` True ends the run after a step. Returns False when a step raised
    one of ``errors`` (the run ends there), else True."""
    optimiser = lbfgs.optimiser(variables, max_iter)

    def closure():
        optimiser.zero_grad(set_to_none=True)
        out = evaluate()
        if isinstance(out, torch.Tensor):
            out.backward()
            return out
        value, gradients = out
        for v, g in zip(variables, gradients):
            v.grad = g
        return value

    for _ in range(steps):
        try:
            optimiser.step(closure)
        except errors:
            return False
        if after_step is not None and after_step():
            break
    return True


class BatchedLBFGS:
    """torch.optim.LBFGS (``line_search_fn=None``) run on K independent problems at once.

    torch's L-BFGS couples every variable it is given (one history, one step size), so K
    reconstructions cannot share one torch optimiser. This class keeps torch's algorithm and its
    defaults (``max_iter`` 20 inner iterations per step, ``max_eval`` = max_iter·5/4, ``tolerance_grad``
    1e-7, ``tolerance_change`` 1e-9, ``history_size`` 100, curvature pairs kept when yᵀs > 1e-10, first
    step length min(1, 1/‖g‖₁)·lr), with one state per problem and the two-loop recursion vectorised
    over the problems (a problem with a shorter history meets all-zero pairs, exact no-ops). Each
    problem is driven by its own evaluations, so every problem follows the iterates torch's optimiser
    would give it alone (to float rounding); the tests check this against torch on smooth problems.

    Protocol: ``start(k, x0)`` (re)starts problem k; ``pending()`` lists the running problems, each
    waiting for the objective and gradient at its ``x[k]``; ``tell(ks, losses, grads)`` hands them over
    and returns the problems whose *step* (one ``opt.step(closure)`` of torch) ended with it; the
    caller decides whether such a problem goes on (it then needs the next evaluation, as torch's next
    step starts with one) or ``stop(k)``. A stopped problem costs nothing (it is not pending) and
    keeps its state: ``resume(k)`` takes it on from the step where it stopped.
    """

    def __init__(self, problems: int, size: int, lr: float = 1.0, max_iter: int = 20, max_eval: int | None = None,
                 tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9, history_size: int = 100,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        k, n = int(problems), int(size)
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.lr, self.max_iter = float(lr), int(max_iter)
        self.max_eval = int(max_eval) if max_eval is not None else self.max_iter * 5 // 4
        self.tolerance_grad, self.tolerance_change, self.history_size = tolerance_grad, tolerance_change, history_size
        self.x = zeros(k, n)
        self._g, self._prev_g, self._d = zeros(k, n), zeros(k, n), zeros(k, n)
        self._y, self._s = zeros(k, history_size, n), zeros(k, history_size, n)
        self._ro, self._h = zeros(k, history_size), torch.ones(k, dtype=dtype, device=device)
        self._length = [0] * k
        self._t = [0.0] * k
        self._loss, self._prev_loss = [0.0] * k, [0.0] * k
        self._running = [False] * k
        self._in_step = [False] * k  # False: the next evaluation opens a step (torch's orig_loss)
        self._n_iter, self._total_iter, self._evals = [0] * k, [0] * k, [0] * k

    def start(self, k: int, x0: torch.Tensor) -> None:
        self.x[k] = x0.reshape(-1)
        self._length[k], self._total_iter[k] = 0, 0
        # unused history slots stay exactly zero: the two-loop recursion then needs no mask
        self._y[k].zero_()
        self._s[k].zero_()
        self._ro[k].zero_()
        self._running[k], self._in_step[k] = True, False

    def stop(self, k: int) -> None:
        self._running[k] = False

    def resume(self, k: int) -> None:
        """Problem k, stopped after a step ended, goes on from where it stood (its history and iterate
        kept): its next evaluation opens the next step, as in torch's next ``opt.step(closure)``."""
        if self._in_step[k]:
            raise ValueError(f"problem {k} was stopped inside a step; only a problem between steps resumes")
        self._running[k] = True

    def pending(self) -> list[int]:
        return [k for k, running in enumerate(self._running) if running]

    def tell(self, ks: list[int], losses: list[float], grads: torch.Tensor) -> list[int]:
        ended: list[int] = []
        iterate: list[int] = []
        for j, k in enumerate(ks):
            self._g[k] = grads[j]
            self._loss[k] = float(losses[j])
            converged = float(grads[j].abs().max()) <= self.tolerance_grad
            if not self._in_step[k]:  # the evaluation that opens a step
                self._evals[k], self._n_iter[k] = 1, 0
                if converged:
                    ended.append(k)
                    continue
                self._in_step[k] = True
                iterate.append(k)
                continue
            self._evals[k] += 1
            if (self._evals[k] >= self.max_eval or converged
                    or float((self._d[k] * self._t[k]).abs().max()) <= self.tolerance_change
                    or abs(self._loss[k] - self._prev_loss[k]) < self.tolerance_change):
                self._in_step[k] = False
                ended.append(k)
                continue
            iterate.append(k)
        if iterate:
            ended += self._iterate(iterate)
        return sorted(ended)

    def _iterate(self, ks: list[int]) -> list[int]:
        """One inner iteration of torch's step for each of ``ks``: direction, step length, move."""
        for k in ks:
            self._n_iter[k] += 1
            self._total_iter[k] += 1
        first = [k for k in ks if self._total_iter[k] == 1]
        rest = [k for k in ks if self._total_iter[k] > 1]
        for k in first:
            self._d[k] = -self._g[k]
            self._length[k], self._h[k] = 0, 1.0
        if rest:
            self._direction(rest)
        ended = []
        for k in ks:
            self._prev_g[k] = self._g[k]
            self._prev_loss[k] = self._loss[k]
            if self._total_iter[k] == 1:
                self._t[k] = min(1.0, 1.0 / float(self._g[k].abs().sum())) * self.lr
            else:
                self._t[k] = self.lr
            if float(self._g[k].dot(self._d[k])) > -self.tolerance_change:
                self._in_step[k] = False
                ended.append(k)
                continue
            self.x[k] += self._t[k] * self._d[k]
            if self._n_iter[k] == self.max_iter:  # torch moves but does not evaluate, and ends the step
                self._in_step[k] = False
                ended.append(k)
        return ended

    def _direction(self, ks: list[int]) -> None:
        index = torch.tensor(ks, device=self._g.device)
        g = self._g[index]
        y = g - self._prev_g[index]
        s = self._d[index] * torch.tensor([self._t[k] for k in ks], dtype=self._d.dtype,
                                          device=self._d.device).unsqueeze(1)
        ys = (y * s).sum(dim=1)
        yy = (y * y).sum(dim=1)
        for j, k in enumerate(ks):
            if float(ys[j]) > 1e-10:  # keep the curvature pair, dropping the oldest when full
                n = self._length[k]
                if n == self.history_size:
                    self._y[k, :-1] = self._y[k, 1:].clone()
                    self._s[k, :-1] = self._s[k, 1:].clone()
                    self._ro[k, :-1] = self._ro[k, 1:].clone()
                    n -= 1
                self._y[k, n], self._s[k, n], self._ro[k, n] = y[j], s[j], 1.0 / ys[j]
                self._length[k] = n + 1
                self._h[k] = ys[j] / yy[j]
        longest = max(self._length[k] for k in ks)
        ys_, ss_, ro = self._y[index, :longest], self._s[index, :longest], self._ro[index, :longest]
        # a problem with fewer pairs meets zero pairs (y = s = 0, ρ = 0): its α and β are exactly 0
        q = -g
        alphas: list[torch.Tensor] = [None] * longest  # type: ignore[list-item]
        for i in range(longest - 1, -1, -1):  # newest pair first
            alphas[i] = torch.linalg.vecdot(ss_[:, i], q) * ro[:, i]
            q = torch.addcmul(q, alphas[i].unsqueeze(1), ys_[:, i], value=-1.0)
        r = q * self._h[index].unsqueeze(1)
        for i in range(longest):  # oldest pair first
            beta = torch.linalg.vecdot(ys_[:, i], r) * ro[:, i]
            r = torch.addcmul(r, (alphas[i] - beta).unsqueeze(1), ss_[:, i])
        self._d[index] = r
