"""Secure aggregation in the channel: the server holds the sum of a round's uploads, never one of them.

The protocol simulated is SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"; the double-masking scheme of Bonawitz et al. 2017, "Practical Secure
Aggregation for Privacy-Preserving Machine Learning") as Flower 1.42 runs it: its server
``SecAggPlusWorkflow`` (``flwr/server/workflow/secure_aggregation/secaggplus_workflow.py``) and its
client ``secaggplus_mod`` (``flwr/client/mod/secure_aggregation/secaggplus_mod.py``).

1. The server draws the round's neighbourhoods (``neighbourhoods``, the workflow's ``setup_stage``):
   from ``num_shares`` and ``reconstruction_threshold`` it derives the round's share count s and
   threshold t (``SecureAggregation.shares``), shuffles the participants onto a ring (seeded here) and
   gives each the s // 2 nearest on both sides. A client masks with its neighbours and splits its
   secrets into shares held by them and itself.
2. Each client turns what its method lets the server sum (``SecureSummation.secure_summands``) into one
   vector. A summand named ``sample_count`` is the client's weight w = n / max_weight, by which the
   others are weighted (``weighted_summands``); it travels as Flower's weight factor
   round(w · quantization_range), exactly, outside the clipping range, and the other values are
   weighted by that rounded weight instead (``with_flower_weight``), as the mod does. The other values
   are clipped to ``[-clipping_range, clipping_range]`` (values beyond are *counted*: the round's record
   says how many, as the clients would report them) and quantised to integers in
   ``[0, quantization_range]`` with seeded stochastic rounding (unbiased; each off by less than one step
   ``quantum``).
3. It adds a self mask and for every neighbour a pairwise mask that the neighbour subtracts, all
   uniform over ``[0, modulus)``, and sends the result modulo ``modulus``: the masked upload is uniform
   whatever the client's values are. Beside it goes what Flower's mod leaves in the clear (its FitRes
   without the arrays): the client's sample count and training metrics (``clear_values``), unless
   ``clear_fields`` is ``"hidden"``.
4. The server adds the masked uploads that arrived. The round halts, and the server learns nothing,
   where Flower's workflow halts (``halted``): fewer than two participants, or some participant's
   neighbourhood (itself included, survivor or dropped) keeping fewer than t surviving share-holders.
   Otherwise the pairwise masks between survivors cancel, and the survivors' self masks and their
   pairwise masks with dropped neighbours are removed with the seeds the shares let the server rebuild.

A method whose aggregate needs more than one sum (FedeCouple's eq. 16: a ``SecureTwoPass``) runs a
later pass as a fresh instance of the protocol among the previous pass's survivors (``for_pass``): a new
key agreement, so new neighbourhoods and masks; a mask used twice would let the server subtract a
client's two masked uploads and read the difference of its two vectors.

Distributed differential privacy (``dp_noise`` > 0; the Skellam mechanism of Agarwal, Kairouz and Liu
2021, "The Skellam Mechanism for Differentially Private Federated Learning"): before quantising, each
client clips the L2 norm of its update, its (weighted) values' distance from what it downloaded
(``reference_values``: a model's parameters are far from zero, its update is not), to ``dp_l2_clip``
(the record counts the clients clipped), and after quantising it adds to every value an independent
Skellam(μ, μ) draw, Poisson(μ) − Poisson(μ) with μ = ``dp_noise`` (``skellam_noise``), before masking.
Flower's weight factor travels without noise (under ``clear_fields="flower"`` the sample count it
carries is in the clear anyway). The server unmasks the survivors' integers plus the sum of their noise,
a Skellam(nμ, nμ) draw for n survivors: dropouts only leave fewer summands. The sum is read centred
(``decode``): the known offset n·quantization_range/2 subtracted modulo the modulus and the rest taken as
a signed integer, which is exact while n·quantization_range/2 plus the noise stays below modulus/2
(``check_headroom`` refuses a round where ten standard deviations of the summed noise reach it).
Sensitivity (``sensitivity``), for neighbouring rounds in which one client's update is removed (it sends
back what it downloaded: its participation is public, as in Flower): with the scale
s = quantization_range / (2·clipping_range) a client's centred integers z = q − quantization_range/2
have ‖z‖₂ ≤ Δ₂ = dp_l2_clip·s + √d (stochastic rounding moves each of the d values by less than one
step) and, being integers, ‖z‖₁ ≤ min(√d·Δ₂, Δ₂²). The accounting is ``defenses.distributed_dp``'s.

What is simulated, not computed: the key agreement and the Shamir shares. The masks' seeds are
derived from (seed, round, the pair) and the server obtains exactly the seeds the protocol gives
it, at the step it gives them; the arithmetic of masking and unmasking is the protocol's.
"""
from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np
import torch

