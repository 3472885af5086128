"""A SecAgg+ server that deviates from the protocol, to audit one's own Flower deployment in simulation.

``MaliciousSecAggPlusWorkflow`` is Flower's ``SecAggPlusWorkflow`` (through
``secagg_defences.ConsistencyCheckedSecAggPlusWorkflow``, so it can also run the signed rounds) with the
stages where the server chooses what to ask overridden; it still completes every round it can, so the
federation trains as usual. ``fedsec flower attack ATTACK APP_DIR`` runs the app's ServerApp with it in
place of the app's workflow (``swapping_secagg_workflows``). Attacks (``SERVER_ATTACKS``), in the
attacked Flower rounds:

* ``unmask-dropout``: in the unmask stage every share holder of a target node is asked for the target
  both as surviving (its self-mask-seed share) and as dropped (its secret-key share). Flower 1.42's
  ``secaggplus_mod`` answers both; with the threshold of each the server rebuilds the target's self mask
  and its pairwise masks and unmasks its upload. The round's sum is still computed from the honest
  part of the answers;
* ``split-view``: the same secrets, asked of different nodes: some holders are told the target survived,
  others that it dropped. Each node's lists are consistent, so a per-node check passes; it needs
  ``2 · threshold`` holders (the target's own seed share counts once);
* ``sybil``: the server draws the neighbour graph with its own (colluding) nodes next to the target;
  they hand over every share they hold, and the honest nodes are asked nothing unusual. The target is
  unmasked once its sybil neighbours reach the reconstruction threshold;
* ``key-substitution``: in the share-keys stage the server relays its own public keys in place of the
  target's neighbours' (and the target's to them), as a man in the middle: it reads the shares the target
  sends its neighbours (its self-mask seed, rebuilt from ``num_shares - 1 >= threshold`` shares), knows every
  pairwise mask of the target, re-encrypts everything so no node notices, removes the substituted masks
  from the round's sum, and unmasks the target right after the masking stage. Flower 1.42 authenticates
  no relayed key, so this pays off there; it assumes none of the target's neighbours drops out later in
  the round (the server cannot correct the sum for a dropped neighbour's substituted mask).

Arithmetic (``unmask_vector``, ``decode_update``, ``update_bound``) mirrors ``secaggplus_mod``'s
masking: the masked vector is ``[q, quantised(w·θ)]`` plus the self mask plus the signed pairwise masks
modulo the modulus, with ``q = round(num_examples / max_weight · R)``, ``w = q / R`` and values quantised
to ``R`` steps over ``±clipping_range`` (stochastic rounding). Flower's mask generator
``pseudo_rand_gen`` folds each 32-byte seed to 32 bits (``mask_seed32``).

Harness-only client mods (simulation): ``SybilMod`` makes the nodes of some partitions the server's
(they mark their setup reply and answer any unmask request from their state); ``PlaintextTap`` records
the update each node hands ``secaggplus_mod`` to mask, the true update a recovered one is compared with.

``run_in_process`` runs one SecAgg+ round on a ``LocalGrid``, in this process, with Flower's real
workflow and client mods and a fixed update per node instead of training: what ``fedsec flower audit``
demonstrates against an app's own mods, and what the tests drive the attacks with.
"""
from __future__ import annotations

import copy
import importlib
import logging
import random
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message import make_message
from flwr.common import Code, FitRes, Status, bytes_to_ndarray, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen, share_keys_plaintext_separate
from flwr.compat.common import recorddict_compat as compat
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.supercore.primitives.asymmetric import (bytes_to_private_key, bytes_to_public_key, generate_key_pairs,
                                                  private_key_to_bytes, public_key_to_bytes)

from . import SECAGG_SERVER_ATTACKS
from .secagg_defences import ConsistencyCheckedSecAggPlusWorkflow, StageGrid, current_round, secagg_stage

SERVER_ATTACKS = SECAGG_SERVER_ATTACKS  # name → one-line summary
SYBIL_MARK = "fedsec_sybil"  # a sybil's setup reply says so: the server knows its own nodes
_MODULE = "flwr.client.mod.secure_aggregation.secaggplus_mod"
CONSISTENCY_NAME = "consistency_check"  # the signed rounds' extra stage, as refusals name it


# ------------------------------------------------------------------------------------------------
# the arithmetic of one node's masked vector


def mask_seed32(seed: bytes) -> int:
    """The 32-bit value ``pseudo_rand_gen`` seeds numpy's generator with: the XOR of the seed's 4-byte words.
    Every mask of Flower 1.42's SecAgg+ is one of 2**32 sequences, whatever the key it came from."""
    folded = 0
    for i in range(0, len(seed), 4):
        folded ^= int.from_bytes(seed[i:i + 4], "little")
    return folded


