"""Library behind ``fedsec report``: train, audit and attack several methods on the same partition
and seeds, then render one comparison (``reports.comparison``).

Stages, for every method (each in ``out/<method>/<stage>/``):

* ``train``          ``fedsec.runner.train`` → accuracy (config.json, metrics.csv, summary.json, ...);
* ``audit``          ``fedsec.audit.run_audit(evidence=False)`` → upload sizes and findings; the
                     evidence numbers come from the attack stages below instead (no attack runs twice);
* ``attack-<name>``  ``fedsec.attack.run_attack`` for each requested attack → attack.csv,
                     summary.json, reconstructions.png. An attack that does not apply to a method
                     (``dlg`` on FedProto, ``proto`` on a method that uploads no prototypes, ...)
                     is recorded as ``not applicable: <reason>``.

Every method uses the same ``RunConfig`` except ``method`` and the hyperparameters that method
takes, so all see the same partition, initial model and seeds.

Resuming: a stage is complete when its ``done.json`` exists — written last, atomically, holding the
stage's identity (its config and settings; ``threads``, ``data_dir`` and ``download`` do not count).
Rerunning with the same ``out`` skips complete stages, resumes an interrupted ``train`` from its
checkpoint, and redoes any other incomplete stage from scratch. A stage folder whose ``done.json``
holds a *different* identity is an error (use another ``--out``), never overwritten. ``reuse``
folders (earlier report folders, or any folder below which they lie, or ``fedsec train`` run
folders) are searched for complete stages with the same identity, which are copied instead of
recomputed.

Top-level outputs in ``out`` (written atomically after the last stage): ``report.md``,
``report.html``, ``psnr_by_method.png``, ``accuracy_vs_leakage.png``, ``results.csv`` (every
attack.csv concatenated: one row per method × attack × round × client × image; ``labels`` rows are
per class, with ``class`` set and ``image`` empty) and ``summary.csv`` (one row per method, the
headline columns).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd

from fedecouple.errors import UserError
from fedecouple.methods import METHODS

from . import io, runner
from .attack import IMAGE_COLUMNS, LABEL_COLUMNS, parse_rounds, run_attack
from .audit import LEAK_GAP_DB, SEVERITIES, at_chance, psnr_gap, run_audit
from .compare import _shared_datasets, method_config, parse_list, parse_methods, run_status
from .runner import RunConfig
from .versions import package_versions

DEFAULT_METHODS = ("fedecouple", "fedper", "fedpac", "fedproto")
ATTACK_CHOICES = ("dlg", "idlg", "ig", "proto", "labels")
DEFAULT_ATTACKS = ("dlg", "ig", "proto", "labels")
GRADIENT = ("dlg", "idlg", "ig")
IMAGE_ATTACKS = ("dlg", "idlg", "ig", "proto")
# The budgets `fedsec attack` uses by default (dlg/idlg: 300 L-BFGS steps; ig: 1000 Adam steps;
# proto, labels: 300), pinned here so that a report's stages stay comparable (and reusable) when
# those defaults move. Training dominates the cost (train + audit + one round per attack stage):
# the four mission methods take about 6-7 CPU-minutes on mnist5k (BENCHMARKS.md, "Report (defaults)").
DEFAULT_ITERATIONS = {"dlg": 300, "idlg": 300, "ig": 1000, "proto": 300, "labels": 300}
DEFAULT_TARGETS = 2
DONE = "done.json"
RESULT_COLUMNS = list(dict.fromkeys(IMAGE_COLUMNS + LABEL_COLUMNS))


@dataclass
class AttackSettings:
    """How every attack stage is run (the same for all methods)."""

    rounds: tuple[int, ...] = (0,)
    targets: int = DEFAULT_TARGETS
    iterations: dict[str, int] = field(default_factory=dict)  # per attack; missing → DEFAULT_ITERATIONS
    restarts: int = 1
    images: int = 1  # images rebuilt per target when the victim trains normally (proto, labels)

    def for_attack(self, attack: str) -> dict:
        return {"attack_rounds": [int(r) for r in self.rounds], "targets": int(self.targets),
                "iterations": int(self.iterations.get(attack, DEFAULT_ITERATIONS[attack])),
                "restarts": int(self.restarts), "images": int(self.images),
                # the textbook setting for gradient attacks (one step on one image); the method's
                # real local training for proto and labels — as `fedsec attack` does by default
                "victim_batch": 1 if attack in GRADIENT else 0, "victim_steps": 1,
                # batching moves DLG's numbers slightly: stages from before it are not reused
                "batched": attack in GRADIENT}


@dataclass
class Stage:
    method: str
    name: str  # train | audit | attack-<attack>
    attack: str | None
    config: RunConfig
    identity: dict
    path: Path

    @property
    def kind(self) -> str:
        return "attack" if self.attack else self.name


def parse_attacks(text: str | Iterable[str]) -> list[str]:
    items = parse_list(text, "attacks") if isinstance(text, str) else list(dict.fromkeys(text))
    unknown = [a for a in items if a not in ATTACK_CHOICES]
    if unknown:
        raise UserError(f"unknown attack{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"choose from: {', '.join(ATTACK_CHOICES)}")
    if not items:
        raise UserError("--attacks needs at least one attack")
    return items


def parse_iterations(text: str | None) -> dict[str, int]:
    """``"300"`` (every attack) or ``"dlg=300,ig=1000"`` → {attack: iterations}."""
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
        names = [name] if name else list(ATTACK_CHOICES)
        for a in names:
            if a not in ATTACK_CHOICES:
                raise UserError(f"--iterations names unknown attack {a!r}; choose from: {', '.join(ATTACK_CHOICES)}")
            out[a] = n
    return out


def _normal(obj) -> dict:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


# settings that do not change a stage's result (where the data lives, how many threads or which
# execution backend computes it: backends give the same numbers for the same seed and threads)
IRRELEVANT = ("threads", "data_dir", "download", "backend", "ray_address")


def _comparable(config: dict) -> dict:
    return {k: v for k, v in _normal(config).items() if k not in IRRELEVANT}


def stage_identity(kind: str, config: RunConfig, attack: str | None = None,
                   settings: AttackSettings | None = None) -> dict:
    if kind == "train":
        return _normal({"stage": "train", "config": _comparable(config.to_dict())})
    if kind == "audit":
        return _normal({"stage": "audit", "evidence": False, "config": _comparable(config.to_dict())})
    spec = settings.for_attack(attack)
    # an attack stage trains max(attack rounds) + 1 rounds whatever --rounds says
    cfg = replace(config, rounds=max(spec["attack_rounds"]) + 1)
    return _normal({"stage": "attack", "attack": attack, "config": _comparable(cfg.to_dict()), **spec})


def plan(base: RunConfig, methods: list[str], attacks: list[str], settings: AttackSettings, out: Path) -> list[Stage]:
    stages = []
    for m in methods:
        cfg = method_config(base, m, base.seed)
        stages.append(Stage(m, "train", None, cfg, stage_identity("train", cfg), out / m / "train"))
        stages.append(Stage(m, "audit", None, cfg, stage_identity("audit", cfg), out / m / "audit"))
        for a in attacks:
            stages.append(Stage(m, f"attack-{a}", a, cfg, stage_identity("attack", cfg, a, settings),
                                out / m / f"attack-{a}"))
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
            "attack": ("summary.json", "attack.csv")}[kind]
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
def _uploaded_kinds(method: str, out: Path) -> set[str] | None:
    try:
        frame = pd.read_csv(out / method / "audit" / "audit.csv")
    except (OSError, ValueError):
        return None
    return set(frame["kind"].astype(str)) if "kind" in frame else None


def _precheck(stage: Stage, out: Path) -> str | None:
    """A reason why ``stage``'s attack cannot apply, known without training (from the audit)."""
    kinds = _uploaded_kinds(stage.method, out)
    if kinds is None:
        return None
    if stage.attack in GRADIENT and not kinds & {"extractor", "classifier"}:
        return f"{stage.method} uploads no model weights (only {', '.join(sorted(kinds)) or 'nothing'})"
    if stage.attack == "proto" and "prototype" not in kinds:
        return f"{stage.method} uploads no prototypes (it sends: {', '.join(sorted(kinds)) or 'nothing'})"
    if stage.attack == "labels" and not kinds & {"classifier", "class_counts", "statistic", "prototype"}:
        return (f"{stage.method}'s upload carries no label information: no class counts, label statistics, "
                f"prototypes or classifier update (it sends: {', '.join(sorted(kinds)) or 'nothing'})")
    return None


