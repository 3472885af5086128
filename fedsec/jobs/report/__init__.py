"""Library behind ``fedsec report``: train, audit and attack several methods on the same partition
and seeds, then render one comparison (``reports.comparison``).

Stages, for every method (each in ``out/<method>/<stage>/``):

* ``train``          ``fedsec.runner.train`` → accuracy (config.json, metrics.csv, summary.json, ...);
* ``audit``          ``fedsec.jobs.audit.run_audit(evidence=False)`` → upload sizes and findings; the
                     evidence numbers come from the attack stages below instead (no attack runs twice);
* ``attack-<name>``  ``fedsec.jobs.attack.run_attack`` for each requested attack → attack.csv,
                     summary.json, reconstructions.png. An attack that does not apply to a method
                     (``dlg`` on FedProto, ``proto`` on a method that uploads no prototypes, ...)
                     is recorded as ``not applicable: <reason>``. With victim settings
                     (``ReportSettings.victim_settings``, ``--preset audit``) a gradient attack is
                     one stage per setting, ``attack-ig@textbook`` and ``attack-ig@real`` (the preset:
                     IG in the textbook setting, ``fedavg-leak`` in the real one): the
                     report's *cells*, which name its columns and ``results.csv``'s ``attack``.
                     With ``real_sizes`` (the preset: 4, 10, 50) the real setting is one cell per
                     client size N, ``attack-<attack>@real-n<N>``, on a federation of clients of exactly
                     N training images (trained by the stage, like the malicious section's).

One training serves several stages (``fedsec.recording.TrainingCache``): the train stage records every
round, and the method's audit and its attacks on real local training (same rounds trained, no
victim setting) use that federation instead of training it again; a textbook cell trains its own
(its targets train differently in the attacked rounds). The numbers are those of separate runs.
With ``jobs`` > 1 (``--jobs``; the audit preset: 2) each method's run of stages goes to one of that
many spawned processes, torch's threads shared out between them (``stages.run_stages``).

Every method uses the same ``RunConfig`` except ``method`` and the hyperparameters that method
takes, so all see the same partition, initial model and seeds.

Resuming: each stage is a ``fedsec.resumable.ResumableStage``, complete when its ``done.json`` — written
last, atomically, holding the stage's identity (its config and settings, without the settings that
never change a result: ``fedsec.runner.RESULT_NEUTRAL``) — exists and its result files are there.
Rerunning with the same ``out`` skips complete stages, resumes an interrupted ``train`` from its
checkpoint, and redoes any other incomplete stage from scratch. A stage folder whose ``done.json``
holds a *different* identity is an error (use another ``--out``), never overwritten. ``reuse``
folders (earlier report folders, or any folder below which they lie, or ``fedsec train`` run
folders) are searched for complete stages with the same identity, which are copied instead of
recomputed.

The malicious-server section (``malicious``): every requested attack of kind ``malicious`` (``trap``,
``binning``, ...) runs as its own stages, not as a headline cell: ``attack-<attack>@n<N>`` and
``attack-<attack>@n<N>+check`` per method and client size N (``ReportSettings.malicious_sizes``),
each a federation of clients of exactly N training images (``--train-images N``), the download
check off and on. A method the crafted download cannot reach is recorded as not applicable with the
reason, before training. Its rows go to ``malicious.csv``, the report's "Malicious server" section
and ``malicious_by_size.png``.

Top-level outputs in ``out`` (written atomically after the last stage): ``report.md``,
``report.html``, ``psnr_by_method.png``, ``accuracy_vs_leakage.png``, ``results.csv`` (every
attack.csv concatenated: one row per method × attack × round × client × image; ``labels`` rows are
per class, with ``class`` set and ``image`` empty), ``summary.csv`` (one row per method, the
headline columns: per cell n, mean PSNR with its 95 % interval, the share recovered with its
interval, the forward-model check's counts) and ``by_round.csv`` (the same per attacked round; with
several rounds also a report section and ``leakage_by_round.png``). Before the first stage the report
prints its time estimate (``fedsec.estimate``).

The package, by job: ``settings`` (``ReportSettings``, the cells, ``--preset audit``), ``stages``
(plan, resume, reuse, run), ``tables`` (the tables assembled from the stage folders), ``malicious``
(the malicious-server section's rows) and ``build``
(``build_report``: validate, run the stages, write the files).
"""
from __future__ import annotations

from ..attack import parse_attacks, parse_rounds
from ..compare import parse_methods
from .build import build_report, validate
from .malicious import SECTION_COLUMNS, section_table
from .settings import (AUDIT_ATTACKS, AUDIT_ITERATIONS, AUDIT_ROUNDS, DEFAULT_ATTACKS, DEFAULT_MALICIOUS_SIZES,
                       DEFAULT_METHODS, DEFAULT_TARGETS, VICTIM_SETTINGS, MaliciousCell, ReportSettings, attack_of,
                       audit_preset, parse_iterations, parse_sizes)
from .stages import Stage, plan, run_stage, stage_identity
from .tables import RESULT_COLUMNS, assemble, headline_markdown, leakage_by_round, method_comparisons

__all__ = ["AUDIT_ATTACKS", "AUDIT_ITERATIONS", "AUDIT_ROUNDS", "DEFAULT_ATTACKS", "DEFAULT_MALICIOUS_SIZES",
           "DEFAULT_METHODS", "DEFAULT_TARGETS", "RESULT_COLUMNS", "SECTION_COLUMNS", "VICTIM_SETTINGS",
           "MaliciousCell", "ReportSettings", "Stage", "assemble", "attack_of", "audit_preset", "build_report",
           "headline_markdown", "leakage_by_round", "method_comparisons", "parse_attacks", "parse_iterations",
           "parse_methods", "parse_rounds", "parse_sizes", "plan", "run_stage", "section_table", "stage_identity",
           "validate"]
