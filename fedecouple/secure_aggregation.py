"""Secure aggregation in the channel: the server holds the sum of a round's uploads, never one of them.

The protocol simulated is SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead"; the double-masking scheme of Bonawitz et al. 2017, "Practical Secure
Aggregation for Privacy-Preserving Machine Learning"), with the quantisation Flower's
``SecAggPlusWorkflow`` uses:

1. Each client turns what its method lets the server sum (``Method.secure_summands``) into one
   vector, clips it to ``[-clipping_range, clipping_range]`` (values beyond are *counted*: the
   round's record says how many, as the clients would report them) and quantises it to integers in
   ``[0, quantization_range]`` with seeded stochastic rounding (unbiased; each value off by less than
   one step ``quantum``).
2. It adds a self mask and, for every neighbour in the round's graph (all other participants, or a
   random ``neighbours``-regular graph as in SecAgg+), a pairwise mask that the neighbour subtracts,
   all uniform over ``[0, modulus)``, and sends the result modulo ``modulus``: the masked upload is
   uniform whatever the client's values are.
3. The server adds the masked uploads that arrived. The pairwise masks between survivors cancel; the
   survivors' self masks and the pairwise masks shared with clients that dropped out are removed
   with the seeds the protocol lets the server reconstruct from secret shares (a survivor's self-mask
   seed, a dropped client's pairwise seeds), which needs at least ``reconstruction_threshold`` of the
   participants to survive; otherwise the round is aborted and the server learns nothing.

What is simulated, not computed: the key agreement and the Shamir shares. The masks' seeds are
derived from (seed, round, the pair) and the server obtains exactly the seeds the protocol gives
it, at the step it gives them; the arithmetic of masking and unmasking is the protocol's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import UserError


def _seed(*parts: int) -> int:
    """A 63-bit seed from integers (the engine's ``derive_seed``, kept here so the channel needs no engine)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32)
               .view(np.uint64)[0] >> 1)


@dataclass(frozen=True)
class SecureAggregation:
    """The protocol's parameters (defaults: Flower's ``SecAggPlusWorkflow``'s).

    ``neighbours``: each client's degree in SecAgg+'s graph (None: every pair masks, as SecAgg);
    ``reconstruction_threshold``: the fraction of the round's participants that must survive for the
    server to unmask; ``max_weight``: the largest client weight (sample count) the sum is scaled for,
    a method's weighted summands are divided by it so they fit the clipping range."""

    clipping_range: float = 8.0
    quantization_range: int = 2 ** 22
    modulus: int = 2 ** 32
    neighbours: int | None = None
    reconstruction_threshold: float = 0.5
    max_weight: float = 1000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.clipping_range > 0:
            raise UserError(f"--sa-clipping-range must be positive, got {self.clipping_range}")
        if self.quantization_range < 2:
            raise UserError(f"--sa-quantization-range must be >= 2, got {self.quantization_range}")
        if self.modulus <= self.quantization_range or self.modulus > 2 ** 62:
            raise UserError(f"--sa-modulus must exceed --sa-quantization-range ({self.quantization_range}) and be at "
                            f"most 2**62, got {self.modulus}")
        if self.neighbours is not None and self.neighbours < 1:
            raise UserError(f"--sa-neighbours must be >= 1, got {self.neighbours}")
        if not 0 < self.reconstruction_threshold <= 1:
            raise UserError(f"--sa-threshold must be in (0, 1], got {self.reconstruction_threshold}")
        if not self.max_weight > 0:
            raise UserError(f"--sa-max-weight must be positive, got {self.max_weight}")

    @property
    def quantum(self) -> float:
        """One quantisation step: a summand value decodes to within this of what the client sent."""
        return 2.0 * self.clipping_range / self.quantization_range

    def max_clients(self) -> int:
        """The most survivors whose quantised values sum below the modulus (no wrap-around)."""
        return (self.modulus - 1) // self.quantization_range

    def describe(self) -> dict:
        return {"clipping_range": self.clipping_range, "quantization_range": self.quantization_range,
                "modulus": self.modulus, "neighbours": self.neighbours,
                "reconstruction_threshold": self.reconstruction_threshold, "max_weight": self.max_weight}