from .errors import UserError
from .secure_defaults import CLEAR_FIELDS, DEFAULTS
WEIGHT = "sample_count"  # the summand that is the client's weight n / max_weight (``weighted_summands``)
METRIC_PREFIX = "metric."  # a training metric sent in the clear, as ``fedsec.flower`` names FitRes metrics


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (the engine's ``derive_seed``, kept here so the channel needs no engine)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32)
               .view(np.uint64)[0] >> 1)


def _count_or_fraction(value, name: str) -> int | float:
    """``value`` as Flower's workflow reads it: an integer is a count, a float a fraction; the integer 1
    means the fraction 1.0 (``SecAggPlusWorkflow._check_init_params``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name} must be an integer or a float, got {value!r}", fields=(name,))
    if isinstance(value, numbers.Integral):
        return 1.0 if int(value) == 1 else int(value)
    return float(value)


@dataclass(frozen=True)
class SecureAggregation:
    """The protocol's parameters, as Flower's ``SecAggPlusWorkflow`` takes them (defaults: its own, with
    every pair masking).

    ``num_shares``: into how many shares each client's secrets are split, one kept and one for each
    neighbour: an integer (at least 3) is that count, a float that fraction of the round's participants
    (1.0: every pair masks, as SecAgg). ``reconstruction_threshold``: how many shares rebuild a secret,
    an integer count or a float fraction of the shares (at least 2). ``max_weight``: the largest client
    weight (sample count) the sum is scaled for: a method's weighted summands are divided by it so they
    fit the clipping range. ``clear_fields``: ``"flower"``, each upload's sample count and training
    metrics travel unmasked beside it as in Flower's SecAgg+; ``"hidden"``, nothing does.

    Distributed DP (module docstring): ``dp_noise``, μ of the Skellam(μ, μ) noise each client adds to each
    quantised value before masking (0: off); ``dp_l2_clip``, the L2 norm (in value units) each client's
    value vector is clipped to first, required with noise; ``dp_delta``, the δ at which the run's ε is
    reported (the noise does not depend on it once μ is given)."""

    # the defaults are ``fedecouple.secure_defaults.DEFAULTS`` (read by the command line without torch)
    clipping_range: float = DEFAULTS["clipping_range"]
    quantization_range: int = DEFAULTS["quantization_range"]
    modulus: int = DEFAULTS["modulus"]
    num_shares: int | float = DEFAULTS["num_shares"]
    reconstruction_threshold: int | float = DEFAULTS["reconstruction_threshold"]
    max_weight: float = DEFAULTS["max_weight"]
    seed: int = 0
    clear_fields: str = DEFAULTS["clear_fields"]
    dp_noise: float = DEFAULTS["dp_noise"]
    dp_l2_clip: float | None = DEFAULTS["dp_l2_clip"]
    dp_delta: float = DEFAULTS["dp_delta"]

    def __post_init__(self) -> None:
        shares = _count_or_fraction(self.num_shares, "num_shares")
        threshold = _count_or_fraction(self.reconstruction_threshold, "reconstruction_threshold")
        object.__setattr__(self, "num_shares", shares)
        object.__setattr__(self, "reconstruction_threshold", threshold)
        if not self.clipping_range > 0:
            raise UserError(f"clipping_range must be positive, got {self.clipping_range}", fields=("clipping_range",))
        if self.quantization_range < 2:
            raise UserError(f"quantization_range must be at least 2, got {self.quantization_range}", fields=("quantization_range",))
        if self.modulus <= self.quantization_range or self.modulus > 2 ** 62:
            raise UserError(f"modulus must exceed quantization_range ({self.quantization_range}) and be at most "
                            f"2**62, got {self.modulus}", fields=("modulus", "quantization_range"))
        # Flower's own checks (``_check_init_params``), and a threshold of at least one share
        if isinstance(shares, int) and shares <= 2:
            raise UserError(f"num_shares as an integer must be at least 3 (or 1: every pair), got {shares}", fields=("num_shares",))
        if isinstance(shares, float) and not shares > 0:
            raise UserError(f"num_shares as a fraction must be positive, got {shares}", fields=("num_shares",))
        if isinstance(threshold, int) and threshold < 1:
            raise UserError(f"reconstruction_threshold as an integer must be at least 1, got {threshold}", fields=("reconstruction_threshold",))
        if isinstance(threshold, int) and isinstance(shares, int) and threshold >= shares:
            raise UserError(f"reconstruction_threshold ({threshold}) must be less than num_shares ({shares})", fields=("reconstruction_threshold", "num_shares"))
        if isinstance(threshold, float) and not 0 < threshold <= 1:
            raise UserError(f"reconstruction_threshold as a fraction must be in (0, 1], got {threshold}", fields=("reconstruction_threshold",))
        if not self.max_weight > 0:
            raise UserError(f"max_weight must be positive, got {self.max_weight}", fields=("max_weight",))
        if self.clear_fields not in CLEAR_FIELDS:
            raise UserError(f"clear_fields must be one of {', '.join(CLEAR_FIELDS)}, got {self.clear_fields!r}", fields=("clear_fields",))
        self._check_dp()

    def _check_dp(self) -> None:
        if not (isinstance(self.dp_noise, numbers.Real) and math.isfinite(self.dp_noise) and self.dp_noise >= 0):
            raise UserError(f"dp_noise must be a finite number >= 0 (0: no noise), got {self.dp_noise}",
                            fields=("dp_noise",))
        if self.dp_noise > 0 and not (self.dp_l2_clip is not None and math.isfinite(self.dp_l2_clip)
                                      and self.dp_l2_clip > 0):
            raise UserError(f"dp_l2_clip must be positive when dp_noise is set, got {self.dp_l2_clip}",
                            fields=("dp_l2_clip", "dp_noise"))
        if not 0 < self.dp_delta < 1:
            raise UserError(f"dp_delta must be in (0, 1), got {self.dp_delta}", fields=("dp_delta",))

    @property
    def private(self) -> bool:
        """Whether each client adds Skellam noise before masking (distributed DP)."""
        return self.dp_noise > 0

    @property
    def scale(self) -> float:
        """Integer steps per value unit: s = quantization_range / (2·clipping_range)."""
        return self.quantization_range / (2.0 * self.clipping_range)

    def sensitivity(self, dimension: int) -> tuple[float, float]:
        """(Δ₁, Δ₂): the L1 and L2 norms, in integer steps, of one client's centred quantised values
        (``dimension`` of them, the weight factor not counted) after the L2 clip: Δ₂ = dp_l2_clip·s + √d
        (stochastic rounding moves each value by less than one step), Δ₁ = min(√d·Δ₂, Δ₂²) (an integer
        vector's L1 norm is at most its squared L2 norm)."""
        if not self.private:
            raise ValueError("sensitivity is defined under distributed DP (dp_noise > 0)")
        root = math.sqrt(dimension)
        l2 = self.dp_l2_clip * self.scale + root
        return min(root * l2, l2 * l2), l2

    def check_headroom(self, count: int) -> None:
        """Refuse noise the centred decoding could misread: ``count`` survivors' offset
        count·quantization_range/2 plus ten standard deviations of their summed noise (√(2·count·μ)) must
        stay below modulus/2."""
        if not self.private or count < 1:
            return
        reach = count * self.quantization_range / 2 + 10 * math.sqrt(2 * count * self.dp_noise)
        if reach >= self.modulus / 2:
            raise UserError(f"{count} clients' offset (count x quantization_range / 2) plus ten standard deviations of "
                            f"their summed noise reach {reach:.4g}, not below modulus / 2 = {self.modulus / 2:.4g}, so "
                            f"the sum could wrap: raise modulus, or lower quantization_range or dp_noise "
                            f"(now {self.dp_noise:.4g})", fields=("dp_noise", "quantization_range", "modulus"))

    @property
    def quantum(self) -> float:
        """One quantisation step: a summand value decodes to within this of what the client sent."""
        return 2.0 * self.clipping_range / self.quantization_range

    def max_clients(self) -> int:
        """The most survivors whose quantised values sum below the modulus (no wrap-around)."""
        return (self.modulus - 1) // self.quantization_range

    def shares(self, participants: int) -> tuple[int, int]:
        """(s, t) for a round of ``participants``: each neighbourhood's share-holders and the shares that
        rebuild a secret, as ``SecAggPlusWorkflow.setup_stage`` derives them. A fraction of shares is
        round(fraction · participants), made odd when below the participants, and all of them when that
        leaves 2 or fewer; a fraction of threshold is round(fraction · shares) (Python's round: halves to
        even, so 0.5 of 5 shares is 2) and at least 2; the threshold is taken before an even share count
        below the participants is made odd."""
        if isinstance(self.num_shares, float):
            shares = round(self.num_shares * participants)
            if shares < participants and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = participants
        else:
            shares = self.num_shares
        if isinstance(self.reconstruction_threshold, float):
            threshold = max(round(self.reconstruction_threshold * shares), 2)
        else:
            threshold = self.reconstruction_threshold
        if participants != shares and shares % 2 == 0:
            shares += 1
        return shares, threshold

    def describe(self) -> dict:
        return {"clipping_range": self.clipping_range, "quantization_range": self.quantization_range,
                "modulus": self.modulus, "num_shares": self.num_shares,
                "reconstruction_threshold": self.reconstruction_threshold, "max_weight": self.max_weight,
                "clear_fields": self.clear_fields,
                **({"dp_noise": self.dp_noise, "dp_l2_clip": self.dp_l2_clip, "dp_delta": self.dp_delta}
                   if self.private else {})}


def for_pass(protocol: SecureAggregation, pass_index: int) -> SecureAggregation:
    """The protocol of a round's pass ``pass_index`` (0: the round's first): the same parameters, and for a
    later pass a seed of its own, so its ring, neighbourhoods and masks are those of a new key agreement."""
    if pass_index < 0:
        raise ValueError(f"pass_index must be >= 0, got {pass_index}")
    return protocol if pass_index == 0 else replace(protocol, seed=_seed(protocol.seed, 0x2A55, pass_index))


@dataclass(frozen=True)
class Layout:
    """The order and shapes of the named tensors that make one summand vector: the weight first (Flower's
    weight factor leads its vector), then the others by name."""

    fields: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> "Layout":
        names = sorted(tensors, key=lambda name: (name != WEIGHT, name))
        return cls(tuple((name, tuple(tensors[name].shape)) for name in names))

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for _, shape in self.fields)

    @property
    def weighted(self) -> bool:
        """Whether the vector leads with a weight (``WEIGHT``), which travels as Flower's weight factor."""
        return bool(self.fields) and self.fields[0][0] == WEIGHT

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> np.ndarray:
        if Layout.of(tensors) != self:
            raise ValueError("a client's summands differ in names or shapes from the round's layout")
        return np.concatenate([tensors[name].detach().cpu().to(torch.float64).reshape(-1).numpy()
                               for name, _ in self.fields]) if self.fields else np.zeros(0)

    def unflatten(self, vector: np.ndarray) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, shape in self.fields:
            size = math.prod(shape)
            out[name] = torch.from_numpy(np.array(vector[start:start + size], dtype=np.float64)).reshape(shape)
            start += size
        return out


