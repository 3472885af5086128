"""Accounting for distributed differential privacy under secure aggregation: each client adds Skellam
noise to its quantised values before masking (``fedecouple.secure_aggregation``, ``dp_noise``), so the
server unmasks only the sum with the noise of every survivor.

The bound. Agarwal, Kairouz and Liu 2021, "The Skellam Mechanism for Differentially Private Federated
Learning", Theorem 3.5 (the multi-dimensional Skellam mechanism's RDP), where the Skellam noise is
parametrised by its variance V (each coordinate Poisson(V/2) − Poisson(V/2)): for an integer order
α > 1 and integer-valued queries of L1 and L2 sensitivity Δ₁ and Δ₂,

    ε(α) = α·Δ₂² / (2V) + min( ((2α − 1)·Δ₂² + 6·Δ₁) / (4V²),  3·Δ₁ / (2V) ).

The first term is the Gaussian mechanism's at the same variance; the minimum is what discreteness costs.
Here each of n survivors adds Skellam(μ, μ) = Poisson(μ) − Poisson(μ) (variance 2μ), so the summed noise
is Skellam(nμ, nμ): V = 2·μ_total with μ_total = n·μ (``rdp``), and for large μ_total the bound tends to
the Gaussian's α·Δ₂² / (4·μ_total). Δ₁ and Δ₂ are the protocol's (``SecureAggregation.sensitivity``):
Δ₂ = dp_l2_clip·s + √d and Δ₁ = min(√d·Δ₂, Δ₂²) in integer steps, for neighbouring rounds in which one
client's contribution is removed (its values replaced by zero; its participation is public, as in
Flower, and its own noise stays in the sum).

Composition adds RDP over the released sums at every order of ``ORDERS`` (integers, as the theorem
needs); the conversion to (ε, δ) is Opacus's ``get_privacy_spent`` (Balle et al. 2020, "Hypothesis
Testing Interpretations and Renyi Differential Privacy"). Nothing is amplified by sampling: a client is
charged for every round as if it took part in all of them. A round's ε is computed at its actual
survivors (fewer survivors, less noise, a larger ε); a round aborted or skipped releases nothing.

Against a server that isolates one client (model inconsistency, or sybils that add no noise of their
own) the sum holds the target's own noise alone: its ε is that of n = 1 (``isolated_epsilon``).
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable

import numpy as np
from opacus.accountants.analysis.rdp import get_privacy_spent

from fedecouple.errors import UserError
from fedecouple.secure_aggregation import SecureAggregation

ORDERS = np.array([*range(2, 65), *range(72, 257, 8), 320, 384, 512, 768, 1024, 2048, 4096], dtype=float)


def rdp(orders: np.ndarray, l1: float, l2: float, mu_total: float) -> np.ndarray:
    """Theorem 3.5's ε(α) at each of ``orders`` for Skellam(μ_total, μ_total) noise (variance 2·μ_total)
    and sensitivities Δ₁ = ``l1``, Δ₂ = ``l2`` (module docstring); infinite without noise."""
    orders = np.asarray(orders, dtype=float)
    if mu_total <= 0:
        return np.full(orders.shape, np.inf)
    variance = 2.0 * mu_total
    gaussian = orders * l2 ** 2 / (2 * variance)
    discrete = np.minimum(((2 * orders - 1) * l2 ** 2 + 6 * l1) / (4 * variance ** 2), 3 * l1 / (2 * variance))
    return gaussian + discrete


def epsilon_of(rdp_values: np.ndarray, delta: float) -> float:
    """(ε, δ)-DP from RDP at ``ORDERS`` (Opacus's conversion). The best order at an end of the grid only
    means a looser ε, never a wrong one, so Opacus's warning about it is silenced."""
    if not np.all(np.isfinite(rdp_values)):
        return math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = get_privacy_spent(orders=ORDERS, rdp=rdp_values, delta=delta)
    return float(eps)


def round_rdp(protocol: SecureAggregation, survivors: int, dimension: int, mu: float | None = None) -> np.ndarray:
    """RDP at ``ORDERS`` of one released sum of ``survivors`` clients' ``dimension`` values, each client's
    noise μ = ``mu`` (default: the protocol's ``dp_noise``); zero for a sum never released (no survivor)."""
    if survivors < 1:
        return np.zeros_like(ORDERS)
    mu = protocol.dp_noise if mu is None else mu
    l1, l2 = protocol.sensitivity(dimension)
    return rdp(ORDERS, l1, l2, survivors * mu)


def round_epsilon(protocol: SecureAggregation, survivors: int, dimension: int, delta: float | None = None) -> float:
    """ε of one released sum of ``survivors`` clients (δ: the protocol's ``dp_delta`` unless given)."""
    return epsilon_of(round_rdp(protocol, survivors, dimension), protocol.dp_delta if delta is None else delta)


def total_epsilon(protocol: SecureAggregation, survivors: Iterable[int], dimension: int,
                  delta: float | None = None, mu: float | None = None) -> float:
    """ε of the composition of the sums released with the given survivor counts (one per sum: a two-pass
    round counts twice), RDP added over them."""
    total = sum((round_rdp(protocol, int(n), dimension, mu) for n in survivors), np.zeros_like(ORDERS))
    return epsilon_of(total, protocol.dp_delta if delta is None else delta)


def isolated_epsilon(protocol: SecureAggregation, releases: int, dimension: int, delta: float | None = None) -> float:
    """ε of one client over ``releases`` sums against a server that isolates it each time (model
    inconsistency or sybil neighbours): the sum holds its own noise alone, n = 1."""
    return total_epsilon(protocol, [1] * int(releases), dimension, delta)


def calibrate(target_epsilon: float, delta: float, rounds: int, survivors: int, dimension: int, clip: float,
              protocol: SecureAggregation) -> float:
    """μ, each client's Skellam parameter, at which ``rounds`` released sums of ``survivors`` clients'
    ``dimension`` values, L2-clipped to ``clip``, compose to ε = ``target_epsilon`` at ``delta``
    (``protocol``: its quantisation; its own noise is ignored). By bisection on log μ: ε falls as μ grows."""
    if not target_epsilon > 0:
        raise UserError(f"the target epsilon must be positive, got {target_epsilon}")
    if rounds < 1 or survivors < 1 or dimension < 1:
        raise UserError(f"calibration needs at least one round, survivor and value (got {rounds}, {survivors}, "
                        f"{dimension})")
    shaped = SecureAggregation(clipping_range=protocol.clipping_range, quantization_range=protocol.quantization_range,
                               modulus=protocol.modulus, dp_noise=1.0, dp_l2_clip=clip, dp_delta=delta)

    def spent(mu: float) -> float:
        return total_epsilon(shaped, [survivors] * rounds, dimension, delta, mu)

    low, high = 1e-6, 1.0
    while spent(high) > target_epsilon:
        low, high = high, high * 16
        if high > 1e30:
            raise UserError(f"no noise reaches epsilon {target_epsilon} at delta {delta}: raise the epsilon")
    while spent(low) <= target_epsilon and low > 1e-30:
        low /= 16
    for _ in range(200):  # ε is continuous and decreasing in μ: halve the interval in log μ
        mid = math.sqrt(low * high)
        if spent(mid) > target_epsilon:
            low = mid
        else:
            high = mid
        if high / low < 1 + 1e-9:
            break
    return high


def recorded_releases(recorder, round: int) -> list[tuple[int, int]]:
    """(survivors, values) of each sum the server unmasked in ``round`` of a recorder kept under secure
    aggregation (``fedecouple.channel.Recorder``): the first pass's and any later pass's, none where the
    protocol halted."""
    records = [recorder.aggregates[round]] if round in recorder.aggregates else []
    records += [later.record for later in recorder.later_passes.get(round, [])]
    return [(len(r.survivors), r.dimension) for r in records if r.aborted is None and r.survivors]


def recorded_privacy(recorder, rounds: Iterable[int]) -> dict | None:
    """What distributed DP spent up to each of ``rounds`` in a recorded run (None: no noise): each
    round's ε (its sums at their actual survivors), the run's ε over every recorded round up to it, and
    a client's ε up to it against a server that isolates it (n = 1 in each of its sums)."""
    protocol = recorder.secure
    if protocol is None or not protocol.private:
        return None
    rounds = sorted(int(r) for r in rounds)
    recorded = sorted(r for r in recorder.aggregates if r <= max(rounds, default=-1))
    total, isolated, per_round = np.zeros_like(ORDERS), np.zeros_like(ORDERS), []
    for r in recorded:
        releases = recorded_releases(recorder, r)
        spent = sum((round_rdp(protocol, n, d) for n, d in releases), np.zeros_like(ORDERS))
        total = total + spent
        isolated = isolated + sum((round_rdp(protocol, 1, d) for _, d in releases), np.zeros_like(ORDERS))
        if r in rounds:
            per_round.append({"round": r, "survivors": [n for n, _ in releases],
                              "epsilon_round": epsilon_of(spent, protocol.dp_delta) if releases else 0.0,
                              "epsilon_total": epsilon_of(total, protocol.dp_delta),
                              "epsilon_isolated": epsilon_of(isolated, protocol.dp_delta)})
    return {"mechanism": "Skellam noise added by each client before masking; no amplification by sampling",
            "mu_per_client": protocol.dp_noise, "l2_clip": protocol.dp_l2_clip, "delta": protocol.dp_delta,
            "epsilon_total": per_round[-1]["epsilon_total"] if per_round else 0.0,
            "epsilon_isolated": per_round[-1]["epsilon_isolated"] if per_round else 0.0,
            "isolated_applies_to": "a server whose other participants add no noise it does not know (sybils); "
                                   "model inconsistency silences the others' updates, not their noise",
            "per_round": per_round}


def privacy_note(privacy: dict) -> str:
    """One line on what distributed DP spent (``recorded_privacy``'s record), for an attack's notes."""
    last = privacy["per_round"][-1] if privacy["per_round"] else None
    spent = "" if last is None else (f"; round {last['round']}'s sum epsilon {last['epsilon_round']:.3g}, the run "
                                     f"{last['epsilon_total']:.3g} up to it, a client isolated by sybils "
                                     f"{last['epsilon_isolated']:.3g}")
    return (f"distributed DP: each client added Skellam noise (mu {privacy['mu_per_client']:.4g}, L2 clip "
            f"{privacy['l2_clip']:g}) before masking, at delta {privacy['delta']:g}{spent}")
