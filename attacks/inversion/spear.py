"""SPEAR: exact recovery of a whole batch from one linear layer's update ("SPEAR: Exact Gradient
Inversion of Batches in Federated Learning"; the sparse search follows "Scaling Gradient Inversion via
Sparsely-Used Dictionary Learning").

**The algebra.** A linear layer z_i = W x_i + b followed by ReLU, trained on B inputs, has the
gradients G = ∂L/∂W = Σ_i δ_i x_iᵀ = Δ Xᵀ and g_b = Σ_i δ_i, with δ_i = ∂L/∂z_i exactly zero wherever
z_i < 0 (the unit is off). For B < min(m, n), G has rank B: G = L R with L = U_B (orthonormal) and
R = S_B V_Bᵀ from the SVD, and Δ = L A, Xᵀ = A⁻¹ R for an unknown invertible B×B matrix A. Each
column of A is a direction q in which L q is sparse (a δ_i up to scale: about half its entries
exactly zero), which a generic direction is not. The scale of each column follows from the bias
gradient: g_b = L Q s is exactly solvable for s, and then X = (diag(s)⁻¹ Q⁻¹ R)ᵀ. A common scale of
G and g_b (an SGD update is −lr·G) cancels in X: the attack needs the update, not the learning rate.

**The search** for the B directions, in stages that share one test of a candidate
(``_Directions.accept``): at least ``least_zeros`` exact zeros, a zero set that pins one direction (not
the common zeros of several δs plus stray rows), and a pattern some input of the layer could produce
(``_Layer.realizable``: a small linear program under the known W and b; the near-zeros of the
difference of two similar δs, e.g. of two images of one class, are no such pattern).

1. Sparse directions from many starts (rows of L where the directions found so far are zero are
   preferred, and random ones): ``search="irls"`` (default) minimises ‖L q‖₁ on the sphere by
   iteratively reweighted least squares (each step the smallest eigenvector of Σ_j ℓ_j ℓ_jᵀ/|ℓ_j q|),
   ``search="lp"`` by the linear program min ‖L q‖₁ subject to rᵀq = 1 (HiGHS), r the previous q,
   repeated; ``search="sampling"`` is SPEAR's own: the null vector of B − 1 random rows of L, whose
   chance of drawing B − 1 zeros of one δ halves with every image (small B only). A solution's
   (near-)zero rows then give the exact direction as their null vector. Where those rows leave a
   small subspace instead (the common zeros of a few δs), the directions inside it are drawn from a
   few of its other rows (sampling, in that subspace only).
2. Completion, when the search stalls and at its end: the directions found are held and the missing
   ones iterated from the ReLU's consistency with the known layer: the inputs follow from the current
   directions (X above), each missing δ_i vanishes on the units where W x_i + b is clearly negative,
   so its direction is the null vector of those rows. From a few missing directions this converges
   to the exact ones.
3. The B directions solve for Δ and X, once more with each direction the null vector of all the units
   its input leaves clearly off (``_polish``: more rows average a float32 update's noise down), and the
   certificate judges each input. Up to ``REPAIRS`` times, the directions of uncertified inputs are
   dropped (a direction that mixes δs spoils only those inputs) and the search goes on.

**Certificate.** (1) The B pairs (δ_i, x_i) reproduce G and g_b (relative residual at most
``RESIDUAL_TOLERANCE``: the update is one gradient of B inputs), and (2) for each i the zeros of δ_i
are exactly the units with z_i = W x_i + b ≤ 0 under the known W and b (units within the noise of 0
excused). The inputs are "exact" when both hold for all of them, else "not determined": a wrong
direction j that mixes in some of δ_i fails input j's check, but shifts x_i along x_j without moving
x_i's pattern, so one failure leaves no input certain.

**LeakyReLU** (negative slope a, known): δ_i is a times its upstream value where z_i < 0, not zero.
The search reads those units from the gap (entries of L q below √a times its typical entry), keeps
candidates whose small entries sit near a times the rest, and the B with the most of them (a mix of
δs has fewer). That is an approximation, never certified: any invertible A gives δs that some
upstream gradient explains.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import sparse
from scipy.optimize import linprog, minimize_scalar
from torch import nn

from ..base import AttackResult, Budget, NotApplicable, Observation
from .layer_inputs import (first_layer_sees_pixels, invert_layer_inputs, layer_inputs, layer_inputs_differentiable,
                           load, match_inputs)
from ..metrics import input_shares, psnr, ssim
from ..registry import GRADIENT_HINT, ClientAttackSpec
from .observation import update_target
from .optimise import mean_image

SEARCHES = ("irls", "lp", "sampling")
VERDICTS = ("exact", "not determined")
# the recovered set must reproduce the update to this relative residual to be certified
RESIDUAL_TOLERANCE = 1e-4
# singular values below this share of the largest count as zero (the update's numerical rank); where
# noise fills the spectrum, a drop of RANK_GAP between two consecutive ones marks the rank instead
RANK_TOLERANCE = 1e-4
RANK_GAP = 100.0
# B above this share of the layer's live units (or inputs) is not attempted: the search needs each δ's
# zeros to outnumber B many times over, and its cost grows with B³
MAX_BATCH_SHARE = 0.25
# an entry of a candidate δ is zero below this share of its largest entry, or below the update's noise
# (its first discarded singular value over its last kept one) times ZERO_NOISE_FACTOR, if that is larger.
# Measured on float32 SGD updates (mlp-relu, pfllib-cnn, B = 8-32): a δ's zeros lie below 0.16 × the
# noise, its nonzero entries above 0.25 × (98 % of them above 200 ×)
ZERO_SHARE = 1e-9
ZERO_NOISE_FACTOR = 0.5
# the certificate calls an entry of a recovered δ zero below CLEAR_ZERO_FACTOR × the noise and nonzero
# above CLEAR_NONZERO_FACTOR × (measured on recovered δs: zeros up to 0.6 ×, a true entry as small as
# 0.24 ×); an entry in between is excused
CLEAR_ZERO_FACTOR = 0.1
CLEAR_NONZERO_FACTOR = 3.0
# the search's local solutions are read with these looser ones, and a zero set leaves two or more
# directions free when its second smallest singular value is below PURE_SHARE (or the noise times
# LOOSE_NOISE_FACTOR) of its largest
LOOSE_SHARE = 1e-6
LOOSE_NOISE_FACTOR = 10.0
PURE_SHARE = 1e-7
# a unit whose pre-activation is within this share of the input's largest (or the noise times
# UNCLEAR_NOISE_FACTOR) is too close to 0 for the certificate to call it on or off
UNCLEAR_SHARE = 1e-6
UNCLEAR_NOISE_FACTOR = 100.0
# two candidates are the same direction when |cos| of their δs is above this (distinct images' δs
# stay below 0.9 even for two images of one class; a near-copy of a found δ lies within the noise)
SAME_DIRECTION = 1 - 1e-3
# a chosen set of directions stays this well conditioned (smallest singular value of the unit δs)
MIN_CONDITION = 1e-6
IRLS_STEPS = 100
LP_STEPS = 5
# the largest subspace (common zeros of a few δs) searched by sampling its rows, and the draws per
# direction wanted there, times 2^dimension
MAX_SUBSPACE = 6
SUBSPACE_DRAWS = 20
# completion: rounds of the iteration, and fresh starts of the missing directions
COMPLETION_ROUNDS = 60
COMPLETION_STARTS = 8
# LeakyReLU: a candidate's small entries must be this many times the slope below its others (medians)
GAP_FACTOR = 3.0
# times the directions of uncertified inputs are dropped and completed again
REPAIRS = 3
# the most-negative share of a missing δ's off units that pins its direction
CONFIDENT_SHARE = 0.5


@dataclass
class BatchRecovery:
    """What ``recover_batch`` found: per recovered input its layer input and δ (to the update's common
    scale), the certificate (``residual``, ``bias_residual``: the set's relative residuals on G and
    g_b; ``pattern_mismatches``: units where δ_i's zeros differ from {z_i ≤ 0}), the verdict, and how
    the search went."""

    inputs: torch.Tensor  # (B, n)
    deltas: torch.Tensor  # (B, m)
    exact: torch.Tensor  # (B,) bool
    residual: float
    bias_residual: float
    pattern_mismatches: torch.Tensor  # (B,) int
    batch: int  # B: the rank used
    rank: int  # the update's numerical rank
    found: int  # directions the sparse search found
    completed: int  # directions completion found
    repairs: int  # times the directions of uncertified inputs were dropped and completed again
    solves: int  # local solves of the search (IRLS runs, linear programs or draws)
    notes: list[str] = field(default_factory=list)

    @property
    def verdicts(self) -> list[str]:
        return [VERDICTS[0] if e else VERDICTS[1] for e in self.exact.tolist()]


def numerical_rank(singular: torch.Tensor, tolerance: float = RANK_TOLERANCE, limit: int | None = None) -> int:
    """How many singular values exceed ``tolerance`` times the largest; where that is above ``limit``
    (noise fills the spectrum), the position of the widest drop among the first ``limit`` + 1 if it is
    a drop of ``RANK_GAP`` or more."""
    if len(singular) == 0 or float(singular[0]) == 0.0:
        return 0
    count = int((singular > tolerance * singular[0]).sum())
    if limit is None or count <= limit or len(singular) < 2:
        return count
    head = singular[:limit + 1].clamp_min(1e-300)
    drops = head[:-1] / head[1:]
    widest = int(drops.argmax())
    return widest + 1 if float(drops[widest]) >= RANK_GAP else count


def noise_level(singular: torch.Tensor, batch: int) -> float:
    """The update's relative noise beyond a rank-``batch`` gradient: its first discarded singular value
    over its last kept one (0 for an exact rank-``batch`` update)."""
    if batch >= len(singular) or float(singular[batch - 1]) == 0.0:
        return 0.0
    return float(singular[batch] / singular[batch - 1])


def _zero_rows(v: np.ndarray, share: float) -> np.ndarray:
    """Indices where |v| is at most ``share`` times max |v|."""
    return np.flatnonzero(np.abs(v) <= share * np.abs(v).max())


def _small_rows(v: np.ndarray, slope: float) -> np.ndarray:
    """LeakyReLU: the rows a candidate δ = v holds at the negative slope: below √slope (the geometric
    middle) times the typical size of its larger half."""
    size = np.abs(v)
    typical = float(np.median(np.sort(size)[len(size) // 2:]))
    return np.flatnonzero(size < np.sqrt(slope) * typical)


def _null_direction(rows: np.ndarray) -> np.ndarray:
    """The unit vector q minimising ‖rows q‖ (the smallest right singular vector)."""
    return np.linalg.svd(rows, full_matrices=True)[2][-1]


def _irls(L: np.ndarray, q: np.ndarray, steps: int = IRLS_STEPS) -> np.ndarray:
    """A local minimiser of ‖L q‖₁ on the unit sphere from ``q``, by reweighted least squares."""
    q = q / np.linalg.norm(q)
    for _ in range(steps):
        v = np.abs(L @ q)
        weights = 1.0 / np.maximum(v, 1e-12 * v.max())
        following = np.linalg.eigh((L * weights[:, None]).T @ L)[1][:, 0]
        if abs(float(following @ q)) > 1 - 1e-15:
            return following
        q = following
    return q


def _l1_direction(L: np.ndarray, r: np.ndarray) -> np.ndarray | None:
    """argmin ‖L q‖₁ subject to rᵀq = 1 (variables q and t ≥ |L q|), or None when HiGHS fails."""
    m, b = L.shape
    eye = sparse.identity(m, format="csr")
    dense = sparse.csr_matrix(L)
    a_ub = sparse.vstack([sparse.hstack([dense, -eye]), sparse.hstack([-dense, -eye])], format="csr")
    cost = np.concatenate([np.zeros(b), np.ones(m)])
    done = linprog(cost, A_ub=a_ub, b_ub=np.zeros(2 * m), A_eq=np.concatenate([r, np.zeros(m)])[None],
                   b_eq=[1.0], bounds=[(None, None)] * b + [(0, None)] * m, method="highs")
    return done.x[:b] if done.status == 0 else None


def _lp(L: np.ndarray, q: np.ndarray, steps: int = LP_STEPS) -> np.ndarray:
    """A local minimiser of ‖L q‖₁ on the sphere by linear programs, each constrained by the last q."""
    q = q / np.linalg.norm(q)
    for _ in range(steps):
        following = _l1_direction(L, q)
        if following is None:
            break
        following = following / np.linalg.norm(following)
        if abs(float(following @ q)) > 1 - 1e-12:
            return following
        q = following
    return q


@dataclass
class _Layer:
    """One layer's problem in the basis of its update, on its live units (those with any gradient):
    G = L R, the pre-activations of inputs from directions Q and scales s are W R ᵀ Q⁻ᵀ / s + b."""

    L: np.ndarray  # (m, B) orthonormal columns
    R: np.ndarray  # (B, n)
    WR: np.ndarray  # (m, B): W Rᵀ
    WV: np.ndarray  # (m, B): W V_B, the pre-activations' part of an input x = V_B c
    bias: np.ndarray  # (m,)
    grad_bias: np.ndarray  # (m,)
    slope: float
    noise: float  # noise_level of the update
    least_zeros: int  # fewer zeros and a candidate is no δ

    @property
    def zero_share(self) -> float:  # an entry of a δ below this share of its largest is zero
        return max(ZERO_SHARE, ZERO_NOISE_FACTOR * self.noise)

    @property
    def loose_share(self) -> float:  # the same for the search's local solutions, and for null spaces
        return max(LOOSE_SHARE, LOOSE_NOISE_FACTOR * self.noise)

    @property
    def pure_share(self) -> float:  # a singular value below this share of the largest counts as zero
        return max(PURE_SHARE, LOOSE_NOISE_FACTOR * self.noise)

    @property
    def batch(self) -> int:
        return self.L.shape[1]

    def scales(self, Q: np.ndarray) -> np.ndarray:
        """s with L Q s = g_b (least squares; exact for the true directions)."""
        return np.linalg.lstsq(self.L @ Q, self.grad_bias, rcond=None)[0]

    def solve(self, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(δs (m, B), inputs (B, n)) from the directions Q (B, B): Δ = L Q diag(s), Xᵀ = diag(s)⁻¹ Q⁻¹ R."""
        s = self.scales(Q)
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.L @ Q * s, np.linalg.lstsq(Q, self.R, rcond=None)[0] / s[:, None]

    def pre_activations(self, Q: np.ndarray) -> np.ndarray:
        """(m, B): z_i = W x_i + b of the inputs the directions Q give."""
        s = self.scales(Q)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return self.WR @ np.linalg.inv(Q).T / s + self.bias[:, None]

    def realizable(self, rows: np.ndarray) -> bool:
        """Whether some input in the update's row space (x = V_B c) leaves exactly ``rows`` off:
        max ε subject to ±(W_j V_B c + t b_j) ≥ ε ‖(W_j V_B, b_j)‖ (− on ``rows``), |c| ≤ 1, 0 ≤ t ≤ 1
        (scale-free: the input is V_B c / t), a linear program; ε > 0 means yes. A common zero set of
        several δs, or the near-zeros of a difference of two similar δs, is no ReLU's pattern."""
        m, B = self.WV.shape
        sign = np.ones(m)
        sign[rows] = -1.0
        norms = np.sqrt((self.WV ** 2).sum(1) + self.bias ** 2)
        a_ub = np.concatenate([-sign[:, None] * self.WV, -(sign * self.bias)[:, None], norms[:, None]], axis=1)
        done = linprog(np.concatenate([np.zeros(B + 1), [-1.0]]), A_ub=a_ub, b_ub=np.zeros(m),
                       bounds=[(-1, 1)] * B + [(0, 1), (None, 1)], method="highs")
        return done.status == 0 and float(done.x[-1]) > 0

    def clear_gap(self, v: np.ndarray, rows: np.ndarray) -> bool:
        """LeakyReLU: whether the small entries of v sit near the negative slope times the others (their
        medians' ratio at most GAP_FACTOR × the slope), as a δ's do and a mix of δs' do not."""
        small = np.zeros(len(v), dtype=bool)
        small[rows] = True
        if small.all():
            return False
        return float(np.median(np.abs(v[small]))) <= GAP_FACTOR * self.slope * float(np.median(np.abs(v[~small])))

    def zeros(self, v: np.ndarray, share: float | None = None) -> np.ndarray:
        """The rows a candidate δ = v leaves zero (ReLU) or holds at the negative slope (LeakyReLU: the gap)."""
        if self.slope == 0.0:
            return _zero_rows(v, self.zero_share if share is None else share)
        return _small_rows(v, self.slope)


class _Directions:
    """The exact directions found so far (unit q and unit δ = L q), and the tests and local searches
    that find them."""

    def __init__(self, layer: _Layer, rng: np.random.Generator):
        self.layer, self.rng = layer, rng
        self.q: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.zero_counts: list[int] = []
        self.nonzero_at = np.zeros(layer.L.shape[0])  # per row: how many found δs are nonzero there
        self.solves = 0

    def __len__(self) -> int:
        return len(self.q)

    def keep(self, directions: list[np.ndarray]) -> None:
        """Start again from ``directions`` alone (the certified ones)."""
        self.q, self.v, self.zero_counts = [], [], []
        self.nonzero_at[:] = 0.0
        for q in directions:
            self.accept(q)

    def accept(self, q: np.ndarray) -> tuple[bool, np.ndarray | None]:
        """Keep ``q`` when its δ has enough zeros, they pin one direction, some input of the layer leaves
        exactly them off (LeakyReLU: its small entries sit near the slope times the others) and it is
        new: (kept, None); when its zeros are those of a few δs plus stray rows: (False, the zeros
        without the strays)."""
        layer, B = self.layer, self.layer.batch
        v = layer.L @ q
        rows = layer.zeros(v)
        if len(rows) < layer.least_zeros or not np.all(np.isfinite(v)):
            return False, None
        if layer.slope == 0.0:
            u, singular, _ = np.linalg.svd(layer.L[rows], full_matrices=False)
            if singular[B - 2] <= layer.pure_share * singular[0]:  # they leave two or more directions free
                return False, rows
            leverage = (u[:, :B - 1] ** 2).sum(1)
            stray = leverage > 1 - layer.pure_share  # a row alone fixes the last direction: a stray zero
            if stray.any():
                return False, rows[~stray]
            if not layer.realizable(rows):
                return False, None
        elif not layer.clear_gap(v, rows):
            return False, None
        v = v / np.linalg.norm(v)
        if any(abs(float(v @ kept)) > SAME_DIRECTION for kept in self.v):
            return False, None
        self.q.append(q / np.linalg.norm(q))
        self.v.append(v)
        self.zero_counts.append(len(rows))
        self.nonzero_at += 1.0
        self.nonzero_at[rows] -= 1.0
        return True, None

    def start(self) -> np.ndarray:
        """A start: a random direction, or a row of L, preferring rows where the δs found are zero (a
        start at a row finds a δ that is large there: one not found yet)."""
        L = self.layer.L
        if self.rng.random() < 0.5:
            return self.rng.standard_normal(L.shape[1])
        weights = np.exp(-self.nonzero_at + self.nonzero_at.min())
        return L[self.rng.choice(len(L), p=weights / weights.sum())]

    def null_space(self, rows: np.ndarray) -> np.ndarray:
        """(B, k) an orthonormal basis of the directions that vanish on ``rows``."""
        B = self.layer.batch
        _, singular, vt = np.linalg.svd(self.layer.L[rows], full_matrices=True)
        full = np.zeros(B)
        full[:len(singular)] = singular
        k = int((full <= self.layer.pure_share * singular[0]).sum())
        return vt[B - k:].T

    def explore(self, local) -> None:
        """One local solve from a start, its zeros' null vector tested; a few δs' common zeros are
        searched as a subspace."""
        layer, B = self.layer, self.layer.batch
        self.solves += 1
        v = layer.L @ local(layer.L, self.start())
        rows = layer.zeros(v, share=layer.loose_share)
        if len(rows) < B - 1:
            return
        if layer.slope != 0.0:
            self.accept(_null_direction(layer.L[rows]))
            return
        basis = self.null_space(rows)
        if basis.shape[1] == 1:
            kept, rows = self.accept(basis[:, 0])
            if rows is None:
                return
            basis = self.null_space(rows)
        if 2 <= basis.shape[1] <= MAX_SUBSPACE:
            self.subspace(basis, rows)

    def subspace(self, basis: np.ndarray, rows: np.ndarray) -> None:
        """The directions inside span(``basis``) (k of them: the δs whose common zeros are ``rows``):
        null vectors of k − 1 of the other rows, drawn at random (SPEAR's sampling, in k dimensions)."""
        k = basis.shape[1]
        projected = self.layer.L @ basis
        others = np.setdiff1d(np.arange(len(projected)), rows)
        if len(others) < k - 1:
            return
        wanted = len(self) + k
        for _ in range(SUBSPACE_DRAWS * 2 ** k):
            drawn = self.rng.choice(others, size=k - 1, replace=False)
            self.accept(basis @ _null_direction(projected[drawn]))
            if len(self) >= min(wanted, self.layer.batch):
                return

    def draw(self) -> None:
        """SPEAR's sampling: the null vector of B − 1 random rows of L."""
        layer, B = self.layer, self.layer.batch
        self.solves += 1
        rows = self.rng.choice(layer.L.shape[0], size=B - 1, replace=False)
        self.accept(_null_direction(layer.L[rows]) if B > 1 else np.ones(1))


def _iterate_missing(layer: _Layer, Q: np.ndarray, free: list[int], rounds: int = COMPLETION_ROUNDS,
                     share: float = CONFIDENT_SHARE, margin: float = 0.0) -> np.ndarray:
    """Completion's iteration: the inputs the directions Q give, then each free column the direction
    whose δ vanishes on the ``share`` of units where its input's pre-activation is most clearly negative
    (below −``margin`` times its largest); until the free columns stop moving. The others are held."""
    B = layer.batch
    Q = Q.copy()
    for _ in range(rounds):
        try:
            z = layer.pre_activations(Q)
        except np.linalg.LinAlgError:
            return Q
        moved = 0.0
        for i in free:
            column = np.nan_to_num(z[:, i], nan=0.0, posinf=0.0, neginf=0.0)
            negative = np.flatnonzero(column < -margin * np.abs(column).max())
            negative = negative[np.argsort(column[negative])]
            rows = negative[:max(B - 1, int(share * len(negative)))]
            if len(rows) < B - 1:
                rows = np.argsort(column)[:B - 1]
            q = _null_direction(layer.L[rows])
            moved = max(moved, 1.0 - abs(float(q @ Q[:, i])))
            Q[:, i] = q
        if moved < 1e-13:
            break
    return Q


def _polish(layer: _Layer, Q: np.ndarray, rounds: int = 3) -> np.ndarray:
    """Every direction again as the null vector of all the units its input leaves clearly off: with a
    noisy update, more rows than the search needed average the noise down."""
    margin = max(UNCLEAR_SHARE, UNCLEAR_NOISE_FACTOR * layer.noise)
    return _iterate_missing(layer, Q, list(range(layer.batch)), rounds=rounds, share=1.0, margin=margin)


def _complete(found: _Directions, starts: int = COMPLETION_STARTS) -> np.ndarray:
    """(B, B) directions: the found ones, then the missing ones by completion from random starts (each
    start after keeping what the last one found exactly); the last iterate's columns where none was."""
    layer, B = found.layer, found.layer.batch
    Q = np.zeros((B, B))
    for _ in range(starts):
        held = min(len(found), B)
        Q[:, :held] = np.stack(found.q[:held], axis=1) if held else Q[:, :0]
        if held >= B:
            break
        Q[:, held:] = found.rng.standard_normal((B, B - held))
        Q = _iterate_missing(layer, Q, list(range(held, B)))
        for i in range(held, B):
            found.accept(Q[:, i])
    return Q


def _choose(found: _Directions, batch: int) -> None:
    """Keep at most ``batch`` found directions: those with the most zeros, each only while the kept δs
    stay well conditioned (a ReLU search stops at B; a LeakyReLU one collects more to rank)."""
    order = sorted(range(len(found)), key=lambda k: -found.zero_counts[k])
    kept: list[int] = []
    for k in order:
        trial = np.stack([found.v[i] for i in kept + [k]], axis=1)
        if np.linalg.svd(trial, compute_uv=False)[-1] > MIN_CONDITION:
            kept.append(k)
        if len(kept) == batch:
            break
    if len(kept) == len(found):
        return
    found.q = [found.q[k] for k in kept]
    found.v = [found.v[k] for k in kept]
    found.zero_counts = [found.zero_counts[k] for k in kept]
    found.nonzero_at[:] = len(kept)
    for v in found.v:
        found.nonzero_at[found.layer.zeros(v)] -= 1.0


def _search(found: _Directions, local, budget: int) -> int:
    """The sparse search until B directions are held or ``budget`` local solves are spent, with a
    completion whenever it stalls for a while at a new count: how many directions completion found."""
    layer, B, completed = found.layer, found.layer.batch, 0
    patience = max(16, layer.L.shape[0] // 8)
    last_new, tried_at = found.solves, -1
    # LeakyReLU: twice B candidates, for ``_choose`` to rank (a mix of δs passes its tests too)
    wanted = B if layer.slope == 0.0 else 2 * B
    # one input: any direction is L's one column, which completion gives
    while B > 1 and found.solves < budget and len(found) < wanted and found.solves - last_new < 4 * patience:
        before = len(found)
        found.explore(local) if local is not None else found.draw()
        if len(found) > before:
            last_new = found.solves
        if found.solves - last_new >= patience and len(found) != tried_at and B // 2 <= len(found) < B:
            tried_at, before = len(found), len(found)
            _complete(found, starts=2)
            completed += len(found) - before
            last_new = found.solves
    return completed


def certify(weight: torch.Tensor, bias: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor,
            deltas: torch.Tensor, inputs: torch.Tensor, slope: float = 0.0) -> tuple[torch.Tensor, float, float, torch.Tensor]:
    """The certificate of a recovered set of k pairs (δ_i (k, m), x_i (k, n)) against the layer (W, b)
    and its gradients (G, g_b, to a common scale): (exact per input, the set's relative residual on G
    and on g_b, per input the units where δ_i's zeros (LeakyReLU: its small entries) differ from
    {z_i ≤ 0}). Entries of δ_i and units of z_i within the update's noise beyond rank k (``noise_level``)
    of zero are not called either way. The inputs are exact together or not at all: the
    set reproduces G and g_b, and every δ_i matches its input's pattern. Only a ReLU layer is certified."""
    W, b, G, gb = (t.detach().double().cpu() for t in (weight, bias, grad_weight, grad_bias))
    D, X = deltas.detach().double().cpu(), inputs.detach().double().cpu()
    finite = torch.isfinite(X).all(1) & torch.isfinite(D).all(1)
    D, X = torch.where(finite[:, None], D, 0.0), torch.where(finite[:, None], X, 0.0)
    residual = float((D.T @ X - G).norm() / G.norm().clamp_min(1e-300))
    bias_residual = float((D.sum(0) - gb).norm() / gb.norm().clamp_min(1e-300))
    noise = noise_level(torch.linalg.svdvals(G), len(D)) if len(D) else 0.0
    z = X @ W.T + b
    off = z <= 0
    size = D.abs() / D.abs().amax(1, keepdim=True).clamp_min(1e-300)
    if slope == 0.0:  # within the noise band a δ entry is neither clearly zero nor clearly not
        zero = size <= max(ZERO_SHARE, CLEAR_ZERO_FACTOR * noise)
        nonzero = size > max(ZERO_SHARE, CLEAR_NONZERO_FACTOR * noise)
    else:
        zero = torch.zeros_like(off)
        for i, row in enumerate(D.numpy()):
            zero[i, torch.from_numpy(_small_rows(row, slope))] = True
        nonzero = ~zero
    unclear = z.abs() <= max(UNCLEAR_SHARE, UNCLEAR_NOISE_FACTOR * noise) * z.abs().amax(1, keepdim=True)
    wrong = ((nonzero & off) | (zero & ~off)) & ~unclear
    mismatches = torch.where(finite, wrong.sum(1), torch.full_like(finite, off.shape[1], dtype=torch.long))
    # every input or none: a wrong direction elsewhere in the set (a mix of δ_j and δ_i) shifts x_i along
    # x_j without moving its pattern, and fails only input j's check
    ok = residual <= RESIDUAL_TOLERANCE and bias_residual <= RESIDUAL_TOLERANCE and slope == 0.0 and \
        bool((mismatches == 0).all())
    return torch.full_like(finite, ok), residual, bias_residual, mismatches


def _answer(layer: _Layer, W: torch.Tensor, b: torch.Tensor, G: torch.Tensor, gb: torch.Tensor, live: torch.Tensor,
            Q: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, tuple, np.ndarray]:
    """(δs (B, m), inputs (B, n), their certificate, Q) from the directions Q."""
    D, Xt = layer.solve(Q)
    deltas = torch.zeros(layer.batch, G.shape[0], dtype=torch.float64)
    deltas[:, live] = torch.from_numpy(np.ascontiguousarray(D.T))
    inputs = torch.from_numpy(np.ascontiguousarray(Xt))
    return deltas, inputs, certify(W, b, G, gb, deltas, inputs, layer.slope), Q


def _consistent(answer: tuple) -> int:
    """How many inputs of an answer match their ReLU pattern (``certify``'s mismatches of 0)."""
    return int((answer[2][3] == 0).sum())


def _recover(layer: _Layer, found: _Directions, local, budget: int, W, b, G, gb, live) -> tuple:
    """Search, complete what is missing, polish, certify; then, until every input is certified and up to
    ``REPAIRS`` times, keep only the directions whose input matches its ReLU pattern (its δ is right;
    its input may still be shifted by a wrong direction elsewhere) or, with none, drop the direction
    with the fewest zeros (a mix of δs has fewer than a δ), and search and complete again. Returns (δs,
    inputs, certificate, directions found by the sparse search and by completion, repairs made), the
    answer with the most inputs that match their pattern."""
    B = layer.batch
    best, searched, completed, repairs = None, 0, 0, 0
    while True:
        before = len(found)
        added = _search(found, local, budget)
        searched += len(found) - before - added
        completed += added
        _choose(found, B)
        before = len(found)
        Q = _complete(found) if len(found) < B else np.stack(found.q, axis=1)
        completed += len(found) - before
        # the polish averages a ReLU layer's noise down; it would pull a LeakyReLU one off its δs
        for answer in ([_answer(layer, W, b, G, gb, live, _polish(layer, Q))] if layer.slope == 0.0 else []) + \
                [_answer(layer, W, b, G, gb, live, Q)]:
            if best is None or _consistent(answer) > _consistent(best):
                best = answer
        consistent = best[2][3] == 0  # the inputs whose δ matches their ReLU pattern: their δ is right
        if bool(best[2][0].all()) or repairs == REPAIRS or len(found) < 2 or layer.slope != 0.0:
            return (*best[:3], searched, completed, repairs)
        if bool(consistent.any()):
            found.keep([best[3][:, k] for k in range(B) if bool(consistent[k])])
        else:
            weakest = int(np.argmin(found.zero_counts))
            found.keep([q for k, q in enumerate(found.q) if k != weakest])
        repairs += 1


def recover_batch(weight: torch.Tensor, bias: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor,
                  slope: float = 0.0, batch: int | None = None, max_batch: int | None = None,
                  search: str = "irls", seed: int = 0, budget: int | None = None) -> BatchRecovery:
    """Recover the B inputs of a linear layer z = W x + b followed by ReLU (``slope`` 0) or LeakyReLU
    (its negative slope) from its gradients G (m, n) and g_b (m,), to a common scale (e.g. an SGD
    update). ``batch``: B when known, else the numerical rank of G (at most ``max_batch``);
    ``search``: "irls", "lp" or "sampling" (module docstring); ``budget``: the search's local solves
    (default 4 per live unit for IRLS, one per two units for the slower linear programs, 20,000 draws)."""
    if search not in SEARCHES:
        raise ValueError(f"unknown search {search!r}; choose one of: {', '.join(SEARCHES)}")
    W, b, G, gb = (t.detach().double().cpu() for t in (weight, bias, grad_weight, grad_bias))
    n = G.shape[1]
    live = torch.nonzero((G.abs().sum(1) > 0) | (gb.abs() > 0)).flatten()  # a unit off for every input says nothing
    U, S, Vh = torch.linalg.svd(G[live], full_matrices=False)
    rank = numerical_rank(S, limit=max(1, int(MAX_BATCH_SHARE * min(len(live), n))))
    B = int(batch) if batch else min(rank, int(max_batch) if max_batch else rank)
    if B < 1 or B >= min(len(live), n):
        raise ValueError(f"a batch of {B} cannot be recovered from a layer update with {len(live)} live units and "
                         f"{n} inputs (B must be at least 1 and below both)")
    notes = [] if not batch or rank == B else [f"the update's numerical rank is {rank}, not the batch of {B}"]
    noise = noise_level(S, B)
    L, R = U[:, :B].numpy(), (S[:B, None] * Vh[:B]).numpy()
    layer = _Layer(L, R, W[live].numpy() @ R.T, W[live].numpy() @ Vh[:B].numpy().T, b[live].numpy(), gb[live].numpy(), float(slope), noise,
                   max(2 * B, len(live) // 8))
    default = {"irls": 4 * len(live), "lp": max(len(live) // 2, 2 * B), "sampling": 20_000}[search]
    found = _Directions(layer, np.random.default_rng(seed))
    deltas, inputs, certificate, searched, completed, repairs = _recover(
        layer, found, {"irls": _irls, "lp": _lp}.get(search), int(budget or default), W, b, G, gb, live)
    exact, residual, bias_residual, mismatches = certificate
    if not bool(exact.all()) and slope == 0.0:
        notes.append(f"not certified: {int((mismatches == 0).sum())} of {B} inputs match their ReLU pattern (a wrong "
                     f"direction can shift the others without changing theirs)")
    return BatchRecovery(inputs, deltas, exact, residual, bias_residual, mismatches, B, rank, searched, completed,
                         repairs, found.solves, notes)


# ------------------------------------------------------------------------------------------------
# the attack on one upload: the layer's update, the inputs, the images


# a recovered input counts as exact at or below this relative error (the statistics' rule)
EXACT_INPUT = 1e-4
# seconds per L-BFGS step of the image rebuild and per image (``attacks.malicious``'s rate for the same
# rebuild); the recovery itself takes about a second per target at B = 16
STEP_SECONDS = 0.0014


def attacked_layer(model: nn.Module, uploaded: list[str]) -> tuple[str, float] | None:
    """(name, negative slope) of the extractor's first linear layer followed directly by ReLU (slope 0)
    or LeakyReLU whose weight and bias are among ``uploaded``; None when there is none."""
    children = list(model.extractor.named_children())
    for (name, module), (_, following) in zip(children, children[1:]):
        prefix = f"extractor.{name}"
        if isinstance(module, nn.Linear) and module.bias is not None and \
                {f"{prefix}.weight", f"{prefix}.bias"} <= set(uploaded):
            if isinstance(following, nn.ReLU):
                return prefix, 0.0
            if isinstance(following, nn.LeakyReLU):
                return prefix, float(following.negative_slope)
    return None


def undo_weight_decay(weight: torch.Tensor, bias: torch.Tensor, grad_weight: torch.Tensor,
                      grad_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """An SGD step with weight decay adds κ·(W, b) (κ = lr × decay) to a low-rank update: the κ for
    which ΔW + κW has the least nuclear norm (convex in κ: a bounded scalar search), and the update
    (ΔW + κW, Δb + κb) without it."""
    W, b, G, gb = (t.detach().double().cpu() for t in (weight, bias, grad_weight, grad_bias))
    scale = float(G.norm() / W.norm().clamp_min(1e-300))
    done = minimize_scalar(lambda k: float(torch.linalg.svdvals(G + k * W).sum()), bounds=(-scale, scale),
                           method="bounded", options={"xatol": 1e-10 * scale, "maxiter": 200})
    kappa = float(done.x)
    return G + kappa * W, gb + kappa * b, kappa


def _rank(grad_weight: torch.Tensor, grad_bias: torch.Tensor) -> tuple[int, int]:
    """(numerical rank, live units) of a layer's update (a drop in its spectrum where noise fills it)."""
    live = (grad_weight.abs().sum(1) > 0) | (grad_bias.abs() > 0)
    units = int(live.sum())
    cap = max(1, int(MAX_BATCH_SHARE * min(units, grad_weight.shape[1])))
    return numerical_rank(torch.linalg.svdvals(grad_weight[live]), limit=cap), units


def low_rank_update(weight: torch.Tensor, bias: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor,
                    layer: str, known: int, notes: list[str]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(G, g_b, B): the layer's update and B, its numerical rank, with a weight decay's κ·(W, b) removed
    where the update is not low-rank without; a note where B differs from the ``known`` number of images.
    ``NotApplicable`` when the update is zero, or B is above ``MAX_BATCH_SHARE`` of the live units
    (not one gradient of a small batch). ``known``: the images the attack was asked to rebuild."""
    G, gb = grad_weight.detach().double().cpu(), grad_bias.detach().double().cpu()
    rank, live = _rank(G, gb)
    if rank == 0:
        raise NotApplicable(f"the update of {layer} is zero: there is nothing to recover")
    cap = max(1, int(MAX_BATCH_SHARE * min(live, G.shape[1])))
    if rank > cap:
        G, gb, kappa = undo_weight_decay(weight, bias, G, gb)
        rank, live = _rank(G, gb)
        if rank > cap:
            raise NotApplicable(f"the update of {layer} has rank {rank} (above {cap}, a quarter of its {live} live "
                                f"units), also after removing a fitted weight decay: it is not one gradient of a "
                                f"small batch (try --victim-batch B, B at most {cap})")
        notes.append(f"the update of {layer} is low-rank once a weight decay's {kappa:.3g} × the weights is "
                     f"removed (SGD's decay times its learning rate)")
    if known and rank != known:
        notes.append(f"the update of {layer} has rank {rank}, not the {known} images asked for (augmented copies, "
                     f"several steps or repeated images change it): {rank} inputs recovered")
    return G, gb, rank


def rebuild_images(model: nn.Module, layer: str, inputs: torch.Tensor, image_shape: tuple[int, int, int],
                   iterations: int) -> torch.Tensor:
    """(B, C, H, W) images in [0, 1] whose inputs of ``layer`` are ``inputs``: the normalised image
    itself where the layer sees the pixels, else by inverting the layers before it
    (``attacks.inversion.layer_inputs``: L-BFGS from the per-channel mean image the normalisation carries)."""
    if first_layer_sees_pixels(model, layer):
        x = inputs.reshape(-1, *image_shape) * model.normalize.std + model.normalize.mean
        return x.clamp(0, 1).detach()
    start = mean_image(model.normalize.mean.flatten(), (1, *image_shape))[0]
    return invert_layer_inputs(lambda x: layer_inputs_differentiable(model, layer, x), inputs, start, iterations)


def spear(observation: Observation, budget: Budget, seed: int, search: str = "irls") -> AttackResult:
    """Recover every input of the attacked layer from the upload's update, certify each, rebuild the
    images (module docstring)."""
    started = time.perf_counter()
    target = update_target(observation)
    model = load(observation.make_model().cpu(), {n: v.cpu() for n, v in target.before.items()})
    found = attacked_layer(model, target.names)
    if found is None:
        raise NotApplicable("the upload holds no linear layer of the extractor followed directly by ReLU or "
                            "LeakyReLU (e.g. extractor.fc): there is no sparse gradient to read")
    layer, slope = found
    W, b = target.before[f"{layer}.weight"], target.before[f"{layer}.bias"]
    notes = list(target.notes)
    G, gb, B = low_rank_update(W, b, target.delta[f"{layer}.weight"], target.delta[f"{layer}.bias"], layer,
                               int(budget.batch), notes)
    recovery = recover_batch(W, b, G, gb, slope=slope, batch=B, search=search, seed=seed)
    dtype = next(model.parameters()).dtype
    inputs = torch.nan_to_num(recovery.inputs, nan=0.0, posinf=0.0, neginf=0.0).to(dtype)
    images = rebuild_images(model, layer, inputs, observation.image_shape, budget.iterations)
    certified = int(recovery.exact.sum())
    matching = int((recovery.pattern_mismatches == 0).sum())
    notes.append(f"{layer} (ReLU): {B} inputs recovered from its update, "
                 + ("all certified exact (they reproduce the update and each matches the ReLU's pattern under the "
                    "known weights)" if certified else f"not certified ({matching} of {B} match their ReLU pattern)")
                 if slope == 0.0 else
                 f"{layer} (LeakyReLU, slope {slope:g}): {B} inputs recovered from its update, approximately (its "
                 f"gradients are small, not zero, where a unit is off), never certified")
    notes += [n for n in recovery.notes if not n.startswith("not certified")]
    trace = {"mode": "spear", "layer": layer, "slope": slope, "batch": B, "rank": recovery.rank,
             "certified": certified, "residual": recovery.residual, "bias_residual": recovery.bias_residual,
             "found": recovery.found, "completed": recovery.completed, "repairs": recovery.repairs,
             "solves": recovery.solves, "search": search, "seconds": time.perf_counter() - started}
    result = AttackResult(images, torch.full((B,), -1, dtype=torch.long), trace=trace, notes=notes)
    result.variables["inputs"] = inputs
    result.variables["certified"] = recovery.exact
    # the before-state the layer's true inputs are computed under, for the scoring
    result.variables.update({f"before:{n}": v.cpu() for n, v in target.before.items() if n.startswith("extractor.")})
    return result


def score_inputs(make_model, record, result: AttackResult, truths: torch.Tensor, truth_labels: torch.Tensor,
                 prior: torch.Tensor) -> list[dict]:
    """One row per image the client trained on (``AttackSpec.score_target``; ``record`` is None): its
    input of the attacked layer under the before-state matched one-to-one to a recovered one (relative
    error, inf where none was left), the image rebuilt from that input scored against it (an unmatched
    image is scored as the prior), and whether that input was certified."""
    state = {n.removeprefix("before:"): v for n, v in result.variables.items() if n.startswith("before:")}
    layer = result.trace["layer"]
    model = load(make_model().cpu(), state)
    truth_inputs = layer_inputs(model, layer, truths.to(next(model.parameters()).dtype))
    chosen, errors = match_inputs(result.variables["inputs"], truth_inputs)
    certified = result.variables["certified"]
    rows = []
    for j in range(len(truths)):
        rebuilt = result.images[chosen[j]] if chosen[j] >= 0 else prior
        rows.append({"truth_index": j, "reconstruction": int(chosen[j]), "input_error": float(errors[j]),
                     "psnr": psnr(rebuilt, truths[j]), "ssim": ssim(rebuilt, truths[j]),
                     "prior_psnr": psnr(prior, truths[j]), "label_true": int(truth_labels[j]),
                     "certified": int(chosen[j] >= 0 and bool(certified[chosen[j]]))})
    return rows


def spear_statistics(rows: list[dict], seed: int) -> dict:
    """Shares of images whose layer input was recovered exactly (relative error ≤ ``EXACT_INPUT``) and
    certified, each with a 95 % interval that resamples attacked clients."""
    if not rows:
        return {"inputs_exact_share": None, "inputs_exact_share_ci": None, "inputs_certified_share": None,
                "inputs_certified_share_ci": None, "inputs_median_error": None}
    return {**input_shares(rows, seed, {"inputs_exact": lambda e, _: e <= EXACT_INPUT,
                                        "inputs_certified": lambda _, rs: [bool(r["certified"]) for r in rs]}),
            "inputs_exact_rule": f"relative error of the recovered layer input <= {EXACT_INPUT:g}"}


def spear_lines(summary: dict) -> list[str]:
    """The terminal's line for ``spear_statistics`` (none without rows)."""
    if summary.get("inputs_exact_share") is None:
        return []
    low, high = summary["inputs_exact_share_ci"]
    c_low, c_high = summary["inputs_certified_share_ci"]
    return [f"  layer inputs: exact (error <= {EXACT_INPUT:g}) for {summary['inputs_exact_share']:.0%} "
            f"[{low:.0%}, {high:.0%}] of the images, certified for {summary['inputs_certified_share']:.0%} "
            f"[{c_low:.0%}, {c_high:.0%}]; median error {summary['inputs_median_error']:.1e}"]


SPEC = ClientAttackSpec("spear", attack_one=spear, default_victim_batch=8, applies_to=frozenset({"extractor"}),
                        scoring="images", needs="extractor weights", hint=GRADIENT_HINT, extra_columns=("certified",),
                        score_target=score_inputs, statistics=spear_statistics, summary_lines=spear_lines,
                        estimate_rate=STEP_SECONDS, estimate_per="image")
