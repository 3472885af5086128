"""Federated methods, one per file, behind the ``Method`` interface of ``base.py``."""
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


def method_names() -> list[str]:
    return list(METHODS)


def make_method(name: str, **hyperparameters) -> Method:
    """Instantiate a method by name; unknown hyperparameters are ignored only if ``None``."""
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    cls = METHODS[name]
    accepted = getattr(cls, "__dataclass_fields__", {})
    kwargs = {k: v for k, v in hyperparameters.items() if k in accepted and v is not None}
    return cls(**kwargs)


__all__ = ["METHODS", "ClientContext", "FieldSpec", "Method", "TrainConfig", "make_method", "method_names"]
