"""The server channel: the only path between the server and its clients.

Every message is a typed object (``Download`` server→client, ``Upload`` client→server) holding
named tensors plus plain metadata. Messages pass an ordered chain of ``Interceptor`` objects that
may observe, replace or drop them. Each interceptor gets its own deep copy, so nothing it does can
reach client state or the server's model behind the channel's back.

The built-in ``Recorder`` sits at the server's end: it stores each download as the server sent it
and each upload as the server received it (after all interceptors), paired per (round, client).
That pair is exactly what an honest-but-curious server can see.

Under secure aggregation (``ServerChannel(secure=SecureAggregation(...))``) the channel gains a
round-level stage: uploads still pass the interceptors one by one (client-side hooks, e.g. a
defense), but what leaves each client is its masked vector (``fedecouple.secure_aggregation``). The
recorder then holds what such a server holds: the downloads, each client's masked upload (one
``"masked"`` integer tensor, uniform over the modulus, and beside it what the protocol leaves in the
clear: under ``clear_fields="flower"`` the client's ``sample_count`` and ``metric.*``, as Flower's
SecAgg+ leaves its FitRes ``num_examples`` and metrics) and the round's ``AggregateRecord`` (the decoded
sum, who took part, who dropped out, the clear fields); the method aggregates the decoded sum. A method
that aggregates in two passes (``SecureTwoPass``) adds, per round, a ``LaterPass``: what the server
sent back after the first sum, the second pass's masked uploads and its record (``Recorder.later_passes``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch

from .secure_aggregation import AggregateRecord, SecureAggregation, clear_values, for_pass, secure_round

def _clone_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


@dataclass(frozen=True)
class Message:
    round: int
    client_id: int
    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"message field {name!r} is {type(value).__name__}, expected a tensor")

    def copy(self):
        """A deep copy: tensors cloned and detached, metadata deep-copied."""
        return replace(self, tensors=_clone_tensors(self.tensors), meta=copy.deepcopy(dict(self.meta)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Download(Message):
    """Server → client: what the server sends a selected client at the start of a round."""


@dataclass(frozen=True)
class Upload(Message):
    """Client → server: everything a client sends back after local training."""


class Interceptor:
    """Base class for channel hooks. Return the message (possibly a new one) or ``None`` to drop it."""

    name = "interceptor"

    def on_download(self, message: Download) -> Download | None:
        return message

    def on_upload(self, message: Upload) -> Upload | None:
        return message


@dataclass
class Exchange:
    """One client's round as the server saw it: the download it answered and its upload."""

    download: Download
    upload: Upload | None = None


@dataclass
class LaterPass:
    """A later pass of a round under secure aggregation, as the server holds it: ``broadcast``, what it sent
    every participant of the pass (computed from the previous pass's sum); ``uploads``, each survivor's masked
    upload; ``record``, the pass's decoded sum (``AggregateRecord``)."""

    pass_index: int
    broadcast: dict[str, torch.Tensor]
    uploads: dict[int, Upload]
    record: AggregateRecord


