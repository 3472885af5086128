"""Federated methods, one per file, behind the ``Method`` interface of ``base.py``.

Every method is declared once, below: its name (the command line's method choice), where its ``Method`` class lives
and its facts, which the command line's help and ``fedsec.estimate`` read without importing torch:

* ``summary``: one line on what it does;
* ``round_seconds`` (optional): seconds per client per round of training on the reference machine (mnist5k,
  ~187 training images a client, one local epoch, 2 CPU cores, one torch thread); without it the estimate
  takes ``fedsec.estimate.DEFAULT_ROUND_SECONDS``.

Importing this package imports no torch: a class is imported when first used (``METHODS[name]``,
``method_class``, ``make_method``), and ``Method``, ``ClientContext``, ``FieldSpec``, ``TrainConfig`` and
the method classes are read from their modules on first access.

Adding a method: one file in ``fedecouple/methods/`` defining a ``Method`` dataclass, plus its line here:
``METHODS.declare("mine", "fedecouple.methods.mine:Mine", summary="...")``. A method outside this package
(a user's own, a test's toy) is declared the same way at run time, before the command line is built:
``fedecouple.methods.METHODS.declare("mine", "package.module:Mine", summary="...")``.
"""
from __future__ import annotations

from ..errors import UserError
from ..plugins import Plugins

METHODS = Plugins("method")  # name → its Method class, in the command line's order
METHODS.declare("fedecouple", "fedecouple.methods.fedecouple:FedeCouple", round_seconds=0.363,
                summary="decoupled extractor/classifier: KD-guided personal classifier, anchor centre loss, "
                        "cosine aggregation")
METHODS.declare("fedavg", "fedecouple.methods.fedavg:FedAvg", round_seconds=0.062,
                summary="one global model: full-model upload, sample-weighted average")
METHODS.declare("ft-fedavg", "fedecouple.methods.fedavg:FTFedAvg", round_seconds=0.07,
                summary="FedAvg, with the global model fine-tuned locally before evaluation")
METHODS.declare("fedper", "fedecouple.methods.fedper:FedPer", round_seconds=0.066,
                summary="shared base averaged by sample count; personal head trained jointly, never uploaded")
METHODS.declare("fedrep", "fedecouple.methods.fedrep:FedRep", round_seconds=0.07,
                summary="head epochs (base frozen) then base epochs (head frozen); base averaged, head personal")
METHODS.declare("fedpac", "fedecouple.methods.fedpac:FedPAC", round_seconds=0.127,
                summary="prototype feature alignment; per-client QP combines all heads; uploads base, head, "
                        "prototypes, label stats")
METHODS.declare("fedproto", "fedecouple.methods.fedproto:FedProto", round_seconds=0.076,
                summary="whole model local; uploads per-class prototypes and counts only (no weights)")
METHODS.declare("local", "fedecouple.methods.local:Local", round_seconds=0.06,
                summary="no communication: each client trains alone")

# the interface's names, read from ``base.py`` on first access (it imports torch)
_BASE = ("ClientContext", "FieldSpec", "Method", "TrainConfig")


def method_class(name: str):
    """The ``Method`` class declared as ``name``, or a one-line UserError listing the choices."""
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


def make_method(name: str, **hyperparameters):
    """Instantiate a method by name with the hyperparameters it takes (others, and ``None`` values,
    are ignored: callers that must refuse unknown names check ``Method.accepted`` first)."""
    cls = method_class(name)
    return cls(**{k: v for k, v in cls.accepted(hyperparameters).items() if v is not None})


def __getattr__(name: str):
    """``Method``, ``ClientContext``, ``FieldSpec``, ``TrainConfig`` and each declared method's class (by its
    class name, e.g. ``FedAvg``), imported on first access."""
    if name in _BASE:
        from . import base

        return getattr(base, name)
    for declared in METHODS:
        if METHODS.declaration(declared).target.rpartition(":")[2] == name:
            return METHODS[declared]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["METHODS", "ClientContext", "FieldSpec", "Method", "TrainConfig", "make_method", "method_class"]