def _finish(stage: Stage, status: str, seconds: float, reason: str | None = None) -> None:
    io.write_json(stage.path / DONE, {"identity": stage.identity, "status": status, "reason": reason,
                                      "seconds": round(seconds, 2), "versions": package_versions(),
                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})


def run_stage(stage: Stage, out: Path) -> tuple[str, str | None]:
    """Run one stage into its folder; returns (status, reason). ``done.json`` is written last."""
    start = time.perf_counter()
    path = stage.path
    if stage.kind == "train":
        status = run_status(path, stage.config)
        if status == "other" or (status == "new" and path.exists()):
            shutil.rmtree(path)
        if status != "done":
            runner.train(stage.config, path, resume=status == "partial")
        _finish(stage, "done", time.perf_counter() - start)
        return "done", None
    if path.exists():
        shutil.rmtree(path)  # an incomplete stage is redone from scratch
    if stage.kind == "audit":
        run_audit(stage.config, path, evidence=False, progress=False)
        _finish(stage, "done", time.perf_counter() - start)
        return "done", None
    spec = stage.identity
    reason = _precheck(stage, out)
    if reason is None:
        try:
            from attacks.base import Budget

            summary = run_attack(stage.config, stage.attack, attack_rounds=spec["attack_rounds"],
                                 targets=spec["targets"],
                                 budget=Budget(iterations=spec["iterations"], restarts=spec["restarts"],
                                               batch=spec["images"]),
                                 victim_batch=spec["victim_batch"], victim_steps=spec["victim_steps"], out=path,
                                 progress=False, batched=spec["batched"])
        except UserError as exc:
            reason = str(exc)
        else:
            scored = summary.get("images_scored", 0) if stage.attack != "labels" else len(summary.get("label_scores") or [])
            if not scored:
                notes = summary.get("notes") or ["nothing could be scored"]
                reason = notes[0].split(": ", 1)[-1] if notes[0].startswith("round ") else notes[0]
    if reason is not None:
        reason = reason.strip().rstrip(".")
        path.mkdir(parents=True, exist_ok=True)
        _finish(stage, "not_applicable", time.perf_counter() - start, reason)
        return "not_applicable", reason
    _finish(stage, "done", time.perf_counter() - start)
    return "done", None