@dataclass
class AggregateRecord:
    """One round as a secure-aggregation server holds it (with its masked uploads, in the recorder).

    ``participants``: the clients that joined the round's key agreement; ``survivors``: those whose
    masked upload arrived and is in the sum; ``dropped``: the others. ``total``: the decoded sum of the
    survivors' summands (``SecureSummation.secure_summands``), each value within ``len(survivors) * quantum`` of
    the sum of what they sent (their weighted values at Flower's rounded weights, ``with_flower_weight``);
    empty when ``aborted`` says why the round could not be unmasked. ``clipped``: values beyond the
    clipping range, summed over the survivors (counted client-side and reported; they were clipped before
    masking). ``clear``: survivor → the fields its upload carried unmasked (``clear_values``: its
    ``sample_count`` and ``metric.*``), empty under ``clear_fields="hidden"``. Under distributed DP
    (``SecureAggregation.private``) ``total`` carries the survivors' summed Skellam noise, ``dp_clipped``
    counts the survivors whose value vector the L2 clip shortened and ``noise`` is the summed noise's
    parameter (survivors × dp_noise; its variance is twice that, in integer steps)."""

    round: int
    participants: tuple[int, ...]
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    total: dict[str, torch.Tensor]
    quantum: float
    clipped: int = 0
    aborted: str | None = None
    layout: Layout | None = field(default=None, repr=False)
    clear: dict[int, dict[str, float]] = field(default_factory=dict)
    dp_clipped: int = 0
    noise: float = 0.0

    @property
    def dimension(self) -> int:
        """How many values carried noise: the layout's values without the weight factor."""
        if self.layout is None:
            return 0
        return self.layout.size - (1 if self.layout.weighted else 0)


