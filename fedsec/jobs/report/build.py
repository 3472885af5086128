"""``fedsec report``'s entry: validate everything, run (or resume, or reuse) the stages, then write
the report files (``reports.comparison`` renders them)."""
from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Iterable

import attacks
from attacks.metrics import PSNR_CAP_DB
from attacks.verdicts import LEAK_GAP_DB, PRESENCE_THRESHOLD, SUCCESS_RULE
from fedecouple.errors import UserError

from ... import io, runner
from ...runner import RunConfig
from ...versions import provenance
from ..attack import AttackSettings, parse_attacks, parse_rounds
from ..compare import parse_methods, unused_hyperparameters
from .settings import DEFAULT_ATTACKS, ReportSettings, attack_of, parse_sizes
from .stages import Stage, check_reuse_dirs, plan, run_stages, sized_config
from .malicious import malicious_meta, section_table
from .tables import (assemble, client_size_rows, exposure_evidence, leakage_by_round, lower_bound_flags,
                     method_comparisons, psnr_definition)


def validate(base: RunConfig, methods: list[str], attack_names: list[str], settings: ReportSettings, out: Path,
             mia=None) -> tuple[ReportSettings, list[Stage]]:
    """Every check that can fail on user input, before anything is written; returns the settings with
    their rounds checked and the planned stages."""
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
    settings = replace(settings, rounds=tuple(parse_rounds(settings.rounds)),
                       malicious_sizes=parse_sizes(settings.malicious_sizes),
                       malicious_rounds=settings.malicious_rounds and tuple(parse_rounds(settings.malicious_rounds)))
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    malicious = settings.malicious_cells(attack_names)
    stages = plan(base, methods, settings.attack_plan(settings.keys(attack_names)), out, mia, malicious)
    if malicious:
        check_sizes(stages[0].config, settings.malicious_sizes)
    if settings.real_sizes and any(st.attack and settings.cell_size(st.attack) for st in stages):
        check_sizes(stages[0].config, settings.real_sizes, "--real-sizes")
    for st in stages:
        runner.build_method(st.config)
        st.config.federation.validate(st.config.data.clients)
        if st.resumable.holds_other():
            raise UserError(f"{st.path} holds a {st.name} stage with a different configuration; "
                            f"use another --out (and --reuse {out} to keep what still matches) or remove that folder")
    runner.prepare(stages[0].config)  # the data set loads (or fails) now
    return settings, stages


def check_sizes(base: RunConfig, sizes: Iterable[int], flag: str = "--malicious-sizes") -> None:
    """A one-line error when a ``flag`` (``--malicious-sizes``, ``--real-sizes``) value exceeds a
    client's training split."""
    whole = runner.prepare(sized_config(base, 1).updated(train_images=None))
    smallest = min(len(t) for t in whole.partition.train)
    too_big = [n for n in sizes if n > smallest]
    if too_big:
        raise UserError(f"{flag} {too_big[0]}: the smallest client holds {smallest} training images on "
                        f"this partition; choose sizes of at most {smallest} (or fewer --clients)")


def build_report(base: RunConfig, methods: list[str], out: str | Path, attacks: Iterable[str] = DEFAULT_ATTACKS,
                 settings: ReportSettings | None = None, reuse: Iterable[str | Path] = (), progress: bool = True,
                 command: str | None = None, log: Callable[[str], None] | None = None, mia=None,
                 jobs: int = 1) -> dict:
    """Run (or resume, or reuse) every stage, then write the report files; returns their paths and the
    summary. ``mia`` (a ``fedsec.jobs.mia.MiaSettings``) adds a membership-inference stage per method.
    ``jobs``: processes running the methods' stages side by side (``stages.run_stages``; with the
    same threads per stage the numbers do not depend on it)."""
    settings = settings or ReportSettings()
    out = Path(out)
    attack_names = parse_attacks(list(attacks))
    methods = list(dict.fromkeys(methods))
    reuse_dirs = check_reuse_dirs(reuse)
    if mia is not None:
        mia.validate()
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {jobs}")
    if jobs > 1 and base.execution.backend == "ray":
        raise UserError("--jobs runs the methods in separate processes and --backend ray shares one Ray between "
                        "stages: use one of them (--jobs 1 with Ray)")
    with runner.shared_datasets(), _one_ray(base):  # every stage reads the same data set tensors (and one Ray)
        settings, stages = validate(base, methods, attack_names, settings, out, mia)
        records, failed, seconds = run_stages(stages, reuse_dirs, progress, log, jobs)
    cells = {st.attack: st.attack_settings for st in stages if st.kind == "attack"}
    keys = settings.keys(attack_names)
    malicious = settings.malicious_cells(attack_names)
    section = section_table(stages, malicious, methods, base.federation.seed)
    section_meta = malicious_meta(section, malicious) if malicious else None
    return {**_write_report(base, methods, keys, cells, out, stages, records, failed, seconds, command,
                            (section, section_meta)),
            "cells": keys, "malicious": section}


