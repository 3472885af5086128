"""Library behind ``fedsec report``: train, audit and attack several methods on the same partition
and seeds, then render one comparison (``reports.comparison``).

Stages, for every method (each in ``out/<method>/<stage>/``):

* ``train``          ``fedsec.runner.train`` → accuracy (config.json, metrics.csv, summary.json, ...);
* ``audit``          ``fedsec.audit.run_audit(evidence=False)`` → upload sizes and findings; the
                     evidence numbers come from the attack stages below instead (no attack runs twice);
* ``attack-<name>``  ``fedsec.attack.run_attack`` for each requested attack → attack.csv,
                     summary.json, reconstructions.png. An attack that does not apply to a method
                     (``dlg`` on FedProto, ``proto`` on a method that uploads no prototypes, ...)
                     is recorded as ``not applicable: <reason>``. With victim settings
                     (``ReportSettings.victim_settings``, ``--preset audit``) a gradient attack is
                     one stage per setting, ``attack-ig@textbook`` and ``attack-ig@real``: the
                     report's *cells*, which name its columns and ``results.csv``'s ``attack``.

One training serves several stages (``fedsec.attack.TrainingCache``): the train stage records every
round, and the method's audit and its attacks on real local training (same rounds trained, no
victim setting) use that federation instead of training it again; a textbook cell trains its own
(its targets train differently in the attacked rounds). The numbers are those of separate runs.

Every method uses the same ``RunConfig`` except ``method`` and the hyperparameters that method
takes, so all see the same partition, initial model and seeds.

Resuming: a stage is complete when its ``done.json`` exists — written last, atomically, holding the
stage's identity (its config and settings, without the settings that never change a result:
``fedsec.runner.RESULT_NEUTRAL``).
Rerunning with the same ``out`` skips complete stages, resumes an interrupted ``train`` from its
checkpoint, and redoes any other incomplete stage from scratch. A stage folder whose ``done.json``
holds a *different* identity is an error (use another ``--out``), never overwritten. ``reuse``
folders (earlier report folders, or any folder below which they lie, or ``fedsec train`` run
folders) are searched for complete stages with the same identity, which are copied instead of
recomputed.

Top-level outputs in ``out`` (written atomically after the last stage): ``report.md``,
``report.html``, ``psnr_by_method.png``, ``accuracy_vs_leakage.png``, ``results.csv`` (every
attack.csv concatenated: one row per method × attack × round × client × image; ``labels`` rows are
per class, with ``class`` set and ``image`` empty), ``summary.csv`` (one row per method, the
headline columns: per cell n, mean PSNR with its 95 % interval, the share recovered with its
interval, the forward-model check's counts) and ``by_round.csv`` (the same per attacked round; with
several rounds also a report section and ``leakage_by_round.png``). Before the first stage the report
prints its time estimate (``fedsec.estimate``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

import attacks
from fedecouple.errors import UserError

from . import estimate, io, runner
from attacks.metrics import PSNR_CAP_DB, SUCCESS_RULE, summarize_scores
from .attack import (IMAGE_COLUMNS, LABEL_COLUMNS, AttackSettings, TrainingCache, check_applicable, parse_attacks,
                     parse_rounds, recording_federation, run_attack, training_key)
from .audit import LEAK_GAP_DB, at_chance, psnr_gap, run_audit
from .compare import method_config, parse_list, parse_methods, run_status, shared_datasets, unused_hyperparameters
from .runner import RunConfig
from .versions import provenance
from reports.audit import SEVERITIES
from reports.formatting import forward_check_verdict, interval_text, is_lower_bound, is_true

DEFAULT_METHODS = ("fedecouple", "fedper", "fedpac", "fedproto")
DEFAULT_ATTACKS = ("dlg", "ig", "proto", "labels")
DEFAULT_TARGETS = 2
DONE = "done.json"
RESULT_COLUMNS = list(dict.fromkeys(IMAGE_COLUMNS + LABEL_COLUMNS))


VICTIM_SETTINGS = ("textbook", "real")


def attack_of(key: str) -> str:
    """The registered attack of a report cell key (``ig`` or ``ig@real``)."""
    return key.partition("@")[0]


@dataclass
class ReportSettings:
    """How every attack stage is run (the same for all methods). Each attack runs as ``fedsec
    attack`` does by default (its declared iterations and victim setting) unless overridden here.

    With ``victim_settings`` each gradient attack runs once per setting, as its own cell ``<attack>@
    <setting>``: ``textbook`` (each target trains one step on ``textbook_batch`` of its images) and
    ``real`` (its real local training); the other attacks read the real local training anyway.
    ``iterations`` and ``targets_by`` may name a cell (``ig@real``) or an attack (``ig``)."""

    rounds: tuple[int, ...] = (0,)
    targets: int = DEFAULT_TARGETS
    iterations: dict[str, int] = field(default_factory=dict)  # per cell or attack; missing → the attack's default
    restarts: int | None = None  # None: each attack's declared restarts
    images: int = 1  # images rebuilt per target when the victim trains normally (proto, labels)
    victim_settings: tuple[str, ...] = ()
    textbook_batch: int = 1
    targets_by: dict[str, int] = field(default_factory=dict)  # per cell or attack; missing → targets

    def keys(self, attack_names: Iterable[str]) -> list[str]:
        """The report's cells: one per attack, or one per attack and victim setting (gradient attacks)."""
        return [f"{a}@{v}" if v else a for a in attack_names
                for v in (self.victim_settings if attacks.get(a).kind == "gradient" and self.victim_settings else [""])]

    def for_attack(self, key: str) -> AttackSettings:
        attack, _, setting = key.partition("@")
        spec = attacks.get(attack)
        victim = {"": spec.default_victim_batch, "real": 0, "textbook": self.textbook_batch}[setting]
        pick = lambda table, default: table.get(key, table.get(attack, default))  # noqa: E731
        return AttackSettings(attack=attack, rounds=tuple(int(r) for r in self.rounds),
                              targets=int(pick(self.targets_by, self.targets)),
                              iterations=int(pick(self.iterations, spec.default_iterations)),
                              restarts=spec.default_restarts if self.restarts is None else int(self.restarts),
                              images=int(self.images) if victim == 0 else victim,  # the victim's batch
                              victim_batch=victim, victim_steps=1)