def mask_seed_evidence(trials: int = 20000) -> dict:
    """What the installed ``pseudo_rand_gen`` does with a 32-byte seed, measured: two different seeds with
    the same 32-bit fold give the same mask, and how many candidate seeds one core tries per second
    (numpy's generator seeded and one mask value drawn), so how long all 2**32 take."""
    import inspect

    first = bytes(range(32))
    second = bytearray(first)
    for i, flip in enumerate(b"\x5a\xa5\x0f\xf0"):  # the same change in two words cancels in the XOR fold
        second[i] ^= flip
        second[4 + i] ^= flip
    shapes = [(64,)]
    same = all(np.array_equal(a, b) for a, b in zip(pseudo_rand_gen(first, 2 ** 32, shapes),
                                                    pseudo_rand_gen(bytes(second), 2 ** 32, shapes)))
    start = time.perf_counter()
    for candidate in range(trials):
        np.random.RandomState(candidate).randint(0, 2 ** 32 - 1)
    rate = trials / max(time.perf_counter() - start, 1e-9)
    source = [line.strip() for line in inspect.getsource(pseudo_rand_gen).splitlines() if "seed32" in line]
    return {"function": f"{pseudo_rand_gen.__module__}.pseudo_rand_gen", "source": source[:3],
            "different_seeds_same_mask": bool(same), "seed_bits": 32, "seeds_per_second_one_core": round(rate),
            "core_hours_for_every_seed": round(2 ** 32 / rate / 3600, 1)}


def search_mask_seed(first_value: int, modulus: int, candidates: Iterable[int]) -> int | None:
    """The first candidate 32-bit seed whose mask starts with ``first_value`` (None: none does). A server
    that knows a node's unmasked first entry (its weight, from the clear num_examples) and its pairwise
    masks reads the first entry of its self mask, and this search over all 2**32 seeds gives the rest."""
    for candidate in candidates:
        if int(np.random.RandomState(int(candidate)).randint(0, modulus - 1)) == int(first_value):
            return int(candidate)
    return None


def self_mask(seed: bytes, modulus: int, shapes) -> list[np.ndarray]:
    return pseudo_rand_gen(seed, modulus, list(shapes))


def pairwise_mask(own_sk1: bytes, own: int, other_pk1: bytes, other: int, modulus: int, shapes) -> list[np.ndarray]:
    """The pairwise mask node ``own`` added for its neighbour ``other``, with the sign it added it with
    (``+`` when its node id is the larger), from ``own``'s secret key and ``other``'s public key."""
    key = generate_shared_key(bytes_to_private_key(own_sk1), bytes_to_public_key(other_pk1))
    return signed_mask(key, own, other, modulus, shapes)


def signed_mask(shared_key: bytes, own: int, other: int, modulus: int, shapes) -> list[np.ndarray]:
    mask = pseudo_rand_gen(shared_key, modulus, list(shapes))
    return mask if int(own) > int(other) else [-m for m in mask]


def unmask_vector(masked: list[np.ndarray], seed: bytes, pairwise: Iterable[list[np.ndarray]],
                  modulus: int) -> list[np.ndarray]:
    """One node's quantised vector ``[q, values...]`` from its masked vector, its self-mask seed and the
    (signed) pairwise masks it added."""
    shapes = [np.shape(a) for a in masked]
    out = [np.asarray(m, dtype=np.int64) - s for m, s in zip(masked, self_mask(seed, modulus, shapes))]
    for mask in pairwise:
        out = [o - p for o, p in zip(out, mask)]
    return [np.mod(o, modulus) for o in out]


def decode_update(vector: list[np.ndarray], clipping_range: float,
                  quantization_range: int) -> tuple[int, list[np.ndarray]]:
    """(the quantised weight ``q``, the node's parameters θ) from its unmasked vector: each value is
    ``q_value · 2c / R − c``, which is ``w · θ`` up to the rounding, divided by ``w = q / R``."""
    weight = int(np.asarray(vector[0]).reshape(-1)[0])
    if weight <= 0:
        raise ValueError("the unmasked vector's weight is not positive: the masks were not removed")
    step = 2.0 * clipping_range / quantization_range
    return weight, [(np.asarray(v, dtype=np.float64) * step - clipping_range) * (quantization_range / weight)
                    for v in vector[1:]]


def update_bound(clipping_range: float, quantization_range: int, weight: int) -> float:
    """The largest error a recovered parameter can have (values inside the clipping range): one rounding
    step of ``w · θ`` plus the float32 rounding of the client's arithmetic (``clipping_range · 2**-22``, as
    ``fedsec.flower.secagg.flower_quantum`` explains), divided by ``w``."""
    quantum = 2.0 * clipping_range / quantization_range + clipping_range * 2.0 ** -22
    return quantum * quantization_range / weight


def recover_secret(shares: list[bytes], threshold: int) -> bytes | None:
    """A secret from its Shamir shares (None with fewer than ``threshold``, or shares that do not combine)."""
    if len(shares) < max(int(threshold), 1):
        return None
    try:
        return combine_shares(list(shares))
    except ValueError:
        return None


def _public_of(private_pem: bytes) -> bytes | None:
    try:
        return public_key_to_bytes(bytes_to_private_key(private_pem).public_key())
    except (ValueError, TypeError):
        return None


