"""fedsec: a privacy and security evaluation toolkit for personalised federated learning.

The public interface is ``fedsec.api``'s (its docstring says what is stable): one function per job,
``fedsec.train``, ``attack``, ``audit``, ``report``, ``defend``, ``mia`` and ``compare``, each taking the
flags of the command of the same name as keywords and returning a result object. They load on first
use (PEP 562), so ``import fedsec`` stays cheap: torch is imported when a job runs. The library behind
each job is in ``fedsec.jobs`` (``fedsec.jobs.attack``, ...): no module of this package shares a name
with an API function, so importing one never hides the function.
"""
from __future__ import annotations

__all__ = ["train", "attack", "audit", "report", "defend", "mia", "compare", "Result", "TrainResult",
           "AttackResult", "AuditResult", "ReportResult", "DefendResult", "MiaResult", "CompareResult"]


def __getattr__(name: str):
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedsec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