def audit_preset(iterations: dict[str, int] | None = None) -> ReportSettings:
    """``--preset audit``'s attack plan (the federation is ``runner.AUDIT_FEDERATION``): attacks at
    round 0 and at the last round, IG in the textbook setting (16 clients, one step on 2 images each)
    and on the clients' real local training (2 clients, every image they trained on), prototype
    inversion on 11 clients (3 prototypes each) and label inference on all 20: at least 32 images per
    image cell. One start per reconstruction; IG's budget is cut on the real local training, where
    each step replays a whole epoch (or FedeCouple's three) on ~180 images."""
    return ReportSettings(rounds=AUDIT_ROUNDS, victim_settings=VICTIM_SETTINGS, textbook_batch=2, restarts=1,
                          targets_by={"ig@textbook": 16, "ig@real": 2, "proto": 11, "labels": 20},
                          iterations={**{k: v for k, v in AUDIT_ITERATIONS.items()
                                         if k not in (iterations or {}) and attack_of(k) not in (iterations or {})},
                                      **(iterations or {})})


AUDIT_ATTACKS = ("ig", "proto", "labels")
AUDIT_ROUNDS = (0, 19)
AUDIT_ITERATIONS = {"ig@textbook": 500, "ig@real": 100, "proto": 300}


@dataclass
class Stage:
    method: str
    name: str  # train | audit | attack-<attack> | mia
    attack: str | None
    config: RunConfig
    identity: dict
    path: Path

    @property
    def kind(self) -> str:
        return "attack" if self.attack else self.name

    mia: object = None  # the MiaSettings of a membership-inference stage


def parse_iterations(text: str | None) -> dict[str, int]:
    """``"300"`` (every attack) or ``"dlg=300,ig=1000,ig@real=200"`` → {attack or cell: iterations}."""
    if text is None or str(text).strip() == "":
        return {}
    out: dict[str, int] = {}
    for item in parse_list(str(text), "iterations"):
        name, _, value = item.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise UserError(f"--iterations expects N or ATTACK=N,..., got {item!r}") from None
        if n < 1:
            raise UserError(f"--iterations must be at least 1, got {n}")
        names = [name] if name else list(attacks.ATTACKS)
        for a in names:
            attack, at, setting = a.partition("@")
            if attack not in attacks.ATTACKS:
                raise UserError(f"--iterations names unknown attack {attack!r}; choose from: {', '.join(attacks.ATTACKS)}")
            if at and setting not in VICTIM_SETTINGS:
                raise UserError(f"--iterations names unknown setting {a!r}; a cell is ATTACK@"
                                f"{'|'.join(VICTIM_SETTINGS)}")
            out[a] = n
    return out


def stage_identity(kind: str, config: RunConfig, settings=None) -> dict:
    """What a stage's result depends on (stored in its done.json; a stage is reused only when equal)."""
    if kind == "mia":
        return json.loads(json.dumps({"stage": "mia", "config": config.result_key(), "settings": asdict(settings)},
                                     sort_keys=True, default=list))
    if kind == "attack":
        # an attack stage trains max(attack rounds) + 1 rounds whatever --rounds says
        config = config.updated(rounds=max(settings.rounds) + 1)
        return json.loads(json.dumps({"stage": "attack", "attack": settings.attack, "config": config.result_key(),
                                      "settings": asdict(settings)}, sort_keys=True))
    return {"stage": kind, "config": config.result_key()}


def plan(base: RunConfig, methods: list[str], attack_names: list[str], settings: ReportSettings,
         out: Path, mia=None) -> list[Stage]:
    stages = []
    for m in methods:
        cfg = method_config(base, m, base.federation.seed)
        stages.append(Stage(m, "train", None, cfg, stage_identity("train", cfg), out / m / "train"))
        stages.append(Stage(m, "audit", None, cfg, stage_identity("audit", cfg), out / m / "audit"))
        for a in settings.keys(attack_names):
            stages.append(Stage(m, f"attack-{a}", a, cfg, stage_identity("attack", cfg, settings.for_attack(a)),
                                out / m / f"attack-{a}"))
        if mia is not None:
            stages.append(Stage(m, "mia", None, cfg, stage_identity("mia", cfg, mia), out / m / "mia", mia))
    return stages