# ------------------------------------------------------------------------------------------------
# the deviating server


@dataclass
class AttackPlan:
    """What the deviating server does. ``rounds``: the Flower rounds (from 1) it attacks; ``targets``: nodes
    unmasked per attacked round (None: every node it can; ``sybil`` attacks one); ``sybils``: Flower round
    → sybil nodes placed next to the target (``sybil`` only); ``seed``: the server's draws."""

    attack: str
    rounds: tuple[int, ...] = (1,)
    targets: int | None = None
    sybils: dict[int, int] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.attack not in SERVER_ATTACKS:
            raise ValueError(f"unknown SecAgg+ server attack {self.attack!r}; choose one of: "
                             f"{', '.join(SERVER_ATTACKS)}")


@dataclass
class TargetOutcome:
    """One target of one round: what reached the server, and its unmasked vector or why there is none."""

    node_id: int
    holders: int = 0  # nodes holding shares of its secrets: its neighbours and itself
    sybil_neighbours: int = 0
    seed_shares: int = 0  # self-mask-seed shares of it the server got
    key_shares: int = 0  # secret-key shares of it the server got
    vector: list[np.ndarray] | None = None  # its unmasked quantised vector [q, values...]
    num_examples: int | None = None  # FitRes num_examples, which SecAgg+ sends in the clear
    reason: str | None = None


@dataclass
class RoundReport:
    """What the deviating server did and got in one attacked round."""

    flower_round: int
    attack: str
    num_shares: int = 0
    threshold: int = 0
    nodes: list[int] = field(default_factory=list)
    sybils: list[int] = field(default_factory=list)
    targets: dict[int, TargetOutcome] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)  # node id → its error reply (first one)
    completed: bool = False  # the round's sum reached the strategy

    @property
    def recovered(self) -> list[TargetOutcome]:
        return [t for t in self.targets.values() if t.vector is not None]


def place_sybils(state, target: int, sybils: list[int], count: int, rng: random.Random) -> None:
    """Redraw Flower's ring of neighbours (``num_shares >> 1`` on each side, over the sampled nodes) with
    ``count`` of ``sybils`` on the ring positions nearest ``target``, honest nodes next, the other sybils
    last (where they fit). Done after the setup stage: nothing uses the graph before share keys."""
    ids = sorted(int(n) for n in state.sampled_node_ids)
    n, half = len(ids), state.num_shares >> 1
    slots: list[int] = []
    for distance in range(1, half + 1):
        for position in (distance % n, (n - distance) % n):
            if position != 0 and position not in slots:
                slots.append(position)
    near, far = list(sybils[:count]), list(sybils[count:])
    honest = [i for i in ids if i != target and i not in sybils]
    rng.shuffle(honest)
    fill = near + honest + far
    order = [target] + [None] * (n - 1)
    for position, node in zip(slots, fill):
        order[position] = node
    rest = iter(fill[len(slots):])
    order = [node if node is not None else next(rest) for node in order]
    state.nid_to_neighbours = {order[i]: {order[(i + o) % n] for o in range(-half, half + 1)} for i in range(n)}


def _configs(message: Message) -> ConfigRecord:
    return message.content.config_records[RECORD_KEY_CONFIGS]


class _KeySubstitution:
    """The man in the middle of the share-keys stage for ``targets`` (``key-substitution``)."""

    def __init__(self, targets: Iterable[int], state) -> None:
        self.targets, self.state = set(targets), state
        self.fake: dict[tuple[int, int], tuple[bytes, bytes, bytes, bytes]] = {}  # (viewer, owner) → sk1 pk1 sk2 pk2
        self.shares: dict[int, list[bytes]] = {t: [] for t in self.targets}  # the targets' self-mask-seed shares

    def _pair(self, viewer: int, owner: int) -> tuple[bytes, bytes, bytes, bytes]:
        if (viewer, owner) not in self.fake:
            sk1, pk1 = generate_key_pairs()
            sk2, pk2 = generate_key_pairs()
            self.fake[viewer, owner] = (private_key_to_bytes(sk1), public_key_to_bytes(pk1),
                                        private_key_to_bytes(sk2), public_key_to_bytes(pk2))
        return self.fake[viewer, owner]

    def rewrite_keys(self, messages: list[Message]) -> list[Message]:
        for message in messages:
            viewer, configs = int(message.metadata.dst_node_id), _configs(message)
            for name in list(configs.keys()):
                if not name.isdigit() or int(name) == viewer:
                    continue
                owner = int(name)
                if viewer in self.targets or owner in self.targets:
                    _, pk1, _, pk2 = self._pair(viewer, owner)
                    configs[name] = [pk1, pk2]
        return messages

    def rewrite_ciphertexts(self, replies: list[Message]) -> list[Message]:
        keys = self.state.nid_to_publickeys
        for reply in replies:
            if reply.has_error():
                continue
            source, configs = int(reply.metadata.src_node_id), _configs(reply)
            ciphertexts = list(configs[Key.CIPHERTEXT_LIST])
            for i, destination in enumerate(int(d) for d in configs[Key.DESTINATION_LIST]):
                if (source, destination) not in self.fake:
                    continue
                # the source encrypted under ECDH(its sk2, the key it was shown for the destination)
                reading = generate_shared_key(bytes_to_private_key(self.fake[source, destination][2]),
                                              bytes_to_public_key(keys[source][1]))
                plaintext = decrypt(reading, ciphertexts[i])
                if source in self.targets:
                    self.shares[source].append(share_keys_plaintext_separate(plaintext)[2])
                writing = generate_shared_key(bytes_to_private_key(self.fake[destination, source][2]),
                                              bytes_to_public_key(keys[destination][1]))
                ciphertexts[i] = encrypt(writing, plaintext)
            configs[Key.CIPHERTEXT_LIST] = ciphertexts
        return replies

    def mask(self, node: int, other: int, modulus: int, shapes) -> list[np.ndarray]:
        """The substituted pairwise mask ``node`` added for ``other`` (signed as it added it)."""
        key = generate_shared_key(bytes_to_private_key(self.fake[node, other][0]),
                                  bytes_to_public_key(self.state.nid_to_publickeys[node][0]))
        return signed_mask(key, node, other, modulus, shapes)