# ----------------------------------------------------------------------------------------------
# assembling the tables
# ----------------------------------------------------------------------------------------------
def _read_json(path: Path, default=None):
    try:
        return io.read_json(path)
    except (OSError, ValueError):
        return default


def _measured(code: str, attacks: dict[str, dict]) -> tuple[str, str | None]:
    """This report's measurement for an audit finding, and the severity it implies (None: keep)."""
    def psnr_evidence(names):
        for a in names:
            s = attacks.get(a) or {}
            gap = psnr_gap(s)
            if gap is not None:
                text = (f"{a}: mean PSNR {s['mean_psnr']:.1f} dB vs prior {s['mean_prior_psnr']:.1f} dB "
                        f"({gap:+.1f} dB), max {s['max_psnr']:.1f} dB")
                return text, ("low" if at_chance(s) else None)
        return "", None

    if code == "PROTOTYPES_DISCLOSED":
        return psnr_evidence(["proto"])
    if code == "MODEL_DISCLOSED":
        return psnr_evidence(["dlg", "idlg", "ig"])
    if code in ("LABEL_DISTRIBUTION_DISCLOSED", "LABELS_INFERABLE_FROM_UPDATE"):
        acc = (attacks.get("labels") or {}).get("label_accuracy")
        if acc is None:
            return "", None
        text = f"labels: label-inference accuracy {acc:.2f}"
        return text, ("low" if code == "LABELS_INFERABLE_FROM_UPDATE" and acc < 0.8 else None)
    return "", None