def read_done(path: Path) -> dict | None:
    try:
        done = io.read_json(path / DONE)
    except (OSError, ValueError):
        return None
    return done if isinstance(done, dict) and "identity" in done else None


def _stage_files_complete(kind: str, path: Path, done: dict) -> bool:
    if done.get("status") != "done":
        return True
    need = {"train": ("summary.json", "metrics.csv"), "audit": ("summary.json", "findings.json"),
            "attack": ("summary.json", "attack.csv"), "mia": ("summary.json", "mia.csv")}[kind]
    return all((path / n).is_file() for n in need)


def stage_complete(stage: Stage, path: Path | None = None) -> bool:
    path = path or stage.path
    done = read_done(path)
    return done is not None and done["identity"] == stage.identity and _stage_files_complete(stage.kind, path, done)


# ----------------------------------------------------------------------------------------------
# reuse of earlier runs
# ----------------------------------------------------------------------------------------------
def check_reuse_dirs(dirs: Iterable[str | Path]) -> list[Path]:
    out = []
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            raise UserError(f"--reuse {d}: not a directory")
        try:
            next(iter(os.scandir(p)), None)
        except OSError as exc:
            raise UserError(f"--reuse {d}: cannot read it ({exc.strerror or exc})") from None
        out.append(p)
    return out


def index_reuse(dirs: list[Path], max_depth: int = 4) -> tuple[list[Path], list[Path]]:
    """(folders holding a done.json, folders that look like `fedsec train` runs) below ``dirs``."""
    done_dirs, train_dirs = [], []
    for root in dirs:
        base_depth = len(root.resolve().parts)
        for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _e: None):
            here = Path(dirpath)
            if len(here.resolve().parts) - base_depth >= max_depth:
                dirnames[:] = []
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            if DONE in filenames:
                done_dirs.append(here)
            elif "config.json" in filenames and "summary.json" in filenames:
                train_dirs.append(here)
    return done_dirs, train_dirs


def find_reusable(stage: Stage, done_dirs: list[Path], train_dirs: list[Path]) -> Path | None:
    for d in done_dirs:
        if d.resolve() != stage.path.resolve() and stage_complete(stage, d):
            return d
    if stage.kind == "train":
        for d in train_dirs:
            if run_status(d, stage.config) == "done":
                return d
    return None


def _replace_dir(tmp: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def copy_stage(source: Path, stage: Stage) -> None:
    """Copy ``source`` into the stage folder: into a hidden sibling first, renamed when complete."""
    tmp = stage.path.parent / f".{stage.path.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.tmp", ".*", DONE))
    done = read_done(source) or {"status": "done", "seconds": None}
    done = {**done, "identity": stage.identity, "reused_from": str(source.resolve())}
    io.write_json(tmp / DONE, done)  # last: the copy is complete
    _replace_dir(tmp, stage.path)


# ----------------------------------------------------------------------------------------------
# running stages
# ----------------------------------------------------------------------------------------------
def _finish(stage: Stage, status: str, seconds: float, reason: str | None = None) -> None:
    io.write_json(stage.path / DONE, {"identity": stage.identity, "status": status, "reason": reason,
                                      "seconds": round(seconds, 2), **provenance(),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})


def run_stage(stage: Stage, settings: ReportSettings, trainings: TrainingCache | None = None) -> tuple[str, str | None]:
    """Run one stage into its folder; returns (status, reason). ``done.json`` is written last.
    ``trainings`` lets consecutive attack stages with the same training share one federation."""
    start = time.perf_counter()
    path = stage.path
    reason = None
    if stage.kind == "train":
        status = run_status(path, stage.config)
        if status == "other" or (status == "new" and path.exists()):
            shutil.rmtree(path)
        if status != "done" and (trainings is None or status == "partial"):
            runner.train(stage.config, path, resume=status == "partial")
        elif status != "done":
            _train_recorded_stage(stage, trainings)
    else:
        if path.exists():
            shutil.rmtree(path)  # an incomplete stage is redone from scratch
        if stage.kind == "audit":
            kept = trainings.get(training_key(stage.config)) if trainings is not None else None
            run_audit(stage.config, path, evidence=False, progress=False, recorded=None if kept is None else kept[1])
        elif stage.kind == "mia":
            from .mia import run_mia

            run_mia(stage.config, stage.mia, path, progress=False, echo=lambda text: None)
        else:
            reason = _attack_stage(stage, settings.for_attack(stage.attack), trainings)
    if reason is not None:
        path.mkdir(parents=True, exist_ok=True)
        _finish(stage, "not_applicable", time.perf_counter() - start, reason.strip().rstrip("."))
        return "not_applicable", reason.strip().rstrip(".")
    _finish(stage, "done", time.perf_counter() - start)
    return "done", None


def _train_recorded_stage(stage: Stage, trainings: TrainingCache) -> None:
    """The train stage with the channel recording every round: the federation is kept in
    ``trainings`` for the method's audit and real-training attack stages (same ``training_key``)."""
    start = time.perf_counter()
    prep = runner.prepare(stage.config)
    fed, run, _ = recording_federation(prep)
    try:
        runner.train_federation(fed, prep, stage.path)
    except BaseException:
        fed.close()
        raise
    trainings.put(training_key(stage.config), (fed, run, round(time.perf_counter() - start, 2)))