def clear_values(tensors: Mapping[str, torch.Tensor], meta: Mapping) -> dict[str, float]:
    """What Flower's ``secaggplus_mod`` leaves unmasked of one client's reply (it clears only the arrays of
    its FitRes): the client's sample count (``num_examples``: the upload's ``sample_count``) and its
    training metrics (the upload's numeric metadata, as ``metric.<key>``)."""
    out: dict[str, float] = {}
    if WEIGHT in tensors:
        out[WEIGHT] = int(tensors[WEIGHT])
    for key, value in sorted(meta.items()):
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[METRIC_PREFIX + str(key)] = float(value)
    return out


def ring_order(protocol: SecureAggregation, round: int, participants) -> list[int]:
    """The participants in the order of the round's ring: shuffled as ``SecAggPlusWorkflow.setup_stage``
    shuffles them (``random.shuffle``), by a generator seeded with the protocol's seed and the round (the
    server draws it; Flower's is unseeded)."""
    ids = sorted({int(c) for c in participants})
    random.Random(_seed(protocol.seed, round, 0x5EC)).shuffle(ids)
    return ids


def neighbourhoods(protocol: SecureAggregation, round: int, participants) -> dict[int, set[int]]:
    """Each participant's neighbourhood, itself included: the clients that hold its shares. As
    ``SecAggPlusWorkflow.setup_stage`` builds ``nid_to_neighbours``: on the ring (``ring_order``) each
    participant is joined to the s // 2 nearest on both sides (s from ``shares``; every participant when
    that covers the ring)."""
    ids = ring_order(protocol, round, participants)
    if not ids:
        return {}
    shares, _ = protocol.shares(len(ids))
    half = shares >> 1
    return {c: {ids[(pos + offset) % len(ids)] for offset in range(-half, half + 1)} for pos, c in enumerate(ids)}