class MaliciousSecAggPlusWorkflow(ConsistencyCheckedSecAggPlusWorkflow):
    """``SecAggPlusWorkflow`` run by a server that follows ``plan`` (module docstring); ``signed_rounds``:
    the clients run ``secagg_defences.SignedConsistency``, so the server runs its rounds (it cannot skip
    them: the clients would refuse). ``reports``: one ``RoundReport`` per attacked round."""

    def __init__(self, num_shares, reconstruction_threshold, *, plan: AttackPlan, signed_rounds: bool = False,
                 **kwargs) -> None:
        super().__init__(num_shares, reconstruction_threshold, **kwargs)
        self.plan, self.signed_rounds = plan, bool(signed_rounds)
        self.reports: list[RoundReport] = []
        self._report: RoundReport | None = None

    @classmethod
    def like(cls, workflow: SecAggPlusWorkflow, plan: AttackPlan,
             signed_rounds: bool | None = None) -> "MaliciousSecAggPlusWorkflow":
        """The deviating server with ``workflow``'s protocol parameters (the app's own workflow object)."""
        signed = bool(getattr(workflow, "signed_rounds", False)) if signed_rounds is None else signed_rounds
        return cls(workflow.num_shares, workflow.reconstruction_threshold, plan=plan, signed_rounds=signed,
                   max_weight=workflow.max_weight, clipping_range=workflow.clipping_range,
                   quantization_range=workflow.quantization_range, modulus_range=workflow.modulus_range,
                   timeout=workflow.timeout)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _watch(self, stage: str, replies: list[Message]) -> list[Message]:
        if self._report is not None:
            for reply in replies:
                if reply.has_error():
                    self._report.refused.setdefault(int(reply.metadata.src_node_id), f"{stage}: {reply.error.reason}")
        return replies

    def survivors_shown(self, node: int, survivors: list[int]) -> list[int]:
        views = getattr(self, "_views", None)
        return survivors if not views or node not in views else views[node]

    # -- setup: who the sybils are, which nodes are targets, the graph ---------------------------
    def setup_stage(self, grid, context, state) -> bool:
        flower_round = current_round(context)
        self._views = {}
        self._report = RoundReport(flower_round, self.plan.attack) if flower_round in self.plan.rounds else None
        if self._report is None:
            return super().setup_stage(grid, context, state)
        report, sybils = self._report, set()

        def note_sybils(replies):
            for reply in replies:
                if not reply.has_error() and _configs(reply).get(SYBIL_MARK):
                    sybils.add(int(reply.metadata.src_node_id))
            return self._watch("setup", replies)

        ok = super().setup_stage(StageGrid(grid, after=note_sybils), context, state)
        self.reports.append(report)
        report.num_shares, report.threshold = int(state.num_shares), int(state.threshold)
        report.nodes = sorted(int(n) for n in state.sampled_node_ids)
        report.sybils = sorted(sybils)
        if not ok:
            return False
        rng = random.Random(f"{self.plan.seed}/{flower_round}")
        eligible = sorted(int(n) for n in state.active_node_ids if int(n) not in sybils)
        count = len(eligible) if self.plan.targets is None else min(int(self.plan.targets), len(eligible))
        if self.plan.attack in ("sybil", "split-view") and self.plan.targets is None:
            count = min(count, 1)  # one target: its neighbours' lists stay plausible
        targets = sorted(rng.sample(eligible, count))
        if self.plan.attack == "sybil" and targets:
            active_sybils = sorted(sybils & {int(n) for n in state.active_node_ids})
            place_sybils(state, targets[0], active_sybils, int(self.plan.sybils.get(flower_round, 0)), rng)
        for target in targets:
            neighbours = {int(n) for n in state.nid_to_neighbours[target]}
            report.targets[target] = TargetOutcome(target, holders=len(neighbours),
                                                   sybil_neighbours=len((neighbours - {target}) & sybils))
        return self._check_threshold(state)

    # -- share keys: the man in the middle ---------------------------------------------------------
    def share_keys_stage(self, grid, context, state) -> bool:
        report = self._report
        if report is None:
            return super().share_keys_stage(grid, context, state)
        self._substitution = None
        before = None
        if self.plan.attack == "key-substitution":
            self._substitution = _KeySubstitution(report.targets, state)
            before = self._substitution.rewrite_keys

        def after(replies):
            if self._substitution is not None:
                replies = self._substitution.rewrite_ciphertexts(replies)
            return self._watch("share_keys", replies)

        return super().share_keys_stage(StageGrid(grid, before=before, after=after), context, state)

    # -- masking: keep each masked vector -----------------------------------------------------------
    def collect_masked_vectors_stage(self, grid, context, state) -> bool:
        report = self._report
        if report is None:
            return super().collect_masked_vectors_stage(grid, context, state)
        self._partners = {int(n): [int(s) for s in srcs] for n, srcs in state.forward_srcs.items()}
        self._masked: dict[int, list[np.ndarray]] = {}

        def keep_vectors(replies):
            for reply in replies:
                if reply.has_error():
                    continue
                node = int(reply.metadata.src_node_id)
                self._masked[node] = [bytes_to_ndarray(b) for b in _configs(reply)[Key.MASKED_PARAMETERS]]
                if node in report.targets:
                    counts = reply.content.metric_records.get("fitres.num_examples")
                    report.targets[node].num_examples = None if counts is None else int(counts["num_examples"])
            return self._watch("collect_masked_vectors", replies)

        ok = super().collect_masked_vectors_stage(StageGrid(grid, after=keep_vectors), context, state)
        if self._substitution is not None:
            self._unmask_substituted(state)
        return ok

    def _unmask_substituted(self, state) -> None:
        substitution, modulus = self._substitution, int(state.mod_range)
        arrived = set(self._masked)
        aggregate = getattr(state, "aggregate_ndarrays", None)
        for (node, other) in substitution.fake:
            if node in arrived and other in self._partners.get(node, []) and aggregate is not None:
                # the node's substituted mask does not cancel against its neighbour's: take it out of the sum
                mask = substitution.mask(node, other, modulus, [a.shape for a in aggregate])
                aggregate = [np.mod(a - m, modulus) for a, m in zip(aggregate, mask)]
        if aggregate is not None:
            state.aggregate_ndarrays = aggregate
        for target, outcome in self._report.targets.items():
            shares = substitution.shares.get(target, [])
            outcome.seed_shares = len(shares)
            if target not in self._masked:
                outcome.reason = "its masked vector did not arrive"
                continue
            seed = recover_secret(shares, state.threshold)
            if seed is None:
                outcome.reason = (f"{len(shares)} of its self-mask-seed shares were read in transit, the threshold is "
                                  f"{state.threshold}")
                continue
            masked = self._masked[target]
            shapes = [a.shape for a in masked]
            pairwise = [substitution.mask(target, other, modulus, shapes) for other in self._partners.get(target, [])
                        if (target, other) in substitution.fake]
            self._finish(outcome, unmask_vector(masked, seed, pairwise, modulus))

    def _finish(self, outcome: TargetOutcome, vector: list[np.ndarray]) -> None:
        """Keep an unmasked vector whose weight is the one the node's clear num_examples gives."""
        if outcome.num_examples is not None:
            expected = round(outcome.num_examples / self.max_weight * self.quantization_range)
            if int(np.asarray(vector[0]).reshape(-1)[0]) != expected:
                outcome.reason = "the rebuilt masks did not unmask it (its weight does not match its num_examples)"
                return
        outcome.vector = vector

    # -- unmask: what each node is asked for --------------------------------------------------------
    def unmask_stage(self, grid, context, state) -> bool:
        report = self._report
        if report is None:
            return super().unmask_stage(grid, context, state)
        if self.plan.attack == "key-substitution":
            report.completed = super().unmask_stage(
                StageGrid(grid, after=lambda replies: self._watch("unmask", replies)), context, state)
            return report.completed
        active = {int(n) for n in state.active_node_ids}
        extra, moved = self._asks(state, active)
        self._views = {node: sorted(active - moved.get(node, set())) for node in active}
        seed_shares: dict[int, list[bytes]] = {t: [] for t in report.targets}
        key_shares: dict[int, list[bytes]] = {t: [] for t in report.targets}
        sent: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        batch = {"stage": None}

        def ask(messages):
            batch["stage"] = None
            for message in messages:
                if secagg_stage(message) != Stage.UNMASK:
                    continue
                batch["stage"] = Stage.UNMASK
                node, configs = int(message.metadata.dst_node_id), _configs(message)
                honest_active = [int(n) for n in configs[Key.ACTIVE_NODE_ID_LIST]]
                honest_dead = [int(n) for n in configs[Key.DEAD_NODE_ID_LIST]]
                asked_active = [n for n in honest_active if n not in moved.get(node, set())]
                asked_dead = honest_dead + [n for n in sorted(moved.get(node, set()) | extra.get(node, set()))
                                            if n not in honest_dead]
                configs[Key.ACTIVE_NODE_ID_LIST], configs[Key.DEAD_NODE_ID_LIST] = asked_active, asked_dead
                sent[node] = (honest_active, honest_dead, asked_active, asked_dead)
            return messages

        def take(replies):
            if batch["stage"] != Stage.UNMASK:
                return self._watch(CONSISTENCY_NAME, replies)
            for reply in replies:
                node = int(reply.metadata.src_node_id)
                if reply.has_error() or node not in sent:
                    continue
                honest_active, honest_dead, asked_active, asked_dead = sent[node]
                configs = _configs(reply)
                shares = list(configs[Key.SHARE_LIST])
                seeds = dict(zip(asked_active, shares[:len(asked_active)]))
                keys = dict(zip(asked_dead, shares[len(asked_active):]))
                for target in report.targets:
                    if target in seeds:
                        seed_shares[target].append(seeds[target])
                    if target in keys:
                        key_shares[target].append(keys[target])
                # Flower's own unmasking sees the answer to the honest question only
                pairs = [(n, seeds[n]) for n in honest_active if n in seeds] + \
                        [(n, keys[n]) for n in honest_dead if n in keys]
                reply.content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
                    {Key.NODE_ID_LIST: [n for n, _ in pairs], Key.SHARE_LIST: [s for _, s in pairs]})
            return self._watch("unmask", replies)

        report.completed = super().unmask_stage(StageGrid(grid, before=ask, after=take), context, state)
        self._rebuild(state, seed_shares, key_shares)
        return report.completed

    def _asks(self, state, active: set[int]) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """Per node: the targets it is also asked for as dropped (``extra``), and the targets it is told
        dropped instead of surviving (``moved``)."""
        report, threshold = self._report, int(state.threshold)
        sybils = set(report.sybils)
        extra: dict[int, set[int]] = {}
        moved: dict[int, set[int]] = {}
        for target, outcome in report.targets.items():
            if target not in active:
                outcome.reason = "its masked vector did not arrive"
                continue
            holders = {int(n) for n in state.nid_to_neighbours[target]} & active
            sybil_holders = holders & sybils
            if self.plan.attack == "unmask-dropout":
                for holder in holders:
                    extra.setdefault(holder, set()).add(target)
            elif self.plan.attack == "sybil":
                for holder in sybil_holders:
                    extra.setdefault(holder, set()).add(target)
            elif self.plan.attack == "split-view":
                honest = sorted(holders - sybils - {target})
                need_key = max(0, threshold - len(sybil_holders))
                need_seed = max(0, threshold - 1 - len(sybil_holders))  # the target answers for itself
                if need_key + need_seed > len(honest):
                    outcome.reason = (f"split view infeasible: {len(holders)} nodes hold its shares, "
                                      f"{len(sybil_holders)} of them sybils; two disjoint groups of {threshold} "
                                      f"are needed")
                    continue
                for holder in honest[:need_key]:
                    moved.setdefault(holder, set()).add(target)
                for holder in sybil_holders:
                    extra.setdefault(holder, set()).add(target)
        return extra, moved

    def _rebuild(self, state, seed_shares: dict[int, list[bytes]], key_shares: dict[int, list[bytes]]) -> None:
        threshold, modulus = int(state.threshold), int(state.mod_range)
        for target, outcome in self._report.targets.items():
            outcome.seed_shares, outcome.key_shares = len(seed_shares[target]), len(key_shares[target])
            if outcome.reason is not None:
                continue
            seed = recover_secret(seed_shares[target], threshold)
            secret_key = recover_secret(key_shares[target], threshold)
            if seed is None or secret_key is None:
                outcome.reason = (f"{outcome.seed_shares} self-mask-seed and {outcome.key_shares} secret-key share(s) "
                                  f"of it reached the server; it needs {threshold} of each")
                continue
            if _public_of(secret_key) != state.nid_to_publickeys[target][0]:
                outcome.reason = "its secret-key shares did not combine to its key"
                continue
            masked = self._masked[target]
            shapes = [a.shape for a in masked]
            pairwise = [pairwise_mask(secret_key, target, state.nid_to_publickeys[other][0], other, modulus, shapes)
                        for other in self._partners.get(target, [])]
            self._finish(outcome, unmask_vector(masked, seed, pairwise, modulus))



