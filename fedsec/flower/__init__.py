"""Audit a Flower app: fedsec's recorder, attacks and audit on a federation that runs in Flower.

The only part of fedsec that imports Flower (from a checkout: ``pip install -e '.[flower]'``). Pieces:

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
  engine records ``--secure-aggregation``; ``audit_secure_app`` and ``attack_secure_app`` (``harness``)
  audit and attack what such a server holds;
* ``MaliciousSecAggPlusWorkflow`` (``malicious_workflow``): a SecAgg+ server that deviates from the
  protocol (``SECAGG_SERVER_ATTACKS``), run in place of the app's workflow in simulation to audit one's own
  deployment (``attack_secagg_server``); ``UnmaskListCheck`` and ``SignedConsistency``
  (``secagg_defences``): the client mods that stop it, and ``ConsistencyCheckedSecAggPlusWorkflow``, the
  server side of the signed rounds;
* ``fedsec flower attack|audit``: ``harness``, under the commands of ``fedsec.flower_commands``.

Importing this package does not import Flower: the ground-truth hook (``log_batch``,
``log_training_set``, ``GroundTruthMod``) works without it. Everything loads on first use (so the
command line's help imports no torch); the Flower parts raise a one-line ``UserError`` naming the
extra when Flower is missing.
"""
from __future__ import annotations

import importlib

from fedecouple.errors import UserError

FLOWER_HINT = "pip install 'flwr[simulation]>=1.41,<1.43' (from a checkout: pip install -e '.[flower]')"

# ``fedsec flower attack``'s attacks by a SecAgg+ server that deviates from the protocol
# (``malicious_workflow``), and the client mods that check it (``secagg_defences``); here so that the
# command line's help lists them without importing Flower
SECAGG_SERVER_ATTACKS = {
    "unmask-dropout": "SecAgg+ server: asks the target's neighbours for it as surviving and as dropped, and "
                      "unmasks its upload (Flower checks neither list); then an image attack on it.",
    "split-view": "SecAgg+ server: tells some of the target's neighbours it survived and others that it "
                  "dropped (each list consistent), and unmasks its upload.",
    "sybil": "SecAgg+ server: places its own colluding nodes next to the target in the graph it draws; "
             "leakage against the number of sybil neighbours.",
    "key-substitution": "SecAgg+ server: relays its own public keys in place of the target's neighbours' "
                        "(no key is authenticated) and unmasks its upload.",
}
SECAGG_DEFENSES = ("none", "unmask-check", "signed-consistency")

_LAZY = {
    "MaliciousSecAggPlusWorkflow": "malicious_workflow",
    "AttackPlan": "malicious_workflow",
    "run_in_process": "malicious_workflow",
    "UnmaskListCheck": "secagg_defences",
    "SignedConsistency": "secagg_defences",
    "KeyDirectory": "secagg_defences",
    "ConsistencyCheckedSecAggPlusWorkflow": "secagg_defences",
    "attack_secagg_server": "harness",
    "RecordingStrategy": "recording",
    "simulate": "simulation",
    "FlowerRun": "simulation",
    "read_app": "app",
    "load_declaration": "declaration",
    "SecAggRecording": "secagg",
    "audit_secure_app": "harness",
    "attack_secure_app": "harness",
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


__all__ = ["FLOWER_HINT", "SECAGG_DEFENSES", "SECAGG_SERVER_ATTACKS", "GroundTruthMod", "log_batch", "log_training_set", "require_flwr", *_LAZY]