class Recorder(Interceptor):
    """Stores every download as sent and every upload as received, keyed by (round, client).

    ``rounds`` limits full recording to those rounds (a 200-round run would otherwise hold every
    model of every client); with ``remember_latest`` (the default) each client's two latest uploads
    are kept too, which is what a server remembers of a part the client keeps across rounds (e.g. a
    personal classifier) and what attacks read as the "previous upload". A channel built without a
    recorder gets one that records and remembers nothing, so plain training holds no upload per
    client beyond the round that aggregates it.
    """

    name = "recorder"

    def __init__(self, rounds: Iterable[int] | None = None, remember_latest: bool = True) -> None:
        self.rounds = None if rounds is None else set(rounds)
        self.remember_latest = bool(remember_latest)
        self.exchanges: dict[tuple[int, int], Exchange] = {}
        # under secure aggregation: the protocol, and each round's record of the sum the server decoded
        self.secure: SecureAggregation | None = None
        self.aggregates: dict[int, AggregateRecord] = {}  # each round's first (or only) pass
        self.later_passes: dict[int, list[LaterPass]] = {}
        self._pending: set[tuple[int, int]] = set()  # downloads not recorded, awaiting their upload
        self._latest: dict[int, list[tuple[int, Upload]]] = {}

    def _keeps(self, round: int) -> bool:
        return self.rounds is None or round in self.rounds

    def on_download(self, message: Download) -> Download:
        key = (message.round, message.client_id)
        if self._keeps(message.round):
            self.exchanges[key] = Exchange(message.copy())
        else:
            self._pending.add(key)
        return message

    def on_upload(self, message: Upload) -> Upload:
        key = (message.round, message.client_id)
        if key in self.exchanges:
            stored = self.exchanges[key].upload = message.copy()
        elif key in self._pending:
            self._pending.discard(key)
            stored = message.copy() if self.remember_latest else None
        else:
            raise RuntimeError(f"upload from client {message.client_id} in round {message.round} answers no download")
        if self.remember_latest:
            history = self._latest.setdefault(message.client_id, [])
            history.append((message.round, stored))
            del history[:-2]
        return message

    def on_aggregate(self, record: AggregateRecord) -> None:
        """Store a secure-aggregation round's record (every round: it is what the server aggregates)."""
        self.aggregates[record.round] = record

    def on_later_pass(self, later: LaterPass) -> None:
        """Store a later pass of a secure-aggregation round (every round, as ``on_aggregate``)."""
        self.later_passes.setdefault(later.record.round, []).append(later)

    def get(self, round: int, client_id: int) -> Exchange | None:
        return self.exchanges.get((round, client_id))

    def uploads(self, client_id: int | None = None) -> Iterator[Upload]:
        for (_, cid), ex in sorted(self.exchanges.items()):
            if ex.upload is not None and (client_id is None or cid == client_id):
                yield ex.upload

    def previous_upload(self, client_id: int, before_round: int) -> Upload | None:
        """The client's latest upload strictly before ``before_round`` (the server's memory of it)."""
        found: tuple[int, Upload] | None = None
        candidates = [(rnd, ex.upload) for (rnd, cid), ex in self.exchanges.items()
                      if cid == client_id and ex.upload is not None]
        for rnd, upload in candidates + self._latest.get(client_id, []):
            if rnd < before_round and (found is None or rnd > found[0]):
                found = (rnd, upload)
        return None if found is None else found[1]

    def relabel(self, client_ids: Mapping[int, int]) -> None:
        """Rename clients: ``client_ids`` maps each recorded client id to a new one (one-to-one; ids
        not in it stay), in the exchanges and in the secure-aggregation records. For a recording made
        under provisional ids, e.g. a Flower run whose nodes are known by their partition ids only
        after the run."""
        rename = {int(old): int(new) for old, new in client_ids.items()}
        known = {cid for _, cid in self.exchanges} | {cid for _, cid in self._pending} | set(self._latest) | \
            {cid for record in self.aggregates.values() for cid in record.participants}
        final = [rename.get(cid, cid) for cid in known]
        if len(set(final)) != len(final):
            raise ValueError(f"relabelling {rename} would merge clients")

        def moved(message):
            return None if message is None else replace(message, client_id=rename.get(message.client_id,
                                                                                         message.client_id))

        self.exchanges = {(rnd, rename.get(cid, cid)): Exchange(moved(ex.download), moved(ex.upload))
                          for (rnd, cid), ex in self.exchanges.items()}
        self._pending = {(rnd, rename.get(cid, cid)) for rnd, cid in self._pending}
        self._latest = {rename.get(cid, cid): [(rnd, moved(up)) for rnd, up in history]
                        for cid, history in self._latest.items()}

        def ids(clients) -> tuple[int, ...]:
            return tuple(sorted(rename.get(cid, cid) for cid in clients))

        def renamed(record: AggregateRecord) -> AggregateRecord:
            return replace(record, participants=ids(record.participants), survivors=ids(record.survivors),
                           dropped=ids(record.dropped),
                           clear={rename.get(cid, cid): values for cid, values in record.clear.items()})

        self.aggregates = {rnd: renamed(record) for rnd, record in self.aggregates.items()}
        self.later_passes = {rnd: [replace(p, record=renamed(p.record),
                                           uploads={rename.get(c, c): moved(u) for c, u in p.uploads.items()})
                                   for p in passes] for rnd, passes in self.later_passes.items()}