@dataclass(frozen=True)
class Layout:
    """The order and shapes of the named tensors that make one summand vector."""

    fields: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> "Layout":
        return cls(tuple((name, tuple(tensors[name].shape)) for name in sorted(tensors)))

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for _, shape in self.fields)

    def flatten(self, tensors: dict[str, torch.Tensor]) -> np.ndarray:
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
    survivors' summands (``Method.secure_summands``), each value within ``len(survivors) * quantum`` of
    the true sum; empty when ``aborted`` says why the round could not be unmasked. ``clipped``: values
    beyond the clipping range, summed over the survivors (counted client-side and reported; they were
    clipped before masking)."""

    round: int
    participants: tuple[int, ...]
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    total: dict[str, torch.Tensor]
    quantum: float
    clipped: int = 0
    aborted: str | None = None
    layout: Layout | None = field(default=None, repr=False)


def neighbours(protocol: SecureAggregation, round: int, participants: list[int]) -> dict[int, set[int]]:
    """The round's masking graph: every pair (SecAgg), or SecAgg+'s sparse graph: the participants on a
    seeded random ring, each joined to its ``neighbours // 2`` nearest on both sides (the degree rounded
    down to an even number, at least 2), which the server draws and every client knows."""
    ids = sorted(int(c) for c in participants)
    k = protocol.neighbours
    if k is None or k >= len(ids) - 1:
        return {c: set(ids) - {c} for c in ids}
    ring = np.random.default_rng(_seed(protocol.seed, round, 0x5EC)).permutation(ids).tolist()
    graph: dict[int, set[int]] = {c: set() for c in ids}
    for pos, c in enumerate(ring):
        for step in range(1, max(1, k // 2) + 1):
            other = ring[(pos + step) % len(ring)]
            graph[c].add(other)
            graph[other].add(c)
    return graph


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


def secure_round(protocol: SecureAggregation, round: int, participants: list[int],
                 summands: dict[int, dict[str, torch.Tensor]]) -> tuple[AggregateRecord, dict[int, np.ndarray]]:
    """Run one round of the protocol: ``participants`` joined the key agreement, ``summands`` holds
    what each survivor sends (client → named tensors). Returns the server's record and each survivor's
    masked upload."""
    participants = sorted(int(c) for c in participants)
    survivors = sorted(summands)
    dropped = tuple(c for c in participants if c not in summands)
    if len(survivors) > protocol.max_clients():
        raise UserError(f"{len(survivors)} clients would overflow the modulus {protocol.modulus} at quantisation "
                        f"range {protocol.quantization_range}; raise --sa-modulus or lower --sa-quantization-range")
    layout = Layout.of(summands[survivors[0]]) if survivors else Layout(())
    graph = neighbours(protocol, round, participants)
    masked, clipped = {}, 0
    for client in survivors:
        q, beyond = quantize(protocol, layout.flatten(summands[client]), round, client)
        clipped += beyond
        masked[client] = mask(protocol, q, round, client, graph)
    record = AggregateRecord(round, tuple(participants), tuple(survivors), dropped, {}, protocol.quantum, clipped,
                             None, layout)
    needed = math.ceil(protocol.reconstruction_threshold * len(participants))
    if not survivors or len(survivors) < needed:
        record.aborted = (f"{len(survivors)} of {len(participants)} participants survived, below the reconstruction "
                          f"threshold of {needed}: the server cannot unmask")
        return record, masked
    total = dequantize_sum(protocol, unmask(protocol, masked, round, graph, layout.size), len(survivors))
    record.total = layout.unflatten(total)
    return record, masked
