"""Audit a Flower app: fedsec's recorder, attacks and audit on a federation that runs in Flower.

The only part of fedsec that imports Flower (``pip install 'fedsec[flower]'``). Pieces:

* ``RecordingStrategy`` (``recording``): wraps any Message-API ``flwr.serverapp.strategy.Strategy``;
  records each node's download and upload into a ``fedecouple.channel.Recorder``; optional fedsec
  interceptors act on the replies before aggregation;
* ``GroundTruthMod`` and ``log_batch`` (``groundtruth``): the harness-only record of which samples each
  node trained on, sent back by a side channel that is not the Flower message (simulation only);
* ``simulate`` (``simulation``): runs an app directory in Flower's simulation engine with both wrapped
  in, and returns a ``FlowerRun``; the app describes itself to fedsec in ``[tool.fedsec]``
  (``declaration``);
* ``SecAggRecording`` (``secagg``): the recording point of a legacy app under Flower's own SecAgg+
  (``SecAggPlusWorkflow``): the masked uploads and each round's unmasked sum, recorded as fedsec's
  engine records ``--secure-aggregation``; ``audit_secure_app`` and ``attack_secure_app`` audit and
  attack what such a server holds;
* ``fedsec flower attack|audit`` (``cli``).

Importing this package does not import Flower: the ground-truth hook (``log_batch``,
``log_training_set``, ``GroundTruthMod``) works without it. Everything loads on first use (so the
command line's help imports no torch); the Flower parts raise a one-line ``UserError`` naming the
extra when Flower is missing.
"""
from __future__ import annotations

import importlib

from fedecouple.errors import UserError

FLOWER_HINT = "pip install 'fedsec[flower]'"

_LAZY = {
    "RecordingStrategy": "recording",
    "simulate": "simulation",
    "FlowerRun": "simulation",
    "read_app": "app",
    "load_declaration": "declaration",
    "SecAggRecording": "secagg",
    "audit_secure_app": "secagg",
    "attack_secure_app": "secagg",
}


def require_flwr() -> None:
    """A one-line UserError naming the extra unless Flower (with its simulation engine) is installed."""
    try:
        import flwr.serverapp.strategy  # noqa: F401
        import flwr.simulation  # noqa: F401
    except ImportError:
        raise UserError(f"fedsec flower needs Flower, which is not installed: {FLOWER_HINT}") from None
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UserError(f"Flower's simulation engine needs Ray, which is not installed: {FLOWER_HINT}") from None


# the ground-truth hook needs no Flower; loaded on first use too (it imports torch, which the help must not)
_HOOK = {"GroundTruthMod": "groundtruth", "log_batch": "groundtruth", "log_training_set": "groundtruth"}


def __getattr__(name: str):
    if name in _HOOK:
        return getattr(importlib.import_module(f"{__name__}.{_HOOK[name]}"), name)
    if name in _LAZY:
        require_flwr()
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FLOWER_HINT", "GroundTruthMod", "log_batch", "log_training_set", "require_flwr", *_LAZY]