def fig10_table(by_round, results, methods: list[str], seed: int = 0):
    """``reports.fig10``'s rows: ``by_round`` (its stopped-short counts decide the verdicts, the exposure
    matrix's rule) with, where the per-image rows record it, the clients whose attack lacked the model
    (``model_unknown_targets``); paired intervals as the report's other intervals
    (``attacks.metrics.mean_interval``)."""
    from attacks.metrics import mean_interval
    from reports.fig10 import fig10_frame
    from reports.formatting import is_true

    rows = by_round.copy()
    if "model_unknown_targets" not in rows.columns and "model_unknown" in results.columns and len(rows):
        unknown = results[results["model_unknown"].map(is_true)].drop_duplicates(["method", "attack", "round", "client"])
        counts = unknown.groupby(["method", "attack", "round"]).size()
        rows["model_unknown_targets"] = [int(counts.get((r["method"], r["attack"], r["round"]), 0))
                                         for r in rows.to_dict("records")]
    interval = lambda v, c: mean_interval(v, c, seed=seed, bounds=(-PSNR_CAP_DB, PSNR_CAP_DB))[0]  # noqa: E731
    return fig10_frame(rows, results, methods, interval=interval, cap=PSNR_CAP_DB)


def with_fig10(contents: dict, fig10) -> dict:
    """The rendered report files with ``reports.fig10``'s section in report.md and report.html."""
    from reports import fig10 as section

    out = dict(contents)
    if "report.md" in out:
        out["report.md"] = section.insert_section(out["report.md"], "\n".join(section.section_markdown(fig10)),
                                                  section.BEFORE_MD)
    if "report.html" in out:
        out["report.html"] = section.insert_section(out["report.html"], section.section_html(fig10), section.BEFORE_HTML)
    return out


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


def _report_meta(base: RunConfig, methods: list[str], attack_names: list[str], cells: dict[str, AttackSettings],
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
        "attack_settings": {a: asdict(cells[a]) for a in attack_names},
        "mia": list(mia_summaries),
        "comparisons": comparisons,
        **provenance(), "psnr_definition": psnr_definition(), "stages": records, "notes": notes,
        "findings_note": ("Findings come from `fedsec audit` (without its own evidence attacks); where this report "
                          "measured the matching attack, its numbers are shown and the severity follows the audit's "
                          f"rule (leakage within {LEAK_GAP_DB:.0f} dB of the prior, or class-presence accuracy "
                          f"below {PRESENCE_THRESHOLD:g}, is low)."),
    }


def _write_report(base: RunConfig, methods: list[str], attack_names: list[str], cells: dict, out: Path,
                  stages: list[Stage], records: list[dict], failed: dict, seconds: float, command: str | None,
                  malicious: tuple = (None, None)) -> dict:
    """Assemble the tables from the stage folders and write every report file (``malicious``: the
    malicious-server section's rows and meta, ``fedsec.jobs.report.malicious``)."""
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
    meta = _report_meta(base, methods, attack_names, cells, details, records, notes, command, mia_summaries,
                        method_comparisons(summary, results, methods, attack_names))
    meta["by_round"] = by_round.to_dict("records") if by_round["round"].nunique() > 1 else []
    meta["client_size"] = client_size_rows(by_round, summary, cells)
    meta["exposure"] = exposure_evidence(summary, by_round, meta, malicious[0])  # the matrix atop the report
    fig10 = fig10_table(by_round, results, methods, seed=base.federation.seed)
    tables = {"results.csv": results, "summary.csv": summary, "findings.csv": findings, "by_round.csv": by_round,
              "fig10.csv": fig10}
    section, section_meta = malicious
    if section_meta is not None:
        meta["malicious"] = section_meta
        meta["attack_settings"].update({k: asdict(v) for k, v in cells.items() if k not in meta["attack_settings"]})
        tables["malicious.csv"] = section
    paths = {}
    for name, content in with_fig10(render(lower_bound_flags(summary, attack_names), results, findings, grids, meta),
                                    fig10).items():
        (io.write_bytes if isinstance(content, bytes) else io.write_text)(out / name, content)
        paths[name] = out / name
    for name, frame in tables.items():
        io.write_csv(out / name, frame)
        paths[name] = out / name
    return {"paths": paths, "summary": summary, "stages": records, "failed": failed}