def _brief_evidence(evidence) -> str:
    if isinstance(evidence, dict):  # drop what the audit left unmeasured (its evidence attacks are off)
        evidence = {k: v for k, v in evidence.items() if v is not None}
    if not evidence:
        return ""
    text = json.dumps(evidence, sort_keys=True, default=str)
    return text if len(text) <= 400 else text[:397] + "..."


def assemble(stages: list[Stage], methods: list[str], attacks: list[str], out: Path):
    """(summary frame, results frame, findings frame, grids, per-method details) from the stage folders."""
    by = {(s.method, s.name): s for s in stages}
    summary_rows, result_frames, finding_rows, grids, details = [], [], [], {}, {}
    for m in methods:
        train = _read_json(by[(m, "train")].path / "summary.json", {})
        audit = _read_json(by[(m, "audit")].path / "summary.json", {})
        findings = _read_json(by[(m, "audit")].path / "findings.json", []) or []
        row = {"method": m, "accuracy_mean": train.get("mean_accuracy"), "accuracy_std": train.get("std_accuracy"),
               "upload_mb_per_round": audit.get("upload_mb_per_round"),
               "upload_kib_per_client_round": audit.get("upload_kib_per_client_round")}
        measured: dict[str, dict] = {}
        for a in attacks:
            st = by[(m, f"attack-{a}")]
            done = read_done(st.path) or {}
            status = done.get("status")
            s = _read_json(st.path / "summary.json", {}) if status == "done" else {}
            if status == "done":
                row[f"{a}_status"] = "done"
                measured[a] = s
            elif status == "not_applicable":
                row[f"{a}_status"] = f"not applicable: {done.get('reason')}"
            else:
                row[f"{a}_status"] = f"unavailable: {done.get('reason') or 'not run'}"
            row[f"{a}_mean_psnr"] = s.get("mean_psnr")
            row[f"{a}_median_psnr"] = s.get("median_psnr")
            row[f"{a}_max_psnr"] = s.get("max_psnr")
            row[f"{a}_prior_psnr"] = s.get("mean_prior_psnr")
            row[f"{a}_ssim"] = s.get("mean_ssim")
            row[f"{a}_label_accuracy"] = s.get("label_accuracy")
            row[f"{a}_images"] = s.get("images_scored")
            if status == "done":
                try:
                    result_frames.append(pd.read_csv(st.path / "attack.csv"))
                except (OSError, ValueError, pd.errors.EmptyDataError):
                    pass
                png = st.path / "reconstructions.png"
                if a in IMAGE_ATTACKS and png.is_file():
                    grids[(m, a)] = {"png": png.read_bytes(), "path": png.relative_to(out).as_posix()}
        row["label_inference_accuracy"] = (measured.get("labels") or {}).get("label_accuracy")
        counts = {s: 0 for s in SEVERITIES}
        for f in findings:
            text, regraded = _measured(str(f.get("code", "")), measured)
            severity = regraded or str(f.get("severity", "info"))
            counts[severity] = counts.get(severity, 0) + 1
            finding_rows.append({"method": m, "severity": severity, "audit_severity": f.get("severity"),
                                 "code": f.get("code", ""), "finding": f.get("finding", ""), "measured": text,
                                 "evidence": _brief_evidence(f.get("evidence"))})
        for s in SEVERITIES:
            row[f"findings_{s}"] = counts.get(s, 0)
        summary_rows.append(row)
        cfg = _read_json(by[(m, "train")].path / "config.json", {})
        details[m] = {"hyperparameters": cfg.get("method_hyperparameters", {}),
                      "targets": {a: measured[a].get("targets") for a in measured},
                      "versions": [(read_done(st.path) or {}).get("versions") for st in stages if st.method == m]}
    summary = pd.DataFrame(summary_rows)
    results = pd.concat([f for f in result_frames if len(f)], ignore_index=True) if any(len(f) for f in result_frames) \
        else pd.DataFrame(columns=RESULT_COLUMNS)
    results = results.reindex(columns=RESULT_COLUMNS + [c for c in results.columns if c not in RESULT_COLUMNS])
    findings = pd.DataFrame(finding_rows, columns=["method", "severity", "audit_severity", "code", "finding",
                                                   "measured", "evidence"])
    order = {s: i for i, s in enumerate(SEVERITIES)}
    if len(findings):
        findings = findings.sort_values(["method", "severity"], key=lambda c: c.map({m: i for i, m in enumerate(methods)})
                                        if c.name == "method" else c.map(order), kind="stable").reset_index(drop=True)
    return summary, results, findings, grids, details