def _attack_stage(stage: Stage, settings: AttackSettings, trainings: TrainingCache | None = None) -> str | None:
    """Run an attack stage; the reason it does not apply (known before training), or None."""
    try:
        check_applicable(settings.spec, runner.prepare(stage.config))
        summary = run_attack(stage.config, settings, out=stage.path, progress=False, trainings=trainings)
    except UserError as exc:
        return str(exc)
    scored = summary.get("images_scored", 0) if settings.spec.rebuilds_images else len(summary.get("label_scores") or [])
    if scored:
        return None
    notes = summary.get("notes") or ["nothing could be scored"]
    return notes[0].split(": ", 1)[-1] if notes[0].startswith("round ") else notes[0]


# ----------------------------------------------------------------------------------------------
# assembling the tables
# ----------------------------------------------------------------------------------------------
def _read_json(path: Path, default=None):
    try:
        return io.read_json(path)
    except (OSError, ValueError):
        return default


def _measured(code: str, measured: dict[str, dict]) -> tuple[str, str | None]:
    """This report's measurement for an audit finding, and the severity it implies (None: keep).
    ``measured`` maps attack names to their summaries."""
    def psnr_evidence(kind: str) -> tuple[str, str | None]:
        for name in attacks.names(kind):
            s = measured.get(name) or {}
            gap = psnr_gap(s)
            if gap is not None:
                verdict = forward_check_verdict(s.get("mis_specified_targets"), s.get("not_converged_targets"),
                                                len(s.get("per_target") or []))
                text = (f"{name}: mean PSNR {s['mean_psnr']:.1f} dB{interval_text(*(s.get('mean_psnr_ci') or (None, None)), digits=1)} "
                        f"vs prior {s['mean_prior_psnr']:.1f} dB ({gap:+.1f} dB), max {s['max_psnr']:.1f} dB"
                        + (f" — {verdict}" if verdict else ""))
                return text, ("low" if at_chance(s) else None)
        return "", None

    if code == "PROTOTYPES_DISCLOSED":
        return psnr_evidence("image")
    if code == "MODEL_DISCLOSED":
        return psnr_evidence("gradient")
    if code in ("LABEL_DISTRIBUTION_DISCLOSED", "LABELS_INFERABLE_FROM_UPDATE"):
        for name in attacks.names("labels"):
            acc = (measured.get(name) or {}).get("class_presence_accuracy")
            if acc is not None:
                return (f"{name}: class-presence accuracy {acc:.2f}",
                        "low" if code == "LABELS_INFERABLE_FROM_UPDATE" and acc < 0.8 else None)
    return "", None


def _brief_evidence(evidence) -> str:
    if isinstance(evidence, dict):  # drop what the audit left unmeasured (its evidence attacks are off)
        evidence = {k: v for k, v in evidence.items() if v is not None}
    if not evidence:
        return ""
    text = json.dumps(evidence, sort_keys=True, default=str)
    return text if len(text) <= 400 else text[:397] + "..."


ATTACK_COLUMNS = {"mean_psnr": "mean_psnr", "median_psnr": "median_psnr", "max_psnr": "max_psnr",
                  "prior_psnr": "mean_prior_psnr", "ssim": "mean_ssim", "label_accuracy": "label_accuracy",
                  "class_presence_accuracy": "class_presence_accuracy", "images": "images_scored",
                  "mis_specified": "mis_specified", "not_converged_targets": "not_converged_targets",
                  "n_targets": "n_targets", "n_images": "n_images", "success_rate": "success_rate"}


def _attack_cells(stage: Stage, out: Path) -> tuple[dict, dict | None, pd.DataFrame | None, dict | None]:
    """(summary-row cells, measured summary, attack.csv, reconstruction grid) of one attack stage."""
    a = stage.attack
    done = read_done(stage.path) or {}
    status = done.get("status")
    s = _read_json(stage.path / "summary.json", {}) if status == "done" else {}
    row = {f"{a}_status": {"done": "done", "not_applicable": f"not applicable: {done.get('reason')}"}.get(
        status, f"unavailable: {done.get('reason') or 'not run'}")}
    row.update({f"{a}_{col}": s.get(key) for col, key in ATTACK_COLUMNS.items()})
    for key in ("mean_psnr_ci", "success_rate_ci"):  # intervals as two columns
        low, high = s.get(key) or (None, None)
        row[f"{a}_{key}_low"], row[f"{a}_{key}_high"] = low, high
    if status != "done":
        return row, None, None, None
    try:
        frame = pd.read_csv(stage.path / "attack.csv").assign(attack=a)  # the cell: ig, or ig@real
    except (OSError, ValueError, pd.errors.EmptyDataError):
        frame = None
    png = stage.path / "reconstructions.png"
    grid = {"png": png.read_bytes(), "path": png.relative_to(out).as_posix()} \
        if attacks.get(attack_of(a)).rebuilds_images and png.is_file() else None
    return row, s, frame, grid