@contextmanager
def swapping_secagg_workflows(replace: Callable[[SecAggPlusWorkflow], SecAggPlusWorkflow]) -> Iterator[list]:
    """While active, every ``SecAggPlusWorkflow`` object a ServerApp runs is replaced by ``replace(it)``
    (once per object: the same replacement runs every round). Enter it inside
    ``secagg.recording_secagg_workflows`` so that the replacement is recorded. Yields the replacements."""
    inner_call = SecAggPlusWorkflow.__call__
    swapped: dict[int, SecAggPlusWorkflow] = {}
    made: list = []
    held: list = []  # the replaced objects, kept alive so their ids stay theirs

    def call(self, grid, context):
        if id(self) not in swapped:
            held.append(self)
            swapped[id(self)] = replace(self)
            made.append(swapped[id(self)])
        return inner_call(swapped[id(self)], grid, context)

    SecAggPlusWorkflow.__call__ = call
    try:
        yield made
    finally:
        SecAggPlusWorkflow.__call__ = inner_call


# ------------------------------------------------------------------------------------------------
# harness-only client mods


class SybilMod:
    """Makes the nodes holding ``partitions`` (node config ``partition-id``) the server's own: their setup
    reply carries ``SYBIL_MARK``, and they answer any unmask request from their SecAgg+ state (a
    self-mask-seed share for every node listed as surviving, a secret-key share for every node listed as
    dropped), whatever any check of theirs would say. Outermost, so no defence of the app runs for them
    in the unmask stage. Other nodes and messages pass through unchanged."""

    def __init__(self, partitions: Iterable[int]) -> None:
        self.partitions = {int(p) for p in partitions}

    def is_sybil(self, context: Context) -> bool:
        partition = context.node_config.get("partition-id")
        return partition is not None and int(partition) in self.partitions

    def __call__(self, message: Message, context: Context, call_next: Callable) -> Message:
        stage = secagg_stage(message)
        if stage is None or not self.is_sybil(context):
            return call_next(message, context)
        if stage == Stage.UNMASK:
            return self._hand_over(message, context)
        reply = call_next(message, context)
        if stage == Stage.SETUP and not reply.has_error():
            _configs(reply)[SYBIL_MARK] = True
        return reply

    @staticmethod
    def _hand_over(message: Message, context: Context) -> Message:
        module = importlib.import_module(_MODULE)
        state = module.SecAggPlusState(**context.state.config_records[RECORD_KEY_STATE])
        configs = _configs(message)
        active = [int(n) for n in configs[Key.ACTIVE_NODE_ID_LIST] if int(n) in state.rd_seed_share_dict]
        dead = [int(n) for n in configs[Key.DEAD_NODE_ID_LIST] if int(n) in state.sk1_share_dict]
        shares = [state.rd_seed_share_dict[n] for n in active] + [state.sk1_share_dict[n] for n in dead]
        state.current_stage = Stage.UNMASK
        context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())  # to_dict empties state
        return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.NODE_ID_LIST: active + dead,
                                                                     Key.SHARE_LIST: shares})}), reply_to=message)


