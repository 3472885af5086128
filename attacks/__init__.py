"""Attacks on what the channel carried. Every attack is ``attack(observation, budget, seed) -> AttackResult``
(see ``attacks.base``); gradient attacks also take ``mode`` (auto, replay, scaled).

``ATTACKS`` maps the CLI names to the functions. ``proto`` and ``labels`` live in
``attacks/proto.py`` and ``attacks/labels.py`` and are imported on first use.
"""
from __future__ import annotations

from .base import AttackResult, Budget, LocalHyperparameters, NotApplicable, Observation
from . import dlg as _dlg, ig as _ig  # the submodules keep their names: attacks.dlg is the module

GRADIENT_ATTACKS = ("dlg", "idlg", "ig")


class AttackUnavailable(RuntimeError):
    """The attack's module is not part of this installation."""


def _proto_attack(observation: Observation, budget: Budget, seed: int, **_) -> AttackResult:
    """Prototype inversion (``attacks.proto.prototype_inversion``), imported on first use."""
    try:
        from .proto import prototype_inversion
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
        if exc.name != "attacks.proto":
            raise
        raise AttackUnavailable("the proto attack is not available (attacks/proto.py is missing)") from exc
    return prototype_inversion(observation, budget, seed)


def _labels_attack(observation: Observation, budget: Budget, seed: int, **_) -> AttackResult:
    """Label-distribution inference (``attacks.labels.label_inference``), imported on first use."""
    try:
        from .labels import label_inference
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
        if exc.name != "attacks.labels":
            raise
        raise AttackUnavailable("the labels attack is not available (attacks/labels.py is missing)") from exc
    return label_inference(observation, budget, seed)


def score_label_distribution(predicted, true_counts) -> dict:
    """``attacks.labels.score_label_distribution``, imported on first use."""
    try:
        from .labels import score_label_distribution as score
    except ModuleNotFoundError as exc:  # pragma: no cover
        if exc.name != "attacks.labels":
            raise
        raise AttackUnavailable("label scoring is not available (attacks/labels.py is missing)") from exc
    return score(predicted, true_counts)


def check_available(name: str) -> None:
    """Raise ``AttackUnavailable`` if the module behind attack ``name`` cannot be imported."""
    module = {"proto": "proto", "labels": "labels"}.get(name)
    if module is None:
        return
    import importlib

    try:
        importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{module}":
            raise
        raise AttackUnavailable(f"the {name} attack is not available (attacks/{module}.py is missing)") from None


ATTACKS = {"dlg": _dlg.dlg, "idlg": _dlg.idlg, "ig": _ig.inverting_gradients, "proto": _proto_attack,
           "labels": _labels_attack}

__all__ = ["ATTACKS", "GRADIENT_ATTACKS", "AttackResult", "AttackUnavailable", "Budget", "LocalHyperparameters",
           "check_available",
           "NotApplicable", "Observation", "score_label_distribution"]