def _finding_rows(method: str, findings: list[dict], measured: dict[str, dict]) -> list[dict]:
    rows = []
    for f in findings:
        text, regraded = _measured(str(f.get("code", "")), measured)
        rows.append({"method": method, "severity": regraded or str(f.get("severity", "info")),
                     "audit_severity": f.get("severity"), "code": f.get("code", ""), "finding": f.get("finding", ""),
                     "measured": text, "evidence": _brief_evidence(f.get("evidence"))})
    return rows


def _method_row(method: str, by: dict, attack_names: list[str], out: Path, collected: dict) -> dict:
    """One method's summary row; its results, findings and grids go into ``collected``."""
    train = _read_json(by[(method, "train")].path / "summary.json", {})
    audit = _read_json(by[(method, "audit")].path / "summary.json", {})
    row = {"method": method, "accuracy_mean": train.get("mean_accuracy"), "accuracy_std": train.get("std_accuracy"),
           "upload_mb_per_round": audit.get("upload_mb_per_round"),
           "upload_kib_per_client_round": audit.get("upload_kib_per_client_round")}
    measured: dict[str, dict] = {}
    for a in attack_names:
        cells, summary, frame, grid = _attack_cells(by[(method, f"attack-{a}")], out)
        row.update(cells)
        if summary is not None:
            measured[a] = summary
            measured.setdefault(attack_of(a), summary)  # the audit's findings name attacks, not cells
        if frame is not None:
            collected["results"].append(frame)
        if grid is not None:
            collected["grids"][(method, a)] = grid
    findings = _finding_rows(method, _read_json(by[(method, "audit")].path / "findings.json", []) or [], measured)
    collected["findings"] += findings
    for sev in SEVERITIES:
        row[f"findings_{sev}"] = sum(f["severity"] == sev for f in findings)
    cfg = _read_json(by[(method, "train")].path / "config.json", {})
    collected["details"][method] = {
        "hyperparameters": cfg.get("method_hyperparameters", {}),
        "targets": {a: measured[a].get("targets") for a in measured},
        "versions": [(read_done(st.path) or {}).get("versions") for st in by.values() if st.method == method]}
    return row


def assemble(stages: list[Stage], methods: list[str], attack_names: list[str], out: Path):
    """(summary frame, results frame, findings frame, grids, per-method details) from the stage folders."""
    by = {(s.method, s.name): s for s in stages}
    collected = {"results": [], "findings": [], "grids": {}, "details": {}}
    summary = pd.DataFrame([_method_row(m, by, attack_names, out, collected) for m in methods])
    collected["details"]["mia"] = [s for m in methods if (m, "mia") in by
                                   for s in [_read_json(by[(m, "mia")].path / "summary.json", None)] if s]
    frames = [f for f in collected["results"] if len(f)]
    results = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RESULT_COLUMNS)
    results = results.reindex(columns=RESULT_COLUMNS + [c for c in results.columns if c not in RESULT_COLUMNS])
    findings = pd.DataFrame(collected["findings"], columns=["method", "severity", "audit_severity", "code", "finding",
                                                            "measured", "evidence"])
    if len(findings):
        order = {**{m: i for i, m in enumerate(methods)}, **{s: i for i, s in enumerate(SEVERITIES)}}
        findings = findings.sort_values(["method", "severity"], key=lambda c: c.map(order),
                                        kind="stable").reset_index(drop=True)
    return summary, results, findings, collected["grids"], collected["details"]


def method_comparisons(summary: pd.DataFrame, results: pd.DataFrame, methods: list[str],
                       attack_names: list[str]) -> list[str]:
    """One sentence per image attack (cell) and pair of methods, over all attacked rounds and, with
    several, per round: which leaks more, paired over the same images
    (``attacks.metrics.paired_difference``), or that the intervals cannot tell them apart; never a
    comparison with a mis-specified attack, nor with one that stopped short of the truth below the
    prior (in the rounds compared)."""
    from attacks.metrics import paired_difference

    sentences = []
    rows = summary.set_index("method")
    rounds = sorted(int(r) for r in results["round"].dropna().unique()) if len(results) else []
    for a in [a for a in attack_names if attacks.get(attack_of(a)).rebuilds_images]:
        done = [m for m in methods if rows.loc[m].get(f"{a}_status") == "done"]
        for i, m1 in enumerate(done):
            for m2 in done[i + 1:]:
                for rnd in [None] + (rounds if len(rounds) > 1 else []):
                    sentence = _paired_sentence(results, a, m1, m2, rnd, paired_difference)
                    if sentence:
                        sentences.append(sentence)
    return sentences


def _paired_sentence(results: pd.DataFrame, a: str, m1: str, m2: str, rnd: int | None, paired_difference) -> str | None:
    def pick(m):
        sel = (results["method"] == m) & (results["attack"] == a)
        if rnd is not None:
            sel &= results["round"] == rnd
        return results[sel].to_dict("records")

    where = a if rnd is None else f"{a}, round {rnd}"
    picked = {m: pick(m) for m in (m1, m2)}
    wrong = [m for m, rs in picked.items() if any(is_true(r.get("mis_specified")) for r in rs)]
    if wrong:
        return f"{where}: {m1} vs {m2}: not comparable: the attack on {', '.join(wrong)} was mis-specified"
    short = [m for m, rs in picked.items() if _stopped_short(rs)]
    if short:
        return (f"{where}: {m1} vs {m2}: not comparable: the attack on {', '.join(short)} stopped short of the truth "
                f"below the prior (a lower bound)")
    d = paired_difference(picked[m1], picked[m2])
    if not d["n_pairs"]:
        return None
    verdict = {"A leaks more": f"{m1} leaks more", "B leaks more": f"{m2} leaks more"}.get(d["verdict"], d["verdict"])
    interval = "" if d["ci"] is None else f" [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]"
    return (f"{where}: {m1} vs {m2}: {verdict} (PSNR above the prior, {m1} minus {m2}: "
            f"{d['mean_difference']:+.1f} dB{interval}, {d['n_pairs']} images over {d['n_targets']} targets)")