def neighbours(protocol: SecureAggregation, round: int, participants) -> dict[int, set[int]]:
    """The round's masking graph: each participant's neighbourhood without itself (every other
    participant under SecAgg, SecAgg+'s ring neighbours otherwise)."""
    return {c: hood - {c} for c, hood in neighbourhoods(protocol, round, participants).items()}


def halted(protocol: SecureAggregation, round: int, participants, survivors) -> str | None:
    """Why Flower's workflow halts the round, or None where it unmasks. The rule of
    ``SecAggPlusWorkflow``: ``setup_stage`` halts with fewer than two participants; ``_check_threshold``,
    run after every stage, halts when some participant's neighbourhood (``neighbourhoods``, itself
    included; a survivor or a dropped client alike) holds fewer than t surviving share-holders; and
    ``unmask_stage`` needs t shares of every participant's secret, which the same rule guarantees."""
    participants = sorted({int(c) for c in participants})
    alive = {int(c) for c in survivors}
    if len(participants) < 2:
        return (f"{len(participants)} participant{'' if len(participants) == 1 else 's'}: SecAgg+ needs at least "
                f"2, so the server cannot unmask")
    shares, threshold = protocol.shares(len(participants))
    hoods = neighbourhoods(protocol, round, participants)
    for client in participants:
        kept = len(hoods[client] & alive)
        if kept < threshold:
            return (f"{len(alive)} of {len(participants)} participants survived; client {client}'s neighbourhood "
                    f"kept {kept} of its {len(hoods[client])} share-holders, below the reconstruction threshold of "
                    f"{threshold}: the server cannot unmask")
    return None


