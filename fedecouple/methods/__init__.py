"""Federated methods, one per file, behind the ``Method`` interface of ``base.py``.

Adding a method: one file defining a ``Method`` dataclass, plus its line in ``METHODS``."""
from __future__ import annotations

from ..errors import UserError
from .base import ClientContext, FieldSpec, Method, TrainConfig
from .fedavg import FedAvg, FTFedAvg
from .fedecouple import FedeCouple
from .fedpac import FedPAC
from .fedper import FedPer
from .fedproto import FedProto
from .fedrep import FedRep
from .local import Local

METHODS: dict[str, type[Method]] = {
    "fedecouple": FedeCouple,
    "fedavg": FedAvg,
    "ft-fedavg": FTFedAvg,
    "fedper": FedPer,
    "fedrep": FedRep,
    "fedpac": FedPAC,
    "fedproto": FedProto,
    "local": Local,
}


def method_class(name: str) -> type[Method]:
    """The method registered as ``name``, or a one-line UserError listing the choices."""
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


def make_method(name: str, **hyperparameters) -> Method:
    """Instantiate a method by name with the hyperparameters it takes (others, and ``None`` values,
    are ignored: callers that must refuse unknown names check ``Method.accepted`` first)."""
    cls = method_class(name)
    return cls(**{k: v for k, v in cls.accepted(hyperparameters).items() if v is not None})


__all__ = ["METHODS", "ClientContext", "FieldSpec", "Method", "TrainConfig", "make_method", "method_class"]