def _stopped_short(rows: list[dict]) -> bool:
    """``reports.formatting.is_lower_bound`` for a set of per-image rows."""
    if not rows:
        return False
    scores = summarize_scores(rows)
    return is_lower_bound(scores["mean_psnr"], scores["mean_prior_psnr"],
                          any(is_true(r.get("not_converged")) for r in rows))


def leakage_by_round(results: pd.DataFrame, methods: list[str], cells: list[str], seed: int = 0) -> pd.DataFrame:
    """One row per method, image cell and attacked round: images, targets, mean PSNR with its 95 %
    interval, the prior, the share recovered with its interval, and the forward-model check's counts
    (targets mis-specified, targets where the optimiser stopped short of the truth)."""
    from attacks.metrics import leakage_statistics

    columns = ["method", "attack", "round", "n_images", "n_targets", "mean_psnr", "mean_psnr_ci_low",
               "mean_psnr_ci_high", "prior_psnr", "success_rate", "success_rate_ci_low", "success_rate_ci_high",
               "mis_specified_targets", "not_converged_targets"]
    out = []
    image_cells = [a for a in cells if attacks.get(attack_of(a)).rebuilds_images]
    if not len(results) or "psnr" not in results.columns:
        return pd.DataFrame(columns=columns)
    for m in methods:
        for a in image_cells:
            sel = results[(results["method"] == m) & (results["attack"] == a)]
            for rnd, group in sel.groupby("round", sort=True):
                records = group.to_dict("records")
                stats = leakage_statistics(records, seed=seed)
                targets = group.drop_duplicates(["round", "client"])
                flag = lambda c: int(targets[c].map(is_true).sum()) if c in targets else 0  # noqa: E731
                out.append({"method": m, "attack": a, "round": int(rnd), "n_images": stats["n_images"],
                            "n_targets": stats["n_targets"], "mean_psnr": float(group["psnr"].clip(upper=PSNR_CAP_DB).mean()),
                            **dict(zip(("mean_psnr_ci_low", "mean_psnr_ci_high"), stats["mean_psnr_ci"] or (None, None))),
                            "prior_psnr": float(group["prior_psnr"].mean()), "success_rate": stats["success_rate"],
                            "success_rate_ci_low": stats["success_rate_ci"][0],
                            "success_rate_ci_high": stats["success_rate_ci"][1],
                            "mis_specified_targets": flag("mis_specified"), "not_converged_targets": flag("not_converged")})
    return pd.DataFrame(out, columns=columns)


def psnr_definition() -> str:
    import attacks.metrics

    doc = (attacks.metrics.__doc__ or "").strip()
    return doc or "PSNR = 10·log10(1 / MSE) on images in [0, 1]."


# ----------------------------------------------------------------------------------------------
# the whole report
# ----------------------------------------------------------------------------------------------
def validate(base: RunConfig, methods: list[str], attack_names: list[str], settings: ReportSettings, out: Path,
             reuse: list[Path], mia=None) -> list[Stage]:
    """Every check that can fail on user input, before anything is written."""
    if not methods:
        raise UserError("--methods needs at least one method")
    parse_methods(",".join(methods))
    parse_attacks(attack_names)
    unused = unused_hyperparameters(base, methods)
    if unused:
        raise UserError(f"no reported method takes hyperparameter {', '.join(unused)}")
    if settings.targets < 1:
        raise UserError(f"--targets must be at least 1, got {settings.targets}")
    if (settings.restarts is not None and settings.restarts < 1) or settings.images < 1:
        raise UserError("--restarts and --images must be at least 1")
    settings.rounds = tuple(parse_rounds(settings.rounds))
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    stages = plan(base, methods, attack_names, settings, out, mia)
    for st in stages:
        runner.build_method(st.config)
        st.config.federation.validate(st.config.data.clients)
        done = read_done(st.path)
        if done is not None and done["identity"] != st.identity:
            raise UserError(f"{st.path} holds a {st.name} stage with a different configuration; "
                            f"use another --out (and --reuse {out} to keep what still matches) or remove that folder")
    runner.prepare(stages[0].config)  # the data set loads (or fails) now
    return stages