def tap_file(directory: str | Path, flower_round: int | str, node_id: int) -> Path:
    return Path(directory) / f"{flower_round}-{int(node_id)}.npz"


class PlaintextTap:
    """Records, in the masking stage, the update the node hands ``secaggplus_mod`` to mask (its FitRes
    parameters and num_examples) into ``directory/<flower round>-<node id>.npz``: the true update a
    recovered one is compared with. Harness-only, simulation-only (a file on this machine); the node's
    reply is unchanged."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = str(directory)

    def __call__(self, message: Message, context: Context, call_next: Callable) -> Message:
        if secagg_stage(message) != Stage.COLLECT_MASKED_VECTORS:
            return call_next(message, context)
        module = importlib.import_module(_MODULE)
        original = module._collect_masked_vectors
        path = tap_file(self.directory, message.metadata.group_id, context.node_id)

        def tapped(state, configs, num_examples, parameters):
            arrays = parameters_to_ndarrays(parameters)
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(".part.npz")
            np.savez(temporary, num_examples=np.asarray(int(num_examples)),
                     **{f"a{i}": np.asarray(a) for i, a in enumerate(arrays)})
            temporary.replace(path)
            return original(state, configs, num_examples, parameters)

        module._collect_masked_vectors = tapped
        try:
            return call_next(message, context)
        finally:
            module._collect_masked_vectors = original


def read_tap(directory: str | Path) -> dict[tuple[int, int], tuple[int, list[np.ndarray]]]:
    """Every update a ``PlaintextTap`` recorded: (Flower round, node id) → (num_examples, arrays)."""
    out = {}
    for path in sorted(Path(directory).glob("*.npz")):
        if path.name.endswith(".part.npz"):
            continue
        flower_round, node = path.stem.split("-", 1)
        with np.load(path) as data:
            arrays = [data[f"a{i}"] for i in range(len(data.files) - 1)]
            out[int(flower_round), int(node)] = (int(data["num_examples"]), arrays)
    return out


# ------------------------------------------------------------------------------------------------
# one SecAgg+ round in this process


class LocalGrid:
    """A ``Grid`` that hands each message to its node's ClientApp callable in this process (a copy, as a
    network would), one node at a time; a node that raises answers with an error reply, as Flower's
    simulation does."""

    def __init__(self, nodes: dict[int, Callable], run_id: int = 1) -> None:
        self.nodes = dict(nodes)
        count = len(self.nodes)
        self.contexts = {node: Context(run_id=run_id, node_id=node, node_config={"partition-id": i,
                                                                                 "num-partitions": count},
                                       state=RecordDict(), run_config={})
                         for i, node in enumerate(sorted(self.nodes))}

    def get_node_ids(self) -> list[int]:
        return sorted(self.nodes)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # what the SuperLink sets
            delivered = make_message(metadata=copy.copy(message.metadata), content=copy.deepcopy(message.content))
            node = int(message.metadata.dst_node_id)
            try:
                reply = self.nodes[node](delivered, self.contexts[node])
            except Exception as exc:  # noqa: BLE001 - a node's failure is its reply, as in Flower's simulation
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                      reason=f"{type(exc).__name__}: {exc}"), reply_to=delivered)
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            replies.append(reply)
        return replies


@contextmanager
def _server_identity() -> Iterator[None]:
    """What Flower's runtime sets before a ServerApp creates messages (run, task and node ids)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = {name: getattr(TaskIdentity, name) for name in ("_run_id", "_task_id", "_node_id")}
    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        if saved[name] is None:
            setattr(TaskIdentity, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(TaskIdentity, name, value)


def fixed_update_client(update_of: Callable[[int], list[np.ndarray]], num_examples: int, mods: Iterable) -> Callable:
    """A node's ClientApp callable: ``mods`` (outermost first) around a client whose training returns the
    fixed update ``update_of(node_id)`` on ``num_examples`` examples."""
    def train(message: Message, context: Context) -> Message:
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update_of(int(context.node_id))),
                        int(num_examples), {})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=message)

    call = train
    for mod in reversed(list(mods)):
        call = (lambda m, inner: lambda message, context: m(message, context, inner))(mod, call)
    return call


