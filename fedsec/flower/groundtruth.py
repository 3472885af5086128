"""The ground-truth hook of a Flower audit: which samples each node trained on, for scoring only.

fedsec's engine logs every mini-batch a client draws (``ClientContext.batches``) into a harness-only
``GroundTruth`` that attacks never see. A Flower app's training loop is the app's own code, so the app
reports its batches itself: it calls ``log_batch(pool_indices)`` for each mini-batch (positions in the
pooled data set its declaration names) and may call ``log_training_set`` once with its whole local
training set. Outside an audit both are no-ops, so an app can keep the calls in production.

``GroundTruthMod`` is the ClientApp mod that collects those calls for each training message and sends
them back to the auditing process by a side channel that is not the Flower ``Message``: one JSON file
per training message in a directory of this machine, named after the message id. The reply the
strategy sees is exactly what the app returned. Files, because in Flower's simulation engine the
ClientApps run in Ray worker processes of this machine, and a file written atomically is the plainest
channel that survives any worker; the mod is therefore for simulation only (in a deployment the files
would land on the clients' machines). The auditing process joins a file to its (round, client) through
the reply that answers the same message (``reply_to_message_id``).

This module does not import Flower.
"""
from __future__ import annotations

import json
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Callable

import numpy as np

from fedecouple.methods.base import BatchRecord

from .. import io

_ACTIVE: ContextVar["_Log | None"] = ContextVar("fedsec_flower_ground_truth", default=None)


class _Log:
    def __init__(self) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.training_set: list[int] | None = None


def log_batch(pool_indices, phase: str = "local") -> None:
    """Report one mini-batch the node trains on: its positions in the pooled data set. A no-op unless a
    ``GroundTruthMod`` is collecting for the current training message."""
    log = _ACTIVE.get()
    if log is not None:
        log.batches.append((str(phase), np.asarray(pool_indices, dtype=np.int64).reshape(-1).tolist()))


def log_training_set(pool_indices) -> None:
    """Report the node's whole local training set of this update (what its label distribution is
    measured on); without it, the samples of its batches stand in. A no-op outside an audit."""
    log = _ACTIVE.get()
    if log is not None:
        log.training_set = np.asarray(pool_indices, dtype=np.int64).reshape(-1).tolist()


def _file_name(message_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", message_id) + ".json"


def _is_training(message_type: str) -> bool:
    return message_type.split(".", 1)[0] == "train"


class GroundTruthMod:
    """A Flower ClientApp mod (``Callable[[Message, Context, call_next], Message]``) that collects what the
    app reports to ``log_batch``/``log_training_set`` while it handles a training message, and writes it
    to ``directory/<message id>.json`` (with the node id and, in simulation, its partition id). Other
    messages pass through untouched; the reply is never changed."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def __call__(self, message, context, call_next: Callable):
        if not _is_training(message.metadata.message_type):
            return call_next(message, context)
        log = _Log()
        token = _ACTIVE.set(log)
        try:
            reply = call_next(message, context)
        finally:
            _ACTIVE.reset(token)
        partition = context.node_config.get("partition-id")
        io.write_json(self.directory / _file_name(message.metadata.message_id), {
            "message_id": message.metadata.message_id, "node_id": int(context.node_id),
            "partition_id": None if partition is None else int(partition),
            "batches": log.batches, "training_set": log.training_set,
        })
        return reply


def read_records(directory: str | Path) -> dict[str, dict]:
    """Every record a ``GroundTruthMod`` wrote into ``directory``, by message id."""
    records = {}
    for path in sorted(Path(directory).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        records[record["message_id"]] = record
    return records


def batches_of(record: dict) -> list[BatchRecord]:
    """A record's batches in the form ``fedecouple.engine.GroundTruth.record`` takes: each batch's pool
    indices and their positions in the node's training set (the reported one, else the batches' samples
    in first-use order). The app reports no augmentation draws."""
    order = record["training_set"] or list(dict.fromkeys(i for _, batch in record["batches"] for i in batch))
    position = {int(i): p for p, i in enumerate(order)}
    return [BatchRecord(phase, np.asarray([position[int(i)] for i in indices], dtype=np.int64),
                        np.asarray(indices, dtype=np.int64)) for phase, indices in record["batches"]]
