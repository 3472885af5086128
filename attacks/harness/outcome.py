"""What an attack on a recorded run returns, whatever its target: the rows' columns, the typed summary
(``AttackSummary``, whose ``record`` is ``summary.json``) and the ``AttackOutcome`` that carries them with the
figure's panels; shared by the per-client flow (``attacks.harness.clients``) and the round-level one
(``attacks.harness.rounds``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..metrics import SUMMARY_KEYS
from ..registry import AttackSpec

IMAGE_COLUMNS = ["method", "attack", "mode", "round", "client", "image", "psnr", "ssim", "prior_psnr",
                 "class_prior_psnr", "label_true", "label_pred", "mis_specified", "not_converged", "replay_cosine",
                 "objective_truth", "objective_reconstruction", "label_count_error", "input_error"]
CHECK_KEYS = ("mis_specified", "not_converged", "replay_cosine", "replay_relative_error", "objective_truth",
              "objective_reconstruction")
LABEL_COLUMNS = ["method", "attack", "mode", "round", "client", "class", "true_count", "true_proportion",
                 "predicted_proportion"]
MAX_PANELS = 16


@dataclass(frozen=True)
class AttackSummary:
    """What an attack on a recorded run measured: the score summary (``attacks.metrics.SUMMARY_KEYS``)
    and its statistics, the label scores, what ran on which target, the forward-model check over all
    targets (``mis_specified`` ...), and the notes for the user."""

    method: str
    attack: str
    dataset: str
    run: str
    scores: dict
    statistics: dict
    label_accuracy: float
    class_presence_accuracy: float
    images_scored: int
    seed: int
    attack_rounds: list[int]
    targets: dict[str, list[int]]
    budget: dict
    victim: dict | None
    threat_model: dict
    per_target: list[dict]
    checks: dict
    notes: list[str]
    label_scores: list[dict] | None = None
    not_applicable: str | None = None  # why nothing could be scored, when nothing could

    def record(self, seconds: float, context: dict | None = None, notes_before: list[str] = ()) -> dict:
        """The summary as one JSON-ready dict (keys in the order ``summary.json`` has always had):
        ``context`` (settings, run facts, provenance) goes before the notes, ``notes_before`` first
        among them."""
        out = {"method": self.method, "attack": self.attack, "dataset": self.dataset, "run": self.run,
               **{k: self.scores[k] for k in SUMMARY_KEYS}, **self.statistics,
               "label_accuracy": self.label_accuracy, "class_presence_accuracy": self.class_presence_accuracy,
               "images_scored": self.images_scored, "seconds": round(seconds, 2), "seed": self.seed,
               "attack_rounds": list(self.attack_rounds), "targets": self.targets, "budget": self.budget,
               "victim": self.victim, "threat_model": self.threat_model, "per_target": self.per_target,
               **self.checks, **(context or {}), "notes": list(notes_before) + list(self.notes)}
        if self.label_scores:
            out["label_scores"] = self.label_scores
        if self.not_applicable is not None:
            out["not_applicable"] = self.not_applicable
        return out


@dataclass(frozen=True)
class AttackOutcome:
    """``rows`` (``IMAGE_COLUMNS`` or, for a label attack, ``LABEL_COLUMNS``), ``panels`` (truth,
    reconstruction, PSNR, caption) for the figure, and the ``summary``."""

    spec: AttackSpec
    rows: list[dict]
    panels: list[tuple]
    summary: AttackSummary

    @property
    def columns(self) -> list[str]:
        return IMAGE_COLUMNS + list(self.spec.extra_columns) if self.spec.rebuilds_images else LABEL_COLUMNS


def check_summary(checks: list[dict]) -> dict:
    """The forward-model check over all targets: whether any was mis-specified, how many stopped short
    of the truth's objective (``not_converged``), the worst replay."""
    if not checks:
        return {"mis_specified": None, "mis_specified_targets": None, "not_converged_targets": None,
                "replay_cosine_min": None}
    flags = [c["mis_specified"] for c in checks if c.get("mis_specified") is not None]
    short = [c["not_converged"] for c in checks if c.get("not_converged") is not None]
    cosines = [c["replay_cosine"] for c in checks if c.get("replay_cosine") is not None]
    return {"mis_specified": any(flags) if flags else None, "mis_specified_targets": sum(flags) if flags else None,
            "not_converged_targets": sum(short) if short else None,
            "replay_cosine_min": min(cosines) if cosines else None}


def budget_record(budget, batched: bool) -> dict:
    """The summary's ``budget``: what each target's attack was given."""
    return {"iterations": budget.iterations, "restarts": budget.restarts, "images_per_target": budget.batch,
            "batched": batched}


def victim_record(victim) -> dict | None:
    """The summary's ``victim``: the victim setting the targets trained in (None: their real training)."""
    return None if victim is None else {"batch": victim.batch, "steps": victim.steps}


def threat_record(threat, scored, server_sees: str, server: str | None = None, **extra) -> dict:
    """The summary's ``threat_model``: what the attacker knew, the modes its attacks used on the ``scored``
    targets, what the server held (``server_sees``), ``extra`` facts and, for a malicious server, what it sent."""
    return {"hyperparameters_known": threat.hyperparameters_known, "head_known": threat.head_known,
            "mode_requested": threat.mode,
            "modes_used": sorted({str(j.result.trace.get("mode", "n/a")) for j in scored}),
            "server_sees": server_sees, **extra, **({"server": server} if server is not None else {})}