def psnr_definition() -> str:
    import attacks.metrics

    doc = (attacks.metrics.__doc__ or "").strip()
    return doc or "PSNR = 10·log10(1 / MSE) on images in [0, 1]."


# ----------------------------------------------------------------------------------------------
# the whole report
# ----------------------------------------------------------------------------------------------
def validate(base: RunConfig, methods: list[str], attacks: list[str], settings: AttackSettings, out: Path,
             reuse: list[Path]) -> list[Stage]:
    """Every check that can fail on user input, before anything is written."""
    if not methods:
        raise UserError("--methods needs at least one method")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"unknown method {', '.join(unknown)}; choose from: {', '.join(METHODS)}")
    parse_attacks(attacks)
    used = {k for m in methods for k in getattr(METHODS[m], "__dataclass_fields__", {})}
    unused = sorted(set(base.hyperparameters) - used)
    if unused:
        raise UserError(f"no reported method takes hyperparameter {', '.join(unused)}")
    if settings.targets < 1:
        raise UserError(f"--targets must be at least 1, got {settings.targets}")
    if settings.restarts < 1 or settings.images < 1:
        raise UserError("--restarts and --images must be at least 1")
    settings.rounds = tuple(parse_rounds(settings.rounds))
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    stages = plan(base, methods, attacks, settings, out)
    for st in stages:
        runner.build_method(st.config)
        st.config.federation_config().validate(st.config.clients)
        done = read_done(st.path)
        if done is not None and done["identity"] != st.identity:
            raise UserError(f"{st.path} holds a {st.name} stage with a different configuration; "
                            f"use another --out (and --reuse {out} to keep what still matches) or remove that folder")
    runner.prepare(stages[0].config)  # the data set loads (or fails) now
    return stages