class ServerChannel:
    """Carries downloads and uploads through the interceptor chain, in registration order."""

    def __init__(self, interceptors: Iterable[Interceptor] = (), recorder: Recorder | None = None,
                 secure: SecureAggregation | None = None):
        self.interceptors: list[Interceptor] = list(interceptors)
        self.recorder = recorder if recorder is not None else Recorder(rounds=(), remember_latest=False)
        self.recorder.secure = secure
        self.bytes_down = 0
        self.bytes_up = 0
        # each client's latest download, as it received it: distributed DP clips a client's update against it
        self.received: dict[int, Mapping[str, torch.Tensor]] = {}

    def _pass(self, message: Message, hook: str, kind: type) -> Message | None:
        for interceptor in self.interceptors:
            result = getattr(interceptor, hook)(message.copy())
            if result is None:
                return None
            if not isinstance(result, kind):
                raise TypeError(f"interceptor {interceptor.name!r} returned {type(result).__name__}, expected {kind.__name__}")
            message = result
        return message

    @property
    def secure(self) -> SecureAggregation | None:
        """The secure-aggregation protocol in force (None: off), as the recorder keeps it."""
        return self.recorder.secure

    def download(self, message: Download) -> Download | None:
        """Server → client. Recorded as sent; the client receives its own copy (or nothing if dropped)."""
        message = message.copy()
        self.recorder.on_download(message)
        self.bytes_down += message.nbytes
        out = self._pass(message, "on_download", Download)
        if out is not None and self.secure is not None and self.secure.private:
            self.received[out.client_id] = out.copy().tensors
        return None if out is None else out.copy()

    def upload(self, message: Upload) -> Upload | None:
        """Client → server. Recorded as received, after every interceptor; ``None`` if dropped. The
        client's message itself is never touched (each interceptor and the recorder get copies), and
        the server gets its own copy."""
        out = self._pass(message, "on_upload", Upload)
        if out is None:
            return None
        if self.secure is not None:
            return out  # still on the client's side: only its masked vector leaves (``aggregate_securely``)
        self.bytes_up += out.nbytes
        self.recorder.on_upload(out)
        return out.copy()

    def aggregate_securely(self, round: int, participants: list[int], uploads: list[Upload],
                           summands, pass_index: int = 0,
                           broadcast: dict[str, torch.Tensor] | None = None) -> AggregateRecord:
        """The round-level stage of secure aggregation: each upload (as the interceptors left it) becomes
        ``summands(upload)``, is masked and sent with the fields the protocol leaves in the clear; the
        recorder stores the masked uploads and the round's record of the decoded sum. ``participants``:
        the clients that got this round's download. A later pass (``pass_index`` > 0) runs among
        ``participants`` (the previous pass's survivors) as a fresh instance of the protocol (``for_pass``),
        after the server sent them ``broadcast``; nothing travels in the clear beside its masked uploads
        (each client's sample count went with the first), and the recorder keeps it as a ``LaterPass``."""
        if self.secure is None:
            raise RuntimeError("aggregate_securely needs a channel built with secure=SecureAggregation(...)")
        if pass_index:
            return self._later_pass(round, participants, uploads, summands, pass_index, broadcast or {})
        by_id = {u.client_id: u for u in uploads}
        record, masked = secure_round(self.secure, round, participants, {c: summands(u) for c, u in by_id.items()},
                                      {c: clear_values(u.tensors, u.meta) for c, u in by_id.items()},
                                      {c: self.received[c] for c in by_id if c in self.received})
        for client, vector in masked.items():
            beside = {name: torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)
                      for name, value in record.clear.get(client, {}).items()}
            sent = Upload(round, client, {"masked": torch.from_numpy(vector.astype(np.int64)), **beside},
                          {"secure_aggregation": True})
            self.bytes_up += sent.nbytes
            self.recorder.on_upload(sent)
        self.recorder.on_aggregate(record)
        return record

    def _later_pass(self, round: int, participants: list[int], uploads: list[Upload], summands, pass_index: int,
                    broadcast: dict[str, torch.Tensor]) -> AggregateRecord:
        self.bytes_down += len(participants) * sum(t.numel() * t.element_size() for t in broadcast.values())
        record, masked = secure_round(for_pass(self.secure, pass_index), round, participants,
                                      {u.client_id: summands(u) for u in uploads})
        sent = {client: Upload(round, client, {"masked": torch.from_numpy(vector.astype(np.int64))},
                               {"secure_aggregation": True, "pass": pass_index})
                for client, vector in masked.items()}
        self.bytes_up += sum(u.nbytes for u in sent.values())
        self.recorder.on_later_pass(LaterPass(pass_index, _clone_tensors(broadcast), sent, record))
        return record