@dataclass
class InProcessRun:
    """A finished ``run_in_process``: the workflow (its ``reports``), each node's true update, and the
    average the strategy received (None: the round halted)."""

    workflow: SecAggPlusWorkflow
    updates: dict[int, list[np.ndarray]]
    num_examples: int
    average: list[np.ndarray] | None
    seconds: float


def run_in_process(workflow: SecAggPlusWorkflow, mods_of: Callable[[int], list], *, nodes: int = 4,
                   sizes: tuple[int, ...] = (6, 4), num_examples: int = 50, seed: int = 0,
                   quiet: bool = True) -> InProcessRun:
    """One SecAgg+ round of ``workflow`` over ``nodes`` nodes on a ``LocalGrid``; node ``i`` (by
    ascending node id; partition id ``i``) runs ``mods_of(i)`` (outermost first, e.g. ``[secaggplus_mod]``)
    around a client whose update is a fixed random vector of arrays of ``sizes`` values in [-1, 1]; Flower's
    log is kept to critical messages when ``quiet``."""
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < nodes:  # random 40-bit node ids, as Flower's are random
        drawn = int(rng.integers(1, 2 ** 40))
        ids = sorted(set(ids) | {drawn})
    updates = {node: [rng.uniform(-1, 1, size).astype(np.float32) for size in sizes] for node in ids}
    grid = LocalGrid({node: fixed_update_client(updates.__getitem__, num_examples, mods_of(i))
                      for i, node in enumerate(ids)})
    initial = [np.zeros(size, np.float32) for size in sizes]
    averages: list = []

    class Recording(FedAvg):
        def aggregate_fit(self, server_round, results, failures):
            averages.append(parameters_to_ndarrays(results[0][1].parameters) if results else None)
            return super().aggregate_fit(server_round, results, failures)

    strategy = Recording(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=nodes, min_available_clients=nodes,
                         initial_parameters=ndarrays_to_parameters(initial))
    from flwr.supercore.logger import FLOWER_LOGGER

    level = FLOWER_LOGGER.level
    if quiet:
        FLOWER_LOGGER.setLevel(logging.CRITICAL)
    with _server_identity():
        context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                                config=ServerConfig(num_rounds=1), strategy=strategy)
        for node in ids:
            context.client_manager.register(GridClientProxy(node, grid, 1))
        context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
            ndarrays_to_parameters(initial), keep_input=True)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: 1})
        # secaggplus_mod's stochastic rounding draws from numpy's global generator
        state = np.random.get_state()
        np.random.seed(seed)
        try:
            workflow(grid, context)
        finally:
            np.random.set_state(state)
            FLOWER_LOGGER.setLevel(level)
    return InProcessRun(workflow, updates, num_examples, averages[0] if averages else None,
                        time.perf_counter() - start)


def relative_error(recovered: list[np.ndarray], true: list[np.ndarray]) -> float:
    a = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in recovered])
    b = np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in true])
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def max_error(recovered: list[np.ndarray], true: list[np.ndarray]) -> float:
    return float(max(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
                     for a, b in zip(recovered, true)))