def weight_factor(protocol: SecureAggregation, weight: float) -> int:
    """Flower's weight factor: round(weight · quantization_range), sent unmodified at the head of the
    client's vector (``secaggplus_mod``'s ``q_ratio``, with weight = num_examples / max_weight)."""
    factor = round(float(weight) * protocol.quantization_range)
    if factor < 0:
        raise ValueError(f"a client's weight is negative ({weight})")
    return factor


def with_flower_weight(protocol: SecureAggregation, summands: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The summands as Flower's mod quantises them (float64): the weight rounded to its factor over the
    quantisation range, and every other summand (weighted by the exact weight) reweighted by that rounded
    weight. Summands without a weight are returned as they are."""
    if WEIGHT not in summands:
        return {name: value.to(torch.float64) for name, value in summands.items()}
    weight = float(summands[WEIGHT])
    rounded = weight_factor(protocol, weight) / protocol.quantization_range
    scale = rounded / weight if weight else 0.0
    return {name: (torch.full_like(value, rounded, dtype=torch.float64) if name == WEIGHT
                   else value.to(torch.float64) * scale) for name, value in summands.items()}


def _mask(protocol: SecureAggregation, size: int, *parts: int) -> np.ndarray:
    rng = np.random.default_rng(_seed(protocol.seed, *parts))
    return rng.integers(0, protocol.modulus, size=size, dtype=np.uint64)


def _self_mask(protocol: SecureAggregation, round: int, client: int, size: int) -> np.ndarray:
    return _mask(protocol, size, round, client, 0xB1)


def _pair_mask(protocol: SecureAggregation, round: int, a: int, b: int, size: int) -> np.ndarray:
    return _mask(protocol, size, round, min(a, b), max(a, b), 0xAB)


def quantize(protocol: SecureAggregation, vector: np.ndarray, round: int, client: int) -> tuple[np.ndarray, int]:
    """(integers in [0, quantization_range], how many values were beyond the clipping range):
    seeded stochastic rounding of the clipped vector, as Flower's ``quantize``."""
    c = protocol.clipping_range
    clipped = int(np.count_nonzero(np.abs(vector) > c))
    scaled = (np.clip(vector, -c, c) + c) * (protocol.quantization_range / (2 * c))
    floor = np.floor(scaled)
    draw = np.random.default_rng(_seed(protocol.seed, round, client, 0x51)).random(len(vector))
    q = floor + (draw < (scaled - floor))
    return np.minimum(q, protocol.quantization_range).astype(np.uint64), clipped


def mask(protocol: SecureAggregation, quantised: np.ndarray, round: int, client: int,
         graph: dict[int, set[int]]) -> np.ndarray:
    """The client's masked upload: quantised values + self mask ± pairwise masks, modulo the modulus."""
    m = np.uint64(protocol.modulus)
    out = (quantised + _self_mask(protocol, round, client, len(quantised))) % m
    for other in sorted(graph[client]):
        pair = _pair_mask(protocol, round, client, other, len(quantised))
        out = (out + pair) % m if client < other else (out + (m - pair)) % m
    return out


def unmask(protocol: SecureAggregation, masked: dict[int, np.ndarray], round: int, graph: dict[int, set[int]],
           size: int) -> np.ndarray:
    """The sum of the survivors' quantised values from their masked uploads (``masked``: survivor →
    vector), removing their self masks and their pairwise masks with clients that dropped out."""
    m = np.uint64(protocol.modulus)
    total = np.zeros(size, dtype=np.uint64)
    for vector in masked.values():
        total = (total + vector) % m
    survivors = set(masked)
    for client in sorted(survivors):
        total = (total + (m - _self_mask(protocol, round, client, size))) % m
        for other in sorted(graph[client] - survivors):  # a dropped neighbour: its mask never cancels
            pair = _pair_mask(protocol, round, client, other, size)
            total = (total + (m - pair)) % m if client < other else (total + pair) % m
    return total


def dequantize_sum(protocol: SecureAggregation, total: np.ndarray, count: int) -> np.ndarray:
    """The float sum of ``count`` clients' values from the sum of their quantised values."""
    c = protocol.clipping_range
    return total.astype(np.float64) * (2 * c / protocol.quantization_range) - count * c


def clip_l2(protocol: SecureAggregation, values: np.ndarray) -> tuple[np.ndarray, bool]:
    """(the values scaled to L2 norm at most ``dp_l2_clip``, whether they were scaled)."""
    norm = float(np.linalg.norm(values))
    if norm <= protocol.dp_l2_clip:
        return values, False
    return values * (protocol.dp_l2_clip / norm), True


def skellam_noise(protocol: SecureAggregation, size: int, round: int, client: int) -> np.ndarray:
    """One client's noise (int64): ``size`` independent Skellam(μ, μ) draws, Poisson(μ) − Poisson(μ) with
    μ = ``dp_noise``, seeded by the protocol's seed, the round and the client."""
    rng = np.random.default_rng(_seed(protocol.seed, round, client, 0x5CE1))
    return rng.poisson(protocol.dp_noise, size).astype(np.int64) - rng.poisson(protocol.dp_noise, size).astype(np.int64)


def reference_values(protocol: SecureAggregation, layout: Layout, summands: Mapping[str, torch.Tensor],
                     download: Mapping[str, torch.Tensor] | None) -> np.ndarray:
    """What the client's values would be had it not trained, as it knows from its download: for each summed
    field the downloaded tensor of that name (weighted by the client's rounded weight under a weighted
    layout, as its own values are), zeros for a field the download does not hold. Distributed DP clips the
    values' distance from it, the update, not the values (a model's parameters are far from zero)."""
    weight = weight_factor(protocol, float(summands[WEIGHT])) / protocol.quantization_range if layout.weighted else 1.0
    parts = []
    for name, shape in layout.fields:
        if name == WEIGHT:
            continue
        held = None if download is None else download.get(name)
        parts.append(held.detach().cpu().to(torch.float64).reshape(-1).numpy() * weight
                     if held is not None and tuple(held.shape) == tuple(shape) else np.zeros(math.prod(shape)))
    return np.concatenate(parts) if parts else np.zeros(0)


def _quantize_private(protocol: SecureAggregation, values: np.ndarray, round: int, client: int,
                      reference: np.ndarray) -> tuple[np.ndarray, int, bool]:
    """Under distributed DP: the distance from ``reference`` (``reference_values``) L2-clipped, quantised,
    Skellam noise added, reduced modulo the modulus."""
    update, shortened = clip_l2(protocol, values - reference)
    clipped = reference + update
    quantised, beyond = quantize(protocol, clipped, round, client)
    noisy = quantised.astype(np.int64) + skellam_noise(protocol, len(values), round, client)
    return (noisy % protocol.modulus).astype(np.uint64), beyond, shortened


def encode(protocol: SecureAggregation, layout: Layout, summands: Mapping[str, torch.Tensor], round: int,
           client: int, download: Mapping[str, torch.Tensor] | None = None) -> tuple[np.ndarray, int, bool]:
    """(the client's integer vector before masking, its values beyond the clipping range, whether the L2
    clip of distributed DP shortened its values): under a weighted layout Flower's weight factor, then
    the reweighted values (``with_flower_weight``) quantised; otherwise every value quantised. Under
    distributed DP the values' distance from what the client downloaded (``reference_values``; never the
    weight factor) is L2-clipped first, and the values carry Skellam noise."""
    values = layout.flatten(with_flower_weight(protocol, summands) if layout.weighted else summands)
    values = values[1:] if layout.weighted else values
    if protocol.private:
        reference = reference_values(protocol, layout, summands, download)
        quantised, beyond, shortened = _quantize_private(protocol, values, round, client, reference)
    else:
        (quantised, beyond), shortened = quantize(protocol, values, round, client), False
    if not layout.weighted:
        return quantised, beyond, shortened
    factor = np.array([weight_factor(protocol, float(summands[WEIGHT]))], dtype=np.uint64)
    return np.concatenate([factor, quantised]), beyond, shortened


def _dequantize_centred(protocol: SecureAggregation, total: np.ndarray, count: int) -> np.ndarray:
    """The float sum of ``count`` clients' noisy values: the known offset count·quantization_range/2
    subtracted modulo the modulus, the rest read as a signed integer in (−modulus/2, modulus/2]."""
    m, offset = protocol.modulus, count * protocol.quantization_range
    centred = (total.astype(np.int64) - offset // 2) % m
    signed = np.where(centred > m // 2, centred - m, centred).astype(np.float64) - (offset % 2) / 2
    return signed * (2 * protocol.clipping_range / protocol.quantization_range)


def decode(protocol: SecureAggregation, layout: Layout, total: np.ndarray, count: int) -> np.ndarray:
    """The float sum of ``count`` clients' summands from the sum of their integer vectors (``encode``):
    the summed weight factor over the quantisation range (exact), the other values dequantised (read
    centred under distributed DP, where the noise may take the sum below zero)."""
    values = total[1:] if layout.weighted else total
    values = (_dequantize_centred(protocol, values, count) if protocol.private
              else dequantize_sum(protocol, values, count))
    if not layout.weighted:
        return values
    return np.concatenate([np.array([float(total[0]) / protocol.quantization_range]), values])


def secure_round(protocol: SecureAggregation, round: int, participants: list[int],
                 summands: dict[int, dict[str, torch.Tensor]],
                 clear: Mapping[int, Mapping[str, float]] | None = None,
                 downloads: Mapping[int, Mapping[str, torch.Tensor]] | None = None
                 ) -> tuple[AggregateRecord, dict[int, np.ndarray]]:
    """Run one round of the protocol: ``participants`` joined the key agreement, ``summands`` holds
    what each survivor sends (client → named tensors), ``clear`` what each survivor's reply carries
    unmasked (``clear_values``; kept under ``clear_fields="flower"``). Returns the server's record and
    each survivor's masked upload."""
    participants = sorted(int(c) for c in participants)
    survivors = sorted(summands)
    dropped = tuple(c for c in participants if c not in summands)
    if len(survivors) > protocol.max_clients():
        raise UserError(f"{len(survivors)} clients would overflow the modulus {protocol.modulus} at quantization_range "
                        f"{protocol.quantization_range}; raise modulus or lower quantization_range", fields=("modulus", "quantization_range"))
    layout = Layout.of(summands[survivors[0]]) if survivors else Layout(())
    if layout.weighted:
        factors = sum(weight_factor(protocol, float(summands[c][WEIGHT])) for c in survivors)
        if factors >= protocol.modulus:
            raise UserError(f"the survivors' weight factors sum to {factors}, beyond the modulus {protocol.modulus}: "
                            f"raise max_weight (a weight n / max_weight above 1 needs more than quantization_range "
                            f"per client) or modulus", fields=("max_weight", "modulus"))
    protocol.check_headroom(len(survivors))
    graph = neighbours(protocol, round, participants)
    masked, clipped, shortened = {}, 0, 0
    for client in survivors:
        vector, beyond, short = encode(protocol, layout, summands[client], round, client,
                                       (downloads or {}).get(client))
        clipped, shortened = clipped + beyond, shortened + short
        masked[client] = mask(protocol, vector, round, client, graph)
    shown = {c: dict(clear[c]) for c in survivors if clear.get(c)} if clear and protocol.clear_fields == "flower" \
        else {}
    record = AggregateRecord(round, tuple(participants), tuple(survivors), dropped, {}, protocol.quantum, clipped,
                             None, layout, shown, shortened, len(survivors) * protocol.dp_noise)
    record.aborted = halted(protocol, round, participants, survivors)
    if record.aborted is not None:
        return record, masked
    total = decode(protocol, layout, unmask(protocol, masked, round, graph, layout.size), len(survivors))
    record.total = layout.unflatten(total)
    return record, masked