def build_report(base: RunConfig, methods: list[str], out: str | Path, attacks: Iterable[str] = DEFAULT_ATTACKS,
                 settings: ReportSettings | None = None, reuse: Iterable[str | Path] = (), progress: bool = True,
                 command: str | None = None, log: Callable[[str], None] | None = None, mia=None) -> dict:
    """Run (or resume, or reuse) every stage, then write the report files; returns their paths and the
    summary. ``mia`` (a ``fedsec.mia.MiaSettings``) adds a membership-inference stage per method."""
    settings = settings or ReportSettings()
    out = Path(out)
    attack_names = parse_attacks(list(attacks))
    methods = list(dict.fromkeys(methods))
    reuse_dirs = check_reuse_dirs(reuse)
    if mia is not None:
        mia.validate()
    with shared_datasets(), _one_ray(base):  # every stage reads the same data set tensors (and one Ray)
        stages = validate(base, methods, attack_names, settings, out, reuse_dirs, mia)
        records, failed, seconds = _run_stages(stages, settings, reuse_dirs, progress, log)
    keys = settings.keys(attack_names)
    return {**_write_report(base, methods, keys, settings, out, stages, records, failed, seconds, command),
            "cells": keys}


@contextlib.contextmanager
def _one_ray(base: RunConfig):
    """With ``--backend ray`` (local), one Ray for the whole report: every stage's backend finds it
    running and leaves it so (instead of each federation starting and stopping its own)."""
    execution = base.execution
    if execution.backend != "ray" or execution.ray_address:
        yield
        return
    from fedecouple.backends import import_ray, start_local_ray

    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        start_local_ray()
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _run_stages(stages: list[Stage], settings: ReportSettings, reuse_dirs: list[Path], progress: bool,
                log: Callable[[str], None] | None) -> tuple[list[dict], dict, float]:
    """Each stage: done earlier, copied from a reuse folder, or computed (a failure is recorded and
    the next stage runs). Returns (records, failures, seconds)."""
    from tqdm import tqdm

    bar = tqdm(total=len(stages), desc="report", unit="stage", disable=None if progress else True, file=sys.stderr,
               leave=False)  # the bar only on a terminal; the per-stage lines always

    def say(text: str) -> None:
        if log is not None:
            log(text)
        elif progress:
            tqdm.write(text, file=sys.stderr)

    done_dirs, train_dirs = index_reuse(reuse_dirs) if reuse_dirs else ([], [])
    todo = [st for st in stages if not stage_complete(st) and find_reusable(st, done_dirs, train_dirs) is None]
    if todo:
        say(f"{len(todo)} of {len(stages)} stages to compute: {estimate.describe(estimate_seconds(todo, settings))} "
            f"on a 2-core machine like the one the rates were measured on (fedsec.estimate)")
    records: list[dict] = []
    failed: dict[tuple[str, str], str] = {}
    trainings = TrainingCache()
    t0 = time.perf_counter()
    try:
        for i, st in enumerate(stages, 1):
            if i > 1 and st.method != stages[i - 2].method:
                trainings.close()  # a method's trainings serve only its own stages
            bar.set_postfix_str(f"{st.method} {st.name}")
            label = f"[{i:>{len(str(len(stages)))}}/{len(stages)}] {st.method} {st.name}"
            records.append(_one_stage(st, settings, label, done_dirs, train_dirs, failed, say, trainings))
            bar.update(1)
    finally:
        trainings.close()
        bar.close()
    return records, failed, time.perf_counter() - t0


def estimate_seconds(stages: list[Stage], settings: ReportSettings) -> float:
    """The wall time ``stages`` (those still to compute) should take (``fedsec.estimate``); a training
    shared between stages counts once."""
    images = estimate.training_images(runner.prepare(stages[0].config))
    trained: set[str] = set()
    total = 0.0
    for st in stages:
        cfg = st.config
        a = settings.for_attack(st.attack).resolved(cfg.federation.seed) if st.kind == "attack" else None
        if a is not None:
            try:
                check_applicable(a.spec, runner.prepare(cfg))
            except UserError:  # found before anything trains: costs nothing
                continue
        key = training_key(cfg) if a is None else training_key(cfg.updated(rounds=a.rounds_to_train), a)
        rounds = 0 if key in trained else (cfg.federation.rounds if a is None else a.rounds_to_train)
        trained.add(key)
        work = (estimate.StageWork(st.method, cfg.data.clients, rounds, images) if a is None
                else estimate.attack_work(st.method, cfg.data.clients, images, a, rounds))
        total += estimate.seconds(work)
    return total


