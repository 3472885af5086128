"""fedsec: a privacy and security evaluation toolkit for personalised federated learning.

The public interface is ``fedsec.api``'s (its docstring says what is stable): one function per job,
``fedsec.train``, ``attack``, ``audit``, ``report``, ``defend``, ``mia`` and ``compare``, each taking the
flags of the command of the same name as keywords and returning a result object. They load on first
use (PEP 562), so ``import fedsec`` stays cheap: torch is imported when a job runs. (``fedsec.attack``,
``audit``, ``report``, ``defend``, ``mia`` and ``compare`` are also the modules behind those commands,
made callable as the functions: ``fedsec.jobs``.)
"""
from __future__ import annotations

import importlib

__all__ = ["train", "attack", "audit", "report", "defend", "mia", "compare", "Result", "TrainResult",
           "AttackResult", "AuditResult", "ReportResult", "DefendResult", "MiaResult", "CompareResult"]
_JOB_MODULES = ("attack", "audit", "report", "defend", "mia", "compare")


def __getattr__(name: str):
    if name in _JOB_MODULES:  # the module (callable as the API function), as importing it would bind
        return importlib.import_module(f"{__name__}.{name}")
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedsec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
