"""What the jobs give back, to the command line (which prints ``lines``) and to Python (``fedsec.api``):
one result class per job, the summary's figures readable as attributes."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Result", "TrainResult", "AttackResult", "AuditResult", "ReportResult", "DefendResult", "MiaResult",
           "CompareResult"]


@dataclass
class Result:
    """What a job gives back: ``summary`` (its figures, also readable as attributes), ``rows`` (a
    DataFrame), ``out`` (the folder written, None in memory) and ``lines`` (what the CLI prints)."""

    summary: dict
    rows: Any = None
    out: Path | None = None
    lines: list[str] = field(default_factory=list)

    def __getattr__(self, name: str):
        summary = self.__dict__.get("summary")
        if isinstance(summary, dict) and name in summary:
            return summary[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or summary figure {name!r}")

    def __str__(self) -> str:
        return "\n".join(self.lines)


@dataclass
class TrainResult(Result):
    """``rows``: metrics per round and client (round, client, accuracy, loss); ``mean_accuracy``,
    ``std_accuracy``, ``rounds`` from the summary."""


@dataclass
class AttackResult(Result):
    """``rows``: one per reconstructed image (or, for a label attack, per class); ``reconstructions``
    and ``ground_truth``: (n, C, H, W) tensors of the images shown in reconstructions.png (None for a
    label attack, and when the result was read back from a finished folder); ``mean_psnr``,
    ``mean_prior_psnr``, ``mean_ssim``, ``label_accuracy``, ... from the summary."""

    reconstructions: Any = None
    ground_truth: Any = None


@dataclass
class AuditResult(Result):
    """``rows``: one per uploaded field (audit.csv); ``findings``: the findings, most severe first."""

    findings: list = field(default_factory=list)


@dataclass
class ReportResult(Result):
    """``rows``: results.csv (one per method, attack, round, client, image); ``table``: summary.csv
    (one row per method); ``failed``: the stages that failed."""

    table: Any = None
    failed: list = field(default_factory=list)


@dataclass
class DefendResult(Result):
    """``rows``: the trade-off table, one row per value (tradeoff.csv)."""


@dataclass
class MiaResult(Result):
    """``rows``: per record and attack scores (mia.csv); AUCs and TPRs in ``summary['targets']``."""


@dataclass
class CompareResult(Result):
    """``rows``: one row per method and seed (method, seed, mean_accuracy, std_accuracy)."""