def _one_stage(st: Stage, settings: ReportSettings, label: str, done_dirs, train_dirs, failed: dict, say,
               trainings: TrainingCache | None = None) -> dict:
    for stale in st.path.parent.glob(f".{st.path.name}.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    source = "computed"
    if stage_complete(st):
        source = "done earlier"
    elif (found := find_reusable(st, done_dirs, train_dirs)) is not None:
        copy_stage(found, st)
        source = f"reused {found}"
    else:
        say(f"{label}: running ...")
        try:
            run_stage(st, settings, trainings)
        except Exception as exc:  # noqa: BLE001 - recorded, reported, retried by the next run
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            failed[(st.method, st.name)] = reason
            say(f"{label}: FAILED ({reason}); rerun with the same --out to retry it")
            return {"method": st.method, "stage": st.name, "status": "failed", "seconds": None, "source": "-"}
    done = read_done(st.path) or {}
    status, reason, secs = done.get("status", "?"), done.get("reason"), done.get("seconds")
    say(f"{label}: {status.replace('_', ' ')}" + (f" ({reason})" if reason else "")
        + (f" in {secs:.1f} s" if source == "computed" and secs is not None else f" [{source}]"))
    return {"method": st.method, "stage": st.name, "status": status.replace("_", " "), "seconds": secs,
            "source": source if not source.startswith("reused") else "reused"}


def _report_meta(base: RunConfig, methods: list[str], attack_names: list[str], settings: ReportSettings,
                 details: dict, records: list[dict], notes: list[str], command: str | None,
                 mia_summaries: list[dict] = (), comparisons: list[str] = ()) -> dict:
    return {
        "title": f"Privacy comparison: {', '.join(methods)} on {base.data.dataset}",
        "command": command, "methods": methods, "attacks": attack_names,
        "image_attacks": [a for a in attack_names if attacks.get(attack_of(a)).rebuilds_images],
        "label_attacks": [a for a in attack_names if not attacks.get(attack_of(a)).rebuilds_images],
        "psnr_cap_db": PSNR_CAP_DB, "leak_gap_db": LEAK_GAP_DB, "success_rule": SUCCESS_RULE,
        "config": {k: v for k, v in base.to_dict().items() if k != "method"},
        "method_hyperparameters": {m: d["hyperparameters"] for m, d in details.items()},
        "seeds": {"seed": base.federation.seed,
                  "seed is used for": "the partition, the initial model, local training, the attacks' starting "
                                      "points and the choice of attacked clients (the same for every method)",
                  "attacked clients": {f"{m} / {a}": "; ".join(f"round {r}: client {', '.join(map(str, cs))}"
                                                                for r, cs in (t or {}).items())
                                       for m, d in details.items() for a, t in d["targets"].items()}},
        "attack_settings": {a: asdict(settings.for_attack(a)) for a in attack_names},
        "mia": list(mia_summaries),
        "comparisons": comparisons,
        **provenance(), "psnr_definition": psnr_definition(), "stages": records, "notes": notes,
        "findings_note": ("Findings come from `fedsec audit` (without its own evidence attacks); where this report "
                          "measured the matching attack, its numbers are shown and the severity follows the audit's "
                          f"rule (leakage within {LEAK_GAP_DB:.0f} dB of the prior, or class-presence accuracy "
                          "below 0.8, is low)."),
    }


def _write_report(base: RunConfig, methods: list[str], attack_names: list[str], settings: ReportSettings, out: Path,
                  stages: list[Stage], records: list[dict], failed: dict, seconds: float, command: str | None) -> dict:
    """Assemble the tables from the stage folders and write every report file."""
    from reports.comparison import render

    summary, results, findings, grids, details = assemble(stages, methods, attack_names, out)
    mia_summaries = details.pop("mia", [])
    for (m, name), reason in failed.items():
        if name.startswith("attack-"):
            summary.loc[summary["method"] == m, f"{name[len('attack-'):]}_status"] = f"failed: {reason}"
    stage_versions = {json.dumps(v, sort_keys=True) for d in details.values() for v in d["versions"] if v}
    notes = [f"{len(stages)} stages in {seconds:.0f} s this run "
             f"({sum(r['source'] == 'computed' for r in records)} computed, "
             f"{sum(r['source'] == 'done earlier' for r in records)} done earlier, "
             f"{sum(r['source'] == 'reused' for r in records)} reused)."]
    notes += [f"FAILED: {m} {name}: {reason} (rerun with the same --out to retry)" for (m, name), reason in failed.items()]
    if len(stage_versions) > 1:
        notes.append("Some stages were computed with other package versions; each stage's done.json records its own.")
    by_round = leakage_by_round(results, methods, attack_names, seed=base.federation.seed)
    meta = _report_meta(base, methods, attack_names, settings, details, records, notes, command, mia_summaries,
                        method_comparisons(summary, results, methods, attack_names))
    meta["by_round"] = by_round.to_dict("records") if by_round["round"].nunique() > 1 else []
    paths = {}
    for name, content in render(summary, results, findings, grids, meta).items():
        (io.write_bytes if isinstance(content, bytes) else io.write_text)(out / name, content)
        paths[name] = out / name
    for name, frame in (("results.csv", results), ("summary.csv", summary), ("findings.csv", findings),
                        ("by_round.csv", by_round)):
        io.write_csv(out / name, frame)
        paths[name] = out / name
    return {"paths": paths, "summary": summary, "stages": records, "failed": failed}


def headline_markdown(summary: pd.DataFrame, attack_names: list[str], methods: list[str]) -> str:
    """The headline table alone (for the terminal and BENCHMARKS.md)."""
    from reports.comparison import headline_rows, md_table

    return md_table(*headline_rows(summary, {
        "attacks": attack_names, "methods": methods,
        "image_attacks": [a for a in attack_names if attacks.get(attack_of(a)).rebuilds_images],
        "label_attacks": [a for a in attack_names if not attacks.get(attack_of(a)).rebuilds_images]}))


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return "fedsec " + " ".join(shlex.quote(a) for a in argv)


__all__ = ["DEFAULT_ATTACKS", "DEFAULT_METHODS", "ReportSettings", "build_report", "headline_markdown",
           "parse_attacks", "parse_iterations", "parse_methods"]