def build_report(base: RunConfig, methods: list[str], out: str | Path, attacks: Iterable[str] = DEFAULT_ATTACKS,
                 settings: AttackSettings | None = None, reuse: Iterable[str | Path] = (), progress: bool = True,
                 command: str | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Run (or resume, or reuse) every stage, then write the report files; returns their paths and the summary."""
    settings = settings or AttackSettings()
    out = Path(out)
    attacks = parse_attacks(list(attacks))
    methods = list(dict.fromkeys(methods))
    reuse_dirs = check_reuse_dirs(reuse)
    with _shared_datasets():  # every stage reads the same data set tensors
        stages = validate(base, methods, attacks, settings, out, reuse_dirs)
        return _run(base, methods, attacks, settings, out, reuse_dirs, stages, progress, command, log)


def _run(base, methods, attacks, settings, out, reuse_dirs, stages, progress, command, log) -> dict:
    from tqdm import tqdm


    bar = tqdm(total=len(stages), desc="report", unit="stage", disable=None if progress else True, file=sys.stderr,
               leave=False)  # the bar only on a terminal; the per-stage lines always

    def say(text: str) -> None:
        if log is not None:
            log(text)
        elif progress:
            tqdm.write(text, file=sys.stderr)

    done_dirs, train_dirs = index_reuse(reuse_dirs) if reuse_dirs else ([], [])
    records: list[dict] = []
    failed: dict[tuple[str, str], str] = {}
    t0 = time.perf_counter()
    width = len(str(len(stages)))
    try:
        for i, st in enumerate(stages, 1):
            label = f"[{i:>{width}}/{len(stages)}] {st.method} {st.name}"
            bar.set_postfix_str(f"{st.method} {st.name}")
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
                    run_stage(st, out)
                except Exception as exc:  # noqa: BLE001 - recorded, reported, retried by the next run
                    reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    failed[(st.method, st.name)] = reason
                    say(f"{label}: FAILED ({reason}); rerun with the same --out to retry it")
                    records.append({"method": st.method, "stage": st.name, "status": "failed", "seconds": None,
                                    "source": "-"})
                    bar.update(1)
                    continue
            done = read_done(st.path) or {}
            status = done.get("status", "?")
            reason = done.get("reason")
            secs = done.get("seconds")
            say(f"{label}: {status.replace('_', ' ')}" + (f" ({reason})" if reason else "")
                + (f" in {secs:.1f} s" if source == "computed" and secs is not None else f" [{source}]"))
            records.append({"method": st.method, "stage": st.name, "status": status.replace("_", " "),
                            "seconds": secs, "source": source if not source.startswith("reused") else "reused"})
            bar.update(1)
    finally:
        bar.close()
    summary, results, findings, grids, details = assemble(stages, methods, attacks, out)
    for (m, name), reason in failed.items():
        if name.startswith("attack-"):
            summary.loc[summary["method"] == m, f"{name[len('attack-'):]}_status"] = f"failed: {reason}"
    versions = package_versions()
    stage_versions = {json.dumps(v, sort_keys=True) for d in details.values() for v in d["versions"] if v}
    notes = [f"{len(stages)} stages in {time.perf_counter() - t0:.0f} s this run "
             f"({sum(r['source'] == 'computed' for r in records)} computed, "
             f"{sum(r['source'] == 'done earlier' for r in records)} done earlier, "
             f"{sum(r['source'] == 'reused' for r in records)} reused)."]
    notes += [f"FAILED: {m} {name}: {reason} (rerun with the same --out to retry)" for (m, name), reason in failed.items()]
    if len(stage_versions) > 1:
        notes.append("Some stages were computed with other package versions; each stage's done.json records its own.")
    meta = {
        "title": f"Privacy comparison: {', '.join(methods)} on {base.dataset}",
        "command": command, "methods": methods, "attacks": attacks,
        "config": {k: v for k, v in base.to_dict().items() if k != "method"},
        "method_hyperparameters": {m: d["hyperparameters"] for m, d in details.items()},
        "seeds": {"seed": base.seed,
                  "seed is used for": "the partition, the initial model, local training, the attacks' starting "
                                      "points and the choice of attacked clients (the same for every method)",
                  "attacked clients": {f"{m} / {a}": "; ".join(f"round {r}: client {', '.join(map(str, cs))}"
                                                                for r, cs in (t or {}).items())
                                       for m, d in details.items() for a, t in d["targets"].items()}},
        "attack_settings": {a: settings.for_attack(a) for a in attacks},
        "versions": versions, "psnr_definition": psnr_definition(), "stages": records, "notes": notes,
        "findings_note": ("Findings come from `fedsec audit` (without its own evidence attacks); where this report "
                          "measured the matching attack, its numbers are shown and the severity follows the audit's "
                          f"rule (leakage within {LEAK_GAP_DB:.0f} dB of the prior, or label-inference accuracy "
                          "below 0.8, is low)."),
    }
    from reports.comparison import render

    files = render(summary, results, findings, grids, meta)
    paths = {}
    for name, content in files.items():
        if isinstance(content, bytes):
            with io.atomic_path(out / name) as tmp:
                tmp.write_bytes(content)
        else:
            io.write_text(out / name, content)
        paths[name] = out / name
    io.write_csv(out / "results.csv", results)
    io.write_csv(out / "summary.csv", summary)
    io.write_csv(out / "findings.csv", findings)
    paths.update({n: out / n for n in ("results.csv", "summary.csv", "findings.csv")})
    return {"paths": paths, "summary": summary, "stages": records, "failed": failed}


def headline_markdown(summary: pd.DataFrame, attacks: list[str], methods: list[str]) -> str:
    """The headline table alone (for the terminal and BENCHMARKS.md)."""
    from reports.comparison import headline_rows, md_table

    return md_table(*headline_rows(summary, {"attacks": attacks, "methods": methods}))


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return "fedsec " + " ".join(shlex.quote(a) for a in argv)


__all__ = ["ATTACK_CHOICES", "AttackSettings", "DEFAULT_ATTACKS", "DEFAULT_ITERATIONS", "DEFAULT_METHODS",
           "build_report", "headline_markdown", "parse_attacks", "parse_iterations", "parse_methods"]
