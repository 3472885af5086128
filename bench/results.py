"""The headline results: one JSON record per cell under ``results/``, written by the run that measured
it, and the page ``docs/results.md`` rendered from those records.

    python bench/results.py --list                 # the cells, what each runs and its cost on 2 cores
    python bench/results.py --cell main-job        # rerun one cell (or several: --cell a,b), write results/<cell>.json
    python bench/results.py --cell all             # every cell this machine can run (hours on 2 cores)
    python bench/results.py --cell NAME --keep DIR # and keep each run's folder under DIR/<cell>
    python bench/results.py --render               # write docs/results.md from results/*.json
    python bench/results.py --check                # exit 1 when docs/results.md is not what --render writes

A record holds the command, the commit (``dirty`` when the code the cell depends on had uncommitted
changes), the machine (CPU model, cores, GPU), the seconds, the package versions and the summary
figures. The page shows one value per cell; a cell measured at a commit before the last commit that
changed the code it depends on (``git log`` of the cell's paths) is shown as **stale**, and the page names
the commits and files changed since. Records carried from an earlier measurement say so (``source``) and keep
the commit of that measurement. The page opens with how to read it and the exposure matrix of every record
(``reports.exposure``: one verdict per method and threat, by the rule ``fedsec report`` applies too). A
record keeps a command's print-out without progress bars, and a headline of about 120 characters.
Unknown cell names and cells this machine cannot run end with a one-line error and exit status 2.
"""
from __future__ import annotations

import argparse
import csv
import functools
import html
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from reports.formatting import NO_MODEL  # the reports' marker (imports neither torch nor pandas)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling below, also when loaded by a test
import results_figures  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
PAGE = ROOT / "docs" / "results.md"
SAMPLE_LINE_FILES = ("README.md", "docs/reading-results.md")  # they show the line the main job printed
CODE = ("attacks", "fedecouple", "fedsec")  # what an attack or training figure depends on
MEASURED = "measured by bench/results.py"
CARRIED = "carried from an earlier measurement"


class CellError(Exception):
    """A one-line error for the user (exit status 2)."""


# ---------------------------------------------------------------- figures read from a run's outputs

def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f} %"


def _interval(ci, digits=2, scale=1.0) -> str:
    if not ci or ci[0] is None:
        return ""
    return f" [{ci[0] * scale:.{digits}f}, {ci[1] * scale:.{digits}f}]"


def attack_headline(f: dict) -> str:
    """One value for an attack cell, in about 120 characters: the mean PSNR with its interval and prior, the
    share recovered, the images and targets, and the forward-model check's counts, NO MODEL included (or
    the class-presence accuracy of the label attack). The class prior and the other shares stay in the
    record's figures and the cell's details."""
    if f.get("class_presence_accuracy") is not None and f.get("mean_psnr") is None:
        return f"class-presence accuracy {f['class_presence_accuracy']:.2f}"
    text = f"{f['mean_psnr']:.2f} dB{_interval(f.get('mean_psnr_ci'))} (prior {f['mean_prior_psnr']:.2f})"
    if f.get("success_rate") is not None:
        text += f"; recovered {_pct(f['success_rate'])}{_interval(f.get('success_rate_ci'), 0, 100)}"
    text += f"; {f['n_images']} images, {f['n_targets']} targets"
    checks = []
    if f.get("mis_specified_targets"):
        checks.append(f"{f['mis_specified_targets']} MIS-SPECIFIED")
    if f.get("not_converged_targets"):
        checks.append(f"{f['not_converged_targets']} stopped short")
    if f.get("model_unknown_targets"):  # the server holds no model of these clients: a surrogate's estimate
        checks.append(f"{f['model_unknown_targets']} {NO_MODEL}")
    return text + (f" ({', '.join(checks)})" if checks else "")


def attack_details(f: dict) -> list[str]:
    """What an attack cell's headline leaves out, one line each (its details)."""
    out = []
    if f.get("mean_class_prior_psnr") is not None:
        out.append(f"class prior (the right class's mean image) {f['mean_class_prior_psnr']:.2f} dB")
    if f.get("inputs_exact_share") is not None:
        out.append(f"inputs exact {_pct(f['inputs_exact_share'])}{_interval(f.get('inputs_exact_share_ci'), 0, 100)}")
    if f.get("fishing_success_share") is not None:
        out.append(f"fished image rebuilt in {_pct(f['fishing_success_share'])}"
                   f"{_interval(f.get('fishing_success_share_ci'), 0, 100)} of attacked client-rounds")
    return out


ATTACK_KEYS = ("mean_psnr", "mean_psnr_ci", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_class_prior_psnr",
               "mean_ssim", "success_rate", "success_rate_ci", "label_accuracy", "class_presence_accuracy",
               "mis_specified_targets", "not_converged_targets", "inputs_exact_share", "inputs_exact_share_ci",
               "fishing_success_share", "fishing_success_share_ci", "seed")


def attack_figures(out: Path, stdout: str) -> dict:
    """The figures of ``fedsec attack``'s ``summary.json`` in the one run folder under ``runs/``, and the
    line the command printed."""
    summaries = sorted(out.glob("runs/*/summary.json"))
    if len(summaries) != 1:
        raise CellError(f"expected one summary.json under runs/, found {len(summaries)}")
    summary = json.loads(summaries[0].read_text(encoding="utf-8"))
    figures = {k: summary.get(k) for k in ATTACK_KEYS if summary.get(k) is not None}
    from attacks.verdicts import model_unknown_targets  # imports torch: only once a cell has run

    unknown = model_unknown_targets(summary)
    if unknown:
        figures["model_unknown_targets"] = unknown
    figures["n_images"] = summary.get("images_scored")
    figures["n_targets"] = summary.get("n_targets")
    figures["line"] = next((line for line in stdout.splitlines() if " → " in line), "")
    figures["headline"] = attack_headline(figures)
    return figures


def compare_figures(out: Path, stdout: str) -> dict:
    """``fedsec compare``'s ``accuracy.csv``: per method the mean and sample std of the mean client accuracy
    over the seeds, and the mean over seeds of the spread over clients."""
    import statistics

    with open(next(out.glob("runs/*/accuracy.csv")), encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    methods: dict[str, list[dict]] = {}
    for row in rows:
        methods.setdefault(row["method"], []).append(row)
    table = []
    for method, runs in methods.items():
        acc = [100 * float(r["mean_accuracy"]) for r in runs]
        spread = statistics.mean(100 * float(r["std_accuracy"]) for r in runs)
        std = statistics.stdev(acc) if len(acc) > 1 else 0.0
        table.append([method, f"{statistics.mean(acc):.2f} ± {std:.2f}", f"{spread:.2f}", str(len(acc))])
    return {"headline": compare_headline(table),
            "table": {"columns": ["method", "accuracy % (mean ± std over seeds)", "client std", "seeds"], "rows": table}}


def compare_headline(rows: list[list[str]]) -> str:
    """The best and the lowest method of an accuracy table (every method is in the table)."""
    mean = lambda r: float(r[1].split(" ")[0])  # noqa: E731
    best, low = max(rows, key=mean), min(rows, key=mean)
    return (f"best {best[0]} {best[1]} %; lowest {low[0]} {low[1]} % ({len(rows)} methods, "
            f"{max(int(r[3]) for r in rows)} seeds)")


def n_curve_figures(out: Path, stdout: str) -> dict:
    """``bench/n_curve.py``'s CSV: one row per client size N."""
    with open(out / "n_curve.csv", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    table, cleared = [], []
    for r in rows:
        low, high, prior = float(r["mean_psnr_low"] or "nan"), float(r["mean_psnr_high"] or "nan"), float(r["prior_psnr"])
        if low > prior:
            cleared.append(int(r["train_images"]))
        table.append([r["train_images"], f"{float(r['mean_psnr']):.2f} [{low:.2f}, {high:.2f}]", f"{prior:.2f}",
                      _pct(float(r["success_rate"])), f"{r['n_images']} ({r['n_targets']})",
                      f"{r['mis_specified_targets']} / {r['not_converged_targets']}", r["iterations"] or "default"])
    return {"headline": f"largest N whose interval clears the prior: {max(cleared) if cleared else 'none'}",
            "table": {"columns": ["N", "mean PSNR dB [95 % CI]", "prior", "recovered", "images (clients)",
                                  "mis-specified / stopped short", "iterations"], "rows": table}}


def _csv(out: Path, pattern: str) -> list[dict]:
    found = sorted(out.glob(pattern))
    if not found:
        raise CellError(f"the run wrote no {pattern}")
    with open(found[0], encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _num(value, fmt="{:.2f}") -> str:
    return "–" if value in (None, "", "nan") else fmt.format(float(value))


def audit_figures(out: Path, stdout: str) -> dict:
    """The audit preset's ``by_round.csv``: one row per method, image cell and attacked round."""
    table, exposed = [], set()
    for r in _csv(out, "runs/audit/by_round.csv"):
        low = r["mean_psnr_ci_low"]
        if low not in ("", "nan") and float(low) > float(r["prior_psnr"]):
            exposed.add(f"{r['method']} {r['attack']} round {r['round']}")
        table.append([r["method"], r["attack"], r["round"], f"{r['n_images']} ({r['n_targets']})",
                      f"{_num(r['mean_psnr'])} [{_num(low)}, {_num(r['mean_psnr_ci_high'])}]", _num(r["prior_psnr"]),
                      _pct(float(r["success_rate"])) if r["success_rate"] else "–",
                      f"{r['mis_specified_targets']} / {r['not_converged_targets']}"])
    figures = {"headline": f"{len(exposed)} of {len(table)} cells above the prior by their interval",
               "table": {"columns": ["method", "cell", "round", "images (targets)", "mean PSNR dB [95 % CI]", "prior",
                                     "recovered", "mis-specified / stopped short"], "rows": table}}
    if list(out.glob("runs/audit/fig10.csv")):  # reports written before the Fig. 10 section have none
        figures["fig10"] = fig10_figures(_csv(out, "runs/audit/fig10.csv"))
    return figures


def fig10_figures(rows: list[dict]) -> dict:
    """The report's ``fig10.csv`` as a table: each method's mean PSNR per round (its flags), then each
    paired comparison A − B (pairs, mean difference, the paper's claim, holds / does not hold / undetermined)."""
    table = []
    for r in rows:
        paired = r["kind"] == "paired"
        number = "{:+.2f}" if paired else "{:.2f}"
        interval = f" [{_num(r['ci_low'], number)}, {_num(r['ci_high'], number)}]" if r["ci_low"] not in ("", "nan") else ""
        flags = [f"{word} {r[key]}/{r['n_targets']}" for word, key in (("MIS-SPECIFIED", "mis_specified_targets"),
                                                                     ("NO MODEL (estimate)", "model_unknown_targets"))
                 if not paired and r.get(key) not in (None, "", "0", "0.0")]
        flags += ["LOWER BOUND"] if not paired and r["lower_bound"] == "True" else []
        table.append([r["round"], f"{r['method']} − {r['versus']}" if paired else r["method"], r["cell"],
                      f"{r['n']} ({r['n_targets']})", f"{_num(r['mean'], number)}{interval}", r["claim"] or "–",
                      r["verdict"] if paired else (", ".join(flags) or "–")])
    return {"columns": ["round", "method / A − B", "cell", "images or pairs (clients)",
                        "mean PSNR / difference dB [95 % CI]", "paper's claim (Fig. 10)", "flags / verdict"],
            "rows": table}


def malicious_figures(out: Path, stdout: str) -> dict:
    """The report's ``malicious.csv``: per method, client size and download check, the share rebuilt (with
    its 95 % interval)."""
    def share(value, low=None, high=None):
        if value in ("", None):
            return "–"
        return _pct(float(value)) + (f" [{100 * float(low):.0f}, {100 * float(high):.0f}]"
                                     if low not in ("", None) and high not in ("", None) else "")

    table = []
    for r in _csv(out, "runs/*/malicious.csv"):
        if r["status"] != "done":
            table.append([r["method"], r["train_images"], r["download_check"], f"{r['status']}: {r['reason']}",
                          "", "", "", ""])
            continue
        refused = (f"{r['crafted_refused']}/{r['crafted_downloads']} / {r['honest_refused']}/{r['honest_downloads']}"
                   if r["crafted_downloads"] else "–")
        table.append([r["method"], r["train_images"], r["download_check"],
                      share(r["recovered_share"], r.get("recovered_ci_low"), r.get("recovered_ci_high")),
                      share(r["rebuilt_30db_share"]),
                      f"{_num(r['mean_psnr'])} ({_num(r['prior_psnr'])})" if r["mean_psnr"] else "nothing rebuilt",
                      share(r["inputs_exact_share"]), refused])
    return {"headline": malicious_headline(table),
            "table": {"columns": ["method", "N", "check", "recovered (≥ prior + 6 dB)", "≥ 30 dB", "mean PSNR dB (prior)",
                                  "inputs exact", "crafted / honest refused"], "rows": table}}


def malicious_headline(rows: list[list[str]]) -> str:
    """Per method the share recovered at each client size with the download check off, and the largest
    share with it on."""
    off: dict[str, list[str]] = {}
    for r in rows:
        if r[2] == "off" and r[4]:
            off.setdefault(r[0], []).append(r[3].split(" [")[0].removesuffix(" %"))
    sizes = "/".join(dict.fromkeys(r[1] for r in rows if r[2] == "off" and r[4]))
    on = [r[3].split(" [")[0] for r in rows if r[2] == "on" and r[4]]
    text = f"check off, recovered at N = {sizes}: " + ", ".join(f"{m} {'/'.join(v)} %" for m, v in off.items())
    return text + (f"; check on: at most {max(on, key=lambda x: float(x.removesuffix(' %')))}" if on else "")


def mia_figures(out: Path, stdout: str) -> dict:
    """``fedsec mia``'s ``summary.json``: LiRA's AUC and TPR at 1 % FPR per attacked model."""
    summary = json.loads(next(out.glob("runs/*/summary.json")).read_text(encoding="utf-8"))
    rows = []
    for target, info in summary["targets"].items():
        lira = info.get("attacks", {}).get("lira", {}) if info.get("available") else {}
        if "auc" in lira:
            tpr, ci = lira.get("tpr_at_1pct_fpr"), lira.get("auc_ci")
            auc = f"{lira['auc']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and None not in ci else "")
            rows.append([target, auc, f"{tpr:.3f}" if isinstance(tpr, float) else "refused"])
        else:
            rows.append([target, "none", "none"])
    personal = next((r for r in rows if r[0] == "personal"), ["personal", "none", "none"])
    return {"headline": f"accuracy {summary['target_accuracy']:.4f}; personal models LiRA AUC {personal[1]}, "
                        f"TPR at 1 % FPR {personal[2]}",
            "table": {"columns": ["model", "LiRA AUC [95 % CI]", "TPR at 1 % FPR"], "rows": rows}}


def device_figures(out: Path, stdout: str) -> dict:
    """``bench/device.py``'s lines: images per second per device and the GPU ÷ CPU ratios."""
    lines = [line for line in stdout.splitlines() if "images/s" in line or line.startswith("GPU / CPU")]
    ratio = next((line for line in lines if line.startswith("GPU / CPU")), "GPU / CPU: n/a")
    return {"headline": ratio.removeprefix("GPU / CPU: ").strip(), "lines": lines}


def start_figures(out: Path, stdout: str) -> dict:
    """``bench/cli_start.py``'s table: each ``--help``'s median seconds over separate processes."""
    rows = {}
    for line in stdout.splitlines():
        if "--help" in line:
            name, numbers = line.split("--help", 1)
            rows[name.strip() + " --help"] = float(numbers.split()[0])
    if not rows:
        raise CellError("bench/cli_start.py printed no timings")
    top, slowest = rows.get("fedsec --help"), max(rows, key=rows.get)
    return {"headline": f"fedsec --help {top:.2f} s; slowest: {slowest} {rows[slowest]:.2f} s (medians of 5 processes)",
            "median_seconds": rows}


WARNING_LINE = re.compile(r"^\S+:\d+: \w*Warning: ")
# a progress bar (tqdm's "desc:  45%|████▌     | 9/20 [00:01<00:02,  4.86it/s]"): not a figure
PROGRESS = re.compile(r"\d+%\|.*\|\s*\d+/\d+\s*\[.*\]\s*$")


def printout(stdout: str) -> str:
    """What a cell keeps of a command's print-out: without progress bars (each redraw after a carriage
    return, or a line of its own) and without a library's warnings (they name a file of this machine)."""
    lines = []
    for raw in stdout.splitlines():
        line = next((part for part in reversed(raw.split("\r")) if part.strip() and not PROGRESS.search(part)), "")
        if line.strip() and not WARNING_LINE.match(line) and line.strip() != "warnings.warn(":
            lines.append(line.rstrip())
    return "\n".join(lines)


def printed_figures(*phrases: str) -> Callable[[Path, str], dict]:
    """A bench that prints its figures: the print-out (shown under the cell's details) and, as the
    headline, its lines that hold one of ``phrases``."""
    def figures(out: Path, stdout: str) -> dict:
        lines = printout(stdout).splitlines()
        picked = [line.strip() for line in lines if any(p in line for p in phrases)]
        if not picked:
            raise CellError(f"the bench printed none of: {', '.join(phrases)}")
        return {"headline": "; ".join(picked), "line": "\n".join(lines)}

    return figures


def _need(match, what: str):
    if match is None:
        raise CellError(f"the bench printed no {what}")
    return match


NUMBER = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


def _evidence(**fields) -> dict:
    """An ``reports.exposure.Evidence`` as the record keeps it (its fields by name)."""
    from reports.exposure import Evidence, as_dicts

    rounded = {k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()}  # 0.414, not 0.41399999
    return as_dicts([Evidence(**rounded)])[0]


def secure_curious_figures(out: Path, stdout: str) -> dict:
    """``bench/secure_curious.py``: per ``--sa-max-weight`` setting, a labelled table of what the curious
    server read from the sums (the round's label histogram, the sum inverted, the updates disaggregated
    beside the same attack on the true updates) and, for the exposure matrix, each figure with its
    interval and chance level."""
    text = printout(stdout)
    settings: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        command = re.match(r"\$ fedsec attack (\S+) .*--method (\S+).*--sa-max-weight (\d+)", line)
        if command:
            current = {"attack": command.group(1), "method": command.group(2), "lines": []}
            settings.setdefault(command.group(3), {"rows": [], "evidence": []})["current"] = current
            weight = command.group(3)
            continue
        if current is not None:
            current["lines"].append(line)
            _secure_curious_line(line, current, settings[weight])
    if not settings:
        raise CellError("the bench printed no 'fedsec attack ... --sa-max-weight' command")
    tables, evidence, parts = [], [], []
    for weight, found in settings.items():
        tables.append({"title": f"--sa-max-weight {weight}: the protocol set for clients of at most {weight} "
                                f"image{'s' if weight != '1' else ''}",
                       "columns": ["attack", "figure", "value [95 % CI]", "n", "prior or chance", "check"],
                       "rows": found["rows"]})
        evidence += [{**e, "what": f"{e['what']}, max weight {weight}"} for e in found["evidence"]]
        histogram = next((r[2].split(" [")[0] for r in found["rows"]
                          if r[1] == "rounds with the label histogram exact"), "?")
        parts.append(f"{histogram} ({'max weight ' if not parts else ''}{weight})")
    rebuilt = [r for f in settings.values() for r in f["rows"] if r[1] == "PSNR of the disaggregated updates"]
    headline = f"label histogram exact in {', '.join(parts)} rounds" + (
        f"; disaggregated updates {', '.join(r[2].split(' [')[0] for r in rebuilt)} dB, "
        f"{rebuilt[0][4]}" if rebuilt else "")
    return {"headline": headline, "line": text, "tables": tables, "evidence": evidence}


SHORT = re.compile(r"stopped short of the truth on (\d+) of (\d+) targets")


def _secure_curious_line(line: str, current: dict, found: dict) -> None:
    """One printed line of ``bench/secure_curious.py``: a table row (and the evidence it gives) where it
    holds a figure."""
    attack, method = current["attack"], current["method"]
    # the attack's own result line (printed before its figures) says where its optimiser stopped short
    short = next((m for m in map(SHORT.search, current["lines"]) if m), None)

    def row(what, shown, n, chance, check, metric=None, value=None, low=None, high=None, prior=None, stopped=0):
        """A table row, and the exposure matrix's evidence where ``metric`` names one."""
        found["rows"].append([attack, what, shown, n, chance, check])
        if metric:
            found["evidence"].append(_evidence(method=method, threat="secure", source="secure-curious", metric=metric,
                                               value=value, low=low, high=high, chance=prior, stopped_short=stopped,
                                               n_targets=int(short.group(2)) if short and metric == "psnr" else None,
                                               what=attack))

    def counted(m, what):
        k, n, low, high = int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4))
        row(what, f"{k}/{n} [{m.group(3)}, {m.group(4)}] %", str(n), "0 %", "exact counting: no optimiser",
            "label counts exact", k / n, low / 100, high / 100)

    def psnr(m, what, n, prior):
        # without the attack's sentence the print-out does not say whether its optimiser stopped short
        check = f"stopped short on {short.group(1)} of {short.group(2)} targets" if short else "not printed"
        row(what, f"{m.group(1)} [{m.group(2)}, {m.group(3)}] dB", n, f"prior {prior}", check, "psnr",
            float(m.group(1)), float(m.group(2)), float(m.group(3)), float(prior),
            int(short.group(1)) if short else None)

    if m := re.search(r"round histogram exact in (\d+) of (\d+) rounds \[(\d+), (\d+)\] %", line):
        counted(m, "rounds with the label histogram exact")
    elif m := re.search(rf"^\s*mean PSNR ({NUMBER}) dB \[({NUMBER}), ({NUMBER})\] \(\w+\) vs prior ({NUMBER}) dB, "
                        rf"n = (\d+)", line):
        psnr(m, "mean PSNR of the sum inverted", m.group(5), m.group(4))
    elif m := re.search(r"per-client label counts exact: (\d+) of (\d+) clients \[(\d+), (\d+)\] %", line):
        counted(m, "clients whose label counts are exact")
    elif m := re.search(rf"recovered updates: PSNR ({NUMBER}) \[({NUMBER}), ({NUMBER})\] \(n = (\d+)\) dB, "
                        rf"prior ({NUMBER}) dB", line):
        psnr(m, "PSNR of the disaggregated updates", m.group(4), m.group(5))
    elif m := re.search(rf"true updates without secure aggregation: PSNR ({NUMBER}) \[({NUMBER}), ({NUMBER})\] "
                        rf"\(n = (\d+)\) dB", line):
        row("PSNR of the same attack on the true updates (no secure aggregation)",
            f"{m.group(1)} [{m.group(2)}, {m.group(3)}] dB", m.group(4), found["rows"][-1][4] if found["rows"] else "–",
            "baseline")
    elif m := re.search(rf"paired difference \(recovered - true\) by matched client: ({NUMBER}) \[({NUMBER}), "
                        rf"({NUMBER})\] \(n = (\d+)\) dB", line):
        row("paired difference, disaggregated − true", f"{m.group(1)} [{m.group(2)}, {m.group(3)}] dB", m.group(4),
            "0", "–")


BINNING = re.compile(rf"^\s*(per-client|sized)\s+craft,\s*(\d+) x\s*(\d+), (no secure aggregation|secure, "
                     rf"quantization_range (\S+))\s+exact\s+({NUMBER}) % \[({NUMBER}), ({NUMBER})\]\s+n = (\d+)")
CHECK = re.compile(r"^\s*((?:isolate|honest server|neighbourhood), SecAgg\+?(?: k=\d+)?, \d+ clients), "
                   r"check (on|off)\s+(.*)$")


def secure_malicious_figures(out: Path, stdout: str) -> dict:
    """``bench/secure_malicious.py``: three labelled tables (binning through the sum, the model-inconsistency
    attack's images, the consistency check) and, for the exposure matrix, binning's exact share per setting."""
    text = printout(stdout)
    binning, inconsistency, check, evidence = [], [], [], []
    section = 0
    for line in text.splitlines():
        if re.match(r"^[123]\. ", line):
            section = int(line[0])
            continue
        b = BINNING.match(line)
        if b:
            secure = b.group(4) != "no secure aggregation"
            binning.append([b.group(1), f"{b.group(2)} × {b.group(3)}", b.group(5) if secure else "none",
                            f"{b.group(6)} % [{b.group(7)}, {b.group(8)}]", b.group(9)])
            evidence.append(_evidence(method="fedavg", threat="secure" if secure else "malicious",
                                      source="secure-malicious", metric="inputs exact", value=float(b.group(6)) / 100,
                                      low=float(b.group(7)) / 100, high=float(b.group(8)) / 100, stopped_short=0,
                                      what=f"binning, {b.group(1)} craft, {b.group(2)} × {b.group(3)} images"
                                           + (f", quantisation {b.group(5)}" if secure else "")))
            continue
        c = CHECK.match(line)
        if c:
            check.append([c.group(1), c.group(2), c.group(3).strip()])
            continue
        if section == 2 and line.startswith("  "):
            inconsistency.append([part.strip() for part in line.strip().split(": ", 1)] if ": " in line
                                 else [line.strip(), ""])
    if not binning:
        raise CellError("the bench printed no binning line")
    sized = {(r[1], r[2]): r[3] for r in binning if r[0] == "sized"}
    secure = next((k for k in sized if k[1] != "none"), None)
    flagged = next((r for r in check if r[0].startswith("isolate") and r[1] == "on"), None)
    headline = (f"binning through the sum ({secure[1]}): inputs exact {sized[secure]}"
                if secure else f"binning: inputs exact {binning[0][3]}")
    caught = re.search(r"flagged (\d+/\d+)", flagged[2]) if flagged else None
    if caught:
        headline += f"; consistency check on: {caught.group(1)} isolations flagged"
    return {"headline": headline, "line": text, "evidence": evidence, "tables": [
        {"title": "1. binning: share of first-linear-layer inputs recovered exactly (95 % interval over draws)",
         "columns": ["craft", "clients × images", "secure aggregation (quantisation range)", "inputs exact", "n"],
         "rows": binning},
        {"title": "2. model inconsistency: the target's images, through the sum vs its own upload",
         "columns": ["measured", "figure"], "rows": inconsistency},
        {"title": "3. consistency check, 20 rounds each (flagged: some client saw a mismatch)",
         "columns": ["server, protocol, clients", "check", "outcome"], "rows": check}]}


SECURE_DP = re.compile(rf"^\s*(sum-inversion|sum-binning|inconsistency|sybil)\s+eps (\S+)\s+mean PSNR (n/a|{NUMBER} dB "
                       rf"\[[^\]]*\]), recovered (n/a|\d+ % \[[^\]]*\]), n = (\d+); epsilon round (\S+), "
                       rf"total (\S+), isolated (\S+)$")


def secure_dp_figures(out: Path, stdout: str) -> dict:
    """``bench/secure_dp.py``: one row per attack and target epsilon (mean PSNR, share recovered, images, and
    the epsilon of the round's sum, the run's total and an isolated client's)."""
    text = printout(stdout)
    rows = [list(m.groups()) for line in text.splitlines() if (m := SECURE_DP.match(line))]
    if not rows:
        raise CellError("the bench printed no 'ATTACK eps E  mean PSNR ...' line")
    shown = {(r[0], r[1]): r for r in rows}
    words = {"inf": "without noise", "1e+06": "the clip alone", "1": "at eps 1"}
    parts = [f"{shown[('sum-binning', eps)][3]} {said}" for eps, said in words.items() if ("sum-binning", eps) in shown]
    return {"headline": ("sum-binning recovered " + ", ".join(parts)) if parts else f"{len(rows)} settings", "line": text, "tables": [
        {"title": "distributed DP (Skellam noise before masking, delta 1e-5, L2 clip 1): the round-level attacks; "
                  "eps 1e+06 is the clip with a negligible noise (the clip bounds each client's update)",
         "columns": ["attack", "target epsilon", "mean PSNR [95 % CI]", "recovered [95 % CI]", "n",
                     "epsilon of the round's sum", "epsilon total", "epsilon isolated"],
         "rows": rows}]}


def flower_secagg_figures(out: Path, stdout: str) -> dict:
    """``bench/flower_secagg.py``: one labelled row per setting (the aggregate against the true average, one
    masked upload's uniformity and correlation, the round's label histogram) and, for the exposure matrix,
    the histogram's exact share per setting."""
    text = printout(stdout)
    rows, evidence = [], []
    for line in text.splitlines():
        head = re.match(r"^(\S[^:]*): (\d+) nodes, (\d+) rounds, protocol: .*max weight (\d+)", line)
        if head:
            rows.append([head.group(1), head.group(4), "", "", "", ""])
            continue
        if not rows or not line.startswith("  "):
            continue
        body = line.strip()
        if body.startswith("aggregate vs true weighted average: "):
            rows[-1][2] = body.split(": ", 1)[1]
        elif body.startswith("one masked upload: "):
            rows[-1][3] = body.split(": ", 1)[1]
        elif body.startswith("sum-labels: "):
            h = _need(re.search(rf"histogram exact in (\d+) of (\d+) rounds \(95 % CI ({NUMBER})-({NUMBER})\)", body),
                      "histogram line")
            low, high = 100 * float(h.group(3)), 100 * float(h.group(4))
            rows[-1][4] = f"{h.group(1)} of {h.group(2)} rounds [{low:.0f}, {high:.0f}] %"
            rows[-1][5] = body.split("; ", 1)[1] if "; " in body else ""
            evidence.append(_evidence(method="fedavg", threat="secure", source="flower-secagg",
                                      metric="label counts exact", value=int(h.group(1)) / int(h.group(2)),
                                      low=float(h.group(3)), high=float(h.group(4)), stopped_short=0,
                                      what=f"sum-labels on Flower SecAgg+, {rows[-1][0]}"))
    if not rows:
        raise CellError("the bench printed no setting line ('NAME: N nodes, R rounds, protocol: ...')")
    within = sum("within" in r[2] for r in rows)
    headline = (f"sum within its bound {within}/{len(rows)}; label histogram exact "
                + ", ".join(f"{r[4].split(' rounds')[0].replace(' of ', '/')} ({r[0].split(', ')[-1]})" for r in rows)
                + " rounds")
    return {"headline": headline, "line": text, "evidence": evidence, "tables": [
        {"title": "Per setting: the recorded sums against the true weighted average, one masked upload, and the "
                  "round's label histogram read from the sum",
         "columns": ["setting", "max weight", "aggregate vs true weighted average", "one masked upload",
                     "label histogram exact [95 % CI]", "count error"], "rows": rows}]}


SECURE_METHOD = re.compile(rf"^(\S.*?)\s+({NUMBER}) ± ({NUMBER})(?:\s+vs (\S+): ([-+]\S+) \(95 % t interval "
                           rf"([-+]?\S+) \.\. ([-+]?\S+)\))?$")


def secure_methods_figures(out: Path, stdout: str) -> dict:
    """``bench/secure_methods.py``: per variant the final accuracy (mean ± std over seeds) and, for a secure
    variant, its difference to the plain method paired by seed with a 95 % t interval."""
    text = printout(stdout)
    rows, paired = [], {}
    for line in text.splitlines():
        m = SECURE_METHOD.match(line)
        if not m:
            continue
        name, mean, std, plain, diff, low, high = m.groups()
        rows.append([name, f"{mean} ± {std}", f"{diff} [{low}, {high}] vs {plain}" if plain else ""])
        if plain:
            paired[name] = (float(diff), float(low), float(high))
    if not rows:
        raise CellError("the bench printed no 'VARIANT MEAN ± STD' line")
    seeds = re.search(r"seeds ([\d,]+):", text)
    n = len(seeds.group(1).split(",")) if seeds else None

    def points(name: str) -> str:
        d, low, high = (100 * x for x in paired[name])
        return f"{d:+.2f} [{low:+.2f}, {high:+.2f}]"

    parts = []
    if "fedecouple two-pass" in paired:  # the largest distance the interval allows (the mean alone with one seed)
        d, low, high = paired["fedecouple two-pass"]
        far = max(abs(x) for x in (low, high)) if low == low and high == high else abs(d)
        parts.append(f"FedeCouple two-pass within {100 * far:.2f} points of plain ({points('fedecouple two-pass')})")
    if "fedpac secure-partial" in paired:
        parts.append(f"FedPAC partial {points('fedpac secure-partial')}")
    headline = "; ".join(parts) or f"{len(rows)} variants"
    return {"headline": headline + (f" over {n} seed{'s' if n != 1 else ''}" if n else ""), "line": text, "tables": [
        {"title": "mnist5k, pathological partition: final accuracy (mean over clients), mean ± std over the seeds; "
                  "secure variants against their plain method, paired by seed (95 % t interval)",
         "columns": ["variant", "accuracy", "paired difference [95 % t interval]"], "rows": rows}]}


FLOWER_HEAD = re.compile(r"^max weight (\S+)( \(the app's\))?: unmasked (\d+) of (\d+)$")
FLOWER_ERROR = re.compile(r"^\s+relative error of the parameters: median (\S+) \(max (\S+), (within|NOT within) the "
                          r"quantisation bound\); of their change from the download: median (\S+)$")
FLOWER_IMAGE = re.compile(rf"^\s+(\w+) on the unmasked update: mean PSNR ({NUMBER}) dB (\[[^\]]*\]); on the true "
                          rf"update: ({NUMBER}) dB (\[[^\]]*\]); prior ({NUMBER}) dB$")
FLOWER_PAIRED = re.compile(rf"^\s+paired difference \(unmasked - true\): ([-+]{NUMBER}) dB (\[[^\]]*\]), n = (\d+)$")
FLOWER_MATRIX = re.compile(r"^\s+(unmask-dropout|split-view|key-substitution|sybil)\s+"
                           r"(none|unmask-check|signed-consistency)\s+(\S.*)$")


def flower_malicious_figures(out: Path, stdout: str) -> dict:
    """``bench/flower_malicious.py``: per max weight the precision of the update the server unmasked and the
    image attack on it beside the true update (paired); then the defence matrix (attack, client defence,
    whether the target was unmasked)."""
    text = printout(stdout)
    runs, matrix = [], []
    for line in text.splitlines():
        if m := FLOWER_HEAD.match(line):
            runs.append([m.group(1) + (" (the app's)" if m.group(2) else ""), f"{m.group(3)} of {m.group(4)}",
                         "–", "–", "–", "–", "–", "–"])
        elif runs and (m := FLOWER_ERROR.match(line)):
            runs[-1][2:4] = [f"{m.group(1)}" + (" (NOT within the bound)" if m.group(3) != "within" else ""),
                             m.group(4)]
        elif runs and (m := FLOWER_IMAGE.match(line)):
            runs[-1][4:7] = [f"{m.group(2)} {m.group(3)}", f"{m.group(4)} {m.group(5)}", m.group(6)]
        elif runs and (m := FLOWER_PAIRED.match(line)):
            runs[-1][7] = f"{m.group(1)} {m.group(2)}, n = {m.group(3)}"
        elif m := FLOWER_MATRIX.match(line):
            matrix.append(list(m.groups()))
    if not runs:
        raise CellError("the bench printed no 'max weight W: unmasked K of N' line")
    done = [r for r in sorted(runs, key=lambda r: float(r[0].split(" ")[0])) if r[7] != "–"]
    paired = [f"{r[7].rsplit(', n = ', 1)[0].replace(' [', ' dB [', 1)} at {'' if i else 'max weight '}"
              f"{r[0].split(' ')[0]}" for i, r in enumerate(done)]
    n = "/".join(dict.fromkeys(r[7].rsplit("n = ", 1)[1] for r in done))
    headline = (f"IG PSNR, unmasked − true update (paired): {', '.join(paired)} (n = {n})" if paired
                else "; ".join(f"max weight {r[0]}: unmasked {r[1]}" for r in runs))
    tables = [{"title": "unmask-dropout on the example's round 0 (one SGD step on one image per node): the "
                        "unmasked update against the node's true one",
               "columns": ["max weight", "unmasked", "relative error of the parameters (median)",
                           "of their change from the download", "IG on the unmasked update dB [95 % CI]",
                           "IG on the true update dB [95 % CI]", "prior dB", "paired difference dB [95 % CI]"],
               "rows": runs}]
    if matrix:
        tables.append({"title": "What each client defence stops (--image-attack none): was the target unmasked?",
                       "columns": ["attack", "client defence", "outcome"], "rows": matrix})
    return {"headline": headline, "line": text, "tables": tables}


def vs_breaching_figures(out: Path, stdout: str) -> dict:
    """``bench/vs_breaching.py``: the per-image table and the means, once."""
    text = printout(stdout)
    mean = _need(re.search(rf"mean: ours ({NUMBER}) s ({NUMBER}) dB, breaching ({NUMBER}) s ({NUMBER}) dB "
                           rf"\(n = (\d+) images\)", text), "'mean: ours ...' line")
    ratio = _need(re.search(rf"ratio ({NUMBER}) .*gain_db ({NUMBER})", text), "ratio line")
    rows = [line.split() for line in text.splitlines()[1:] if re.match(rf"^\S+\s+{NUMBER}\s+{NUMBER}\s", line)]
    rows = [[r[0], *r[1:6], " ".join(r[6:])] for r in rows]
    return {"headline": f"ours {mean.group(2)} dB in {mean.group(1)} s, breaching {mean.group(4)} dB in {mean.group(3)} s "
                        f"({mean.group(5)} images; time ratio {ratio.group(1)}, +{ratio.group(2)} dB)",
            "line": text, "tables": [{"title": "Per image", "columns": ["image", "ours s", "ours dB", "breaching s",
                                                                        "breaching dB", "prior dB", "check"],
                                      "rows": rows}]}


def spear_figures(out: Path, stdout: str) -> dict:
    """``bench/spear.py``: per model and batch size the share of layer inputs recovered exactly, the share
    certified, the images' PSNR against the prior and the seconds per target."""
    text = printout(stdout)
    pattern = re.compile(rf"^(\S+)\s+B = \s*(\d+): exact\s+({NUMBER}) % \[(\d+), (\d+)\], certified\s+({NUMBER}) %, "
                         rf"PSNR\s+({NUMBER}) dB \[([^,]+), ([^\]]+)\] \(prior ({NUMBER})\),\s+({NUMBER}) s per target, "
                         rf"n = (\d+)", re.M)
    rows = [[m.group(1), m.group(2), f"{m.group(3)} % [{m.group(4)}, {m.group(5)}]", f"{m.group(6)} %",
             f"{m.group(7)} [{m.group(8)}, {m.group(9)}]", m.group(10), m.group(11), m.group(12)]
            for m in pattern.finditer(text)]
    if not rows:
        raise CellError("bench/spear.py printed no 'MODEL B = N: exact ...' line")
    exact = {(r[0], int(r[1])): r[2].split(" %")[0] for r in rows}
    largest = {arch: max((b for (a, b), share in exact.items() if a == arch and float(share) >= 90.0), default=None)
               for arch in dict.fromkeys(r[0] for r in rows)}
    headline = "; ".join(f"{arch}: ≥ 90 % of inputs exact up to B = {b}" if b else f"{arch}: below 90 % at every B"
                         for arch, b in largest.items())
    return {"headline": headline,
            "tables": [{"title": "Per model and batch size B (one SGD step, round 0, FedAvg)",
                        "columns": ["model", "B", "inputs exact (≤ 1e-4) [95 % CI]", "certified", "PSNR dB [95 % CI]",
                                    "prior dB", "seconds per target", "images"], "rows": rows}]}


SPEAR_LINE = re.compile(rf"^(one-step|real|trained) (.+?) (\S+): (?:exact ({NUMBER}) % \[(\d+), (\d+)\], certified "
                        rf"({NUMBER}) %, )?PSNR ({NUMBER}) dB \[([^,]+), ([^\]]+)\] \(prior ({NUMBER})\), ({NUMBER}) s "
                        rf"per target, n = (\d+)", re.M)
SPEAR_PAIRED = re.compile(rf"^(one-step|real|trained) (.+?) paired: (\S+) - (\S+) = ([+-]{NUMBER}) dB "
                          rf"\[([^,]+), ([^\]]+)\] over n = (\d+) images", re.M)


def spear_compare_figures(out: Path, stdout: str) -> dict:
    """``bench/spear_compare.py``: per setting and case each attack's share of inputs exact, PSNR against the
    prior and seconds; the paired PSNR differences; for the exposure matrix's "exact batch recovery" column,
    each SPEAR share with its interval (the method from the case: FedAvg unless the trained case names it)."""
    text = printout(stdout)
    rows, evidence = [], []
    for m in SPEAR_LINE.finditer(text):
        setting, case, attack = m.group(1), m.group(2), m.group(3)
        exact = f"{m.group(4)} % [{m.group(5)}, {m.group(6)}]" if m.group(4) else "—"
        rows.append([setting, case, attack, exact, f"{m.group(7)} %" if m.group(7) else "—",
                     f"{m.group(8)} [{m.group(9)}, {m.group(10)}]", m.group(11), m.group(12), m.group(13)])
        if m.group(4):
            method = case.split()[0] if setting == "trained" else "fedavg"
            evidence.append(_evidence(method=method, threat="exact-batch", source="spear-compare", metric="inputs exact",
                                      value=float(m.group(4)) / 100, low=float(m.group(5)) / 100,
                                      high=float(m.group(6)) / 100, stopped_short=0, what=f"spear, {setting} {case}"))
    if not rows:
        raise CellError("bench/spear_compare.py printed no 'SETTING CASE ATTACK: ... PSNR ...' line")
    paired = [[m.group(1), m.group(2), f"{m.group(3)} − {m.group(4)}", f"{m.group(5)} [{m.group(6)}, {m.group(7)}]",
               m.group(8)] for m in SPEAR_PAIRED.finditer(text)]
    # each case's paired difference without its interval (the table has it): a headline of one line
    headline = "; ".join(f"{r[1]} {r[3].split(' [')[0]}" for r in paired if r[0] == "one-step")
    return {"headline": f"SPEAR − IG, paired PSNR above the prior (dB): {headline}" if headline else rows[0][1],
            "tables": [{"title": "Per setting, case and attack (the same uploads for both attacks of a case)",
                        "columns": ["setting", "case", "attack", "inputs exact (≤ 1e-4) [95 % CI]", "certified",
                                    "PSNR dB [95 % CI]", "prior dB", "seconds per target", "images"], "rows": rows},
                       {"title": "Paired: PSNR above the prior (capped at 100 dB), first attack minus second, on the images both scored",
                        "columns": ["setting", "case", "attacks", "difference dB [95 % CI]", "images"],
                        "rows": paired}],
            "evidence": evidence}


def restarts_figures(out: Path, stdout: str) -> dict:
    """``bench/restarts.py``: the main job at one start and at K, wall seconds, mean PSNR and the targets whose
    kept start stopped short; the wall-time ratio."""
    text = printout(stdout)
    pattern = re.compile(rf"^--restarts (\d+):\s+({NUMBER}) s, mean PSNR ({NUMBER}) dB \[([^,]+), ([^\]]+)\], kept start "
                         rf"stopped short on (\d+) of (\d+) targets", re.M)
    rows = [[m.group(1), m.group(2), f"{m.group(3)} [{m.group(4)}, {m.group(5)}]", f"{m.group(6)} of {m.group(7)}"]
            for m in pattern.finditer(text)]
    ratio = _need(re.search(rf"^ratio ({NUMBER}) psnr1 ({NUMBER}) psnr8 ({NUMBER})", text, re.M), "'ratio ...' line")
    if len(rows) != 2:
        raise CellError("bench/restarts.py printed no two '--restarts K: ...' lines")
    return {"headline": f"--restarts {rows[1][0]}: {ratio.group(1)}× the wall time of one start, mean PSNR "
                        f"{ratio.group(3)} dB against {ratio.group(2)}",
            "tables": [{"title": "The main job (DLG on 8 FedeCouple clients) at one start and at K",
                        "columns": ["starts", "wall s", "mean PSNR dB [95 % CI]", "kept start stopped short"],
                        "rows": rows}], "line": text}


def batched_figures(out: Path, stdout: str) -> dict:
    """``bench/batched_attack.py``: batched against one by one, seconds and PSNR."""
    text = printout(stdout)
    m = _need(re.search(rf"^(\w+): (\d+) targets, (\d+) iterations, (\d+) thread\(s\): one by one ({NUMBER}) s \(PSNR "
                        rf"({NUMBER}) dB\), batched ({NUMBER}) s \(PSNR ({NUMBER}) dB\), throughput ratio ({NUMBER})",
                        text, re.M), "'ATTACK: N targets, ... throughput ratio' line")
    return {"headline": f"{m.group(1)}, {m.group(2)} targets, {m.group(3)} iterations: batched {m.group(7)} s vs "
                        f"{m.group(5)} s one by one (PSNR {m.group(8)} / {m.group(6)} dB); ratio {m.group(9)}",
            "line": text}


# ---------------------------------------------------------------- the cells

@dataclass(frozen=True)
class Cell:
    name: str
    group: str
    title: str
    argv: tuple[str, ...]          # "fedsec ..." or "python bench/..."; run in an empty folder
    figures: Callable[[Path, str], dict]
    cost: str                      # what it takes on the 2-core reference machine
    depends: tuple[str, ...] = CODE
    needs_gpu: bool = False
    pictures: tuple[tuple[str, str], ...] = ()  # (a file the run wrote, where a small copy is kept in the repo)
    # the exposure matrix's threat its figures stand for (``reports.exposure.THREATS``): "rows" where each
    # row of its table says (by client size, cell or round), "evidence" where its figures list their own
    threat: str | None = None

    @property
    def command(self) -> str:
        return " ".join(self.argv)


MAIN = ("fedsec", "attack", "dlg", "--method", "fedecouple")
TRAINED = ("--rounds", "20", "--clients", "20", "--attack-rounds", "19")
GROUPS = {
    "main": "The main job",
    "round0": "Attacks at round 0 (one image, one local step, 8 clients of 10)",
    "trained": "Attacks at the trained round (round 19 of 20, 20 clients)",
    "malicious": "Malicious server",
    "real": "Real local training: leakage against client size",
    "audit": "The audit preset",
    "accuracy": "Accuracy per method and partition",
    "mia": "Membership inference (LiRA)",
    "device": "Devices",
    "startup": "Start-up time of the command line",
    "secure": "Secure aggregation",
    "speed": "Attack speed",
    "spear": "Exact batch recovery (SPEAR)",
}


def _attack_cells() -> list[Cell]:
    cells = [Cell("main-job", "main", "DLG on FedeCouple (the README's first command)", MAIN, attack_figures,
                  "about 2-4 min", pictures=(("runs/attack-dlg-fedecouple/reconstructions.png", "docs/img/main-job.png"),),
                  threat="round0")]
    plan = [("dlg", ("fedper", "fedpac")), ("ig", ("fedecouple", "fedper", "fedpac")), ("proto", ("fedpac", "fedproto")),
            ("labels", ("fedecouple", "fedpac", "fedproto"))]
    for attack, methods in plan:
        for method in methods:
            cells.append(Cell(f"{attack}-{method}-r0", "round0", f"{attack} on {method}",
                              ("fedsec", "attack", attack, "--method", method, "--targets", "8", "--threads", "1"),
                              attack_figures, "1-5 min", threat="round0"))
    for attack, methods in [("dlg", ("fedecouple", "fedper", "fedpac")), ("ig", ("fedecouple", "fedper", "fedpac")),
                            ("proto", ("fedpac", "fedproto")), ("labels", ("fedecouple", "fedpac", "fedproto"))]:
        for method in methods:
            cells.append(Cell(f"{attack}-{method}-r19", "trained", f"{attack} on {method}",
                              ("fedsec", "attack", attack, "--method", method, *TRAINED, "--targets", "8",
                               "--threads", "1"), attack_figures, "3-15 min (20 rounds of training first)",
                              threat="trained"))
    return cells


def _other_cells() -> list[Cell]:
    cells = [
        Cell("trap-fedavg-n10", "malicious", "trap weights (binning) on FedAvg, clients of 10 images",
             ("fedsec", "attack", "trap", "--method", "fedavg", "--victim-batch", "0", "--train-images", "10",
              "--targets", "4", "--threads", "1"), attack_figures, "about 1-2 min", threat="malicious"),
        Cell("fish-fedavg-n10", "malicious", "classifier fishing on FedAvg, clients of 10 images, round 1",
             ("fedsec", "attack", "fish", "--method", "fedavg", "--victim-batch", "0", "--train-images", "10",
              "--targets", "10", "--attack-rounds", "1", "--threads", "1"), attack_figures, "about 1-2 min",
             threat="malicious"),
    ]
    for method in ("fedavg", "fedper", "fedpac", "fedecouple", "fedproto"):
        cells.append(Cell(f"n-curve-{method}", "real", f"{method}: fedavg-leak (FedProto: proto) against N",
                          ("python", "bench/n_curve.py", "--methods", method, "--sizes", "4,10,25,50,100,180",
                           "--out", "n_curve.csv"), n_curve_figures,
                          "hours (N = 50-180 at the default budget)", depends=CODE + ("bench/n_curve.py",),
                          threat="rows"))
    cells.append(Cell("audit-preset", "audit", "fedsec report --preset audit", ("fedsec", "report", "--preset", "audit",
                                                                                "--out", "runs/audit"),
                      audit_figures, "about 28 min", depends=CODE + ("reports",), threat="rows"))
    cells.append(Cell("malicious-table", "malicious", "trap against clients of 10 and 50 images, the download check off and on",
                      ("fedsec", "report", "--methods", "fedavg,fedper,fedpac,fedecouple,fedproto", "--attacks", "trap",
                       "--malicious-sizes", "10,50", "--targets", "4", "--seed", "0", "--threads", "1", "--out",
                       "runs/report-trap"), malicious_figures, "about 13 min", depends=CODE + ("reports",),
                      threat="rows"))
    for method in ("fedecouple", "fedper", "fedpac", "fedavg", "fedproto", "local"):
        cells.append(Cell(f"mia-{method}", "mia", f"membership inference on {method}",
                          ("fedsec", "mia", "--method", method, "--clients", "20", "--rounds", "5", "--local-epochs", "5",
                           "--reference-runs", "4", "--threads", "1", "--out", f"runs/mia-{method}"), mia_figures,
                          "3-10 min", threat="mia"))
    for partition, extra in (("pathological", ("--partition", "pathological", "--classes-per-client", "3")),
                             ("weak", ("--partition", "weak", "--uniform-share", "20")),
                             ("dirichlet", ("--partition", "dirichlet", "--beta", "0.1"))):
        cells.append(Cell(f"accuracy-{partition}", "accuracy", f"fedsec compare, {partition}",
                          ("fedsec", "compare", "--methods", "fedecouple,fedavg,ft-fedavg,fedper,fedrep,fedpac,fedproto,local",
                           "--seeds", "0,1,2", "--clients", "20", "--rounds", "5", "--local-epochs", "1", "--threads", "1",
                           *extra, "--out", f"runs/compare-{partition}"), compare_figures, "about 30 min",
                          depends=("fedecouple", "fedsec")))
    cells.append(Cell("secure-curious", "secure", "a curious server under secure aggregation: FedAvg, 10 clients of one "
                      "image; the round's label histogram, the sum inverted, disaggregation over 20 rounds",
                      ("python", "bench/secure_curious.py", "--out", "runs/secure-curious"),
                      secure_curious_figures, "about 10 min", depends=CODE + ("bench/secure_curious.py",),
                      threat="evidence"))
    cells.append(Cell("secure-malicious", "secure", "a malicious server through secure aggregation: binning through "
                      "the sum, model inconsistency, the consistency check",
                      ("python", "bench/secure_malicious.py"), secure_malicious_figures, "about 10 min",
                      depends=CODE + ("defenses", "bench/secure_malicious.py"), threat="evidence"))
    cells.append(Cell("secure-dp", "secure", "distributed DP under secure aggregation: sum-inversion, sum-binning, "
                      "inconsistency and sybil at epsilon 1, 8, 1e6 (the clip alone) and without noise (Skellam noise added before masking)",
                      ("python", "bench/secure_dp.py", "--out", "runs/secure-dp"), secure_dp_figures, "about 7 min",
                      depends=CODE + ("defenses", "bench/secure_dp.py")))
    cells.append(Cell("flower-secagg", "secure", "Flower's SecAgg+ recorded and attacked: 10 nodes, 3 rounds",
                      ("python", "bench/flower_secagg.py"), flower_secagg_figures, "about 2-4 min",
                      depends=CODE + ("bench/flower_secagg.py", "examples/flower_secagg"), threat="evidence"))
    cells.append(Cell("flower-malicious", "secure", "a malicious SecAgg+ server on Flower: unmask-dropout on 8 nodes "
                      "at max weight 2000 and 1 (IG on the unmasked update beside the true one), and what each "
                      "client defence stops",
                      ("python", "bench/flower_malicious.py"), flower_malicious_figures, "about 7 min",
                      depends=CODE + ("bench/flower_malicious.py", "examples/flower_secagg")))
    cells.append(Cell("sum-fishing", "secure", "fishing through the sum: FedAvg under secure aggregation, iid, 10 "
                      "clients of 10 images, max weight 1, rounds 1, 3 and 5",
                      ("fedsec", "attack", "sum-fishing", "--method", "fedavg", "--secure-aggregation", "--partition",
                       "iid", "--clients", "10", "--train-images", "10", "--sa-max-weight", "1", "--attack-rounds",
                       "1,3,5", "--threads", "1"), attack_figures, "about 30 s", threat="secure"))
    cells.append(Cell("secure-methods", "secure", "accuracy of the secure variants: FedeCouple in two passes and "
                      "FedPAC in part against the plain methods (mnist5k, pathological, 10 clients, 3 rounds, 3 seeds)",
                      ("python", "bench/secure_methods.py", "--seeds", "0,1,2", "--clients", "10", "--rounds", "3",
                       "--local-epochs", "1"), secure_methods_figures, "about 5-8 min",
                      depends=("fedecouple", "fedsec", "bench/secure_methods.py")))
    cells.append(Cell("vs-breaching", "speed", "our IG beside breaching's IG: the same model, gradient and 1000 "
                      "iterations, one start, 8 photographs (breaching 0.1.2 installed beside the pinned torch)",
                      ("python", "bench/vs_breaching.py", "--images", "8", "--threads", "1"),
                      vs_breaching_figures, "about 2 min",
                      depends=CODE + ("bench/vs_breaching.py",)))
    cells.append(Cell("restarts-main-job", "speed", "the main job at --restarts 1 and 8 in one process (every start a "
                      "slot of one batched L-BFGS, the later starts raced by successive halving), one thread",
                      ("python", "bench/restarts.py", "--restarts", "8"), restarts_figures, "about 4 min",
                      depends=CODE + ("bench/restarts.py",)))
    cells.append(Cell("batched-ig", "speed", "IG on 16 targets of one model, batched ÷ one by one",
                      ("python", "bench/batched_attack.py", "--attacks", "ig"), batched_figures,
                      "about 1 min", depends=CODE + ("bench/batched_attack.py", "bench/attack_speed.py")))
    cells.append(Cell("spear-batch-size", "spear", "SPEAR on FedAvg's one-step uploads, mlp-relu (first layer) and "
                      "pfllib-cnn (fc after the convolutions), and the LeakyReLU models mlp and cnn28, 2 clients per "
                      "batch size",
                      ("python", "bench/spear.py", "--batches", "4,8,16,24,25,32", "--out", "spear.png"),
                      spear_figures, "about 8 min", depends=CODE + ("bench/spear.py",),
                      pictures=(("spear.png", "docs/img/results/spear-batch-size.png"),)))
    cells.append(Cell("spear-compare", "spear", "SPEAR beside IG (one step, B = 16/25 on mlp-relu, 8/16 on pfllib-cnn) "
                      "and fedavg-leak (real local training: 24 images, batches of 8, one epoch) on the same uploads, "
                      "and on FedAvg, FedPer and FedPAC after 19 rounds (pfllib-cnn, one step of 8), 2 clients per case",
                      ("python", "bench/spear_compare.py"), spear_compare_figures, "about 15 min",
                      depends=CODE + ("bench/spear_compare.py",), threat="evidence"))
    cells.append(Cell("leak-small-clients", "speed", "fedavg-leak on FedAvg's smallest clients: 6 images, batches of "
                      "2, one epoch, 4 targets",
                      ("fedsec", "attack", "fedavg-leak", "--method", "fedavg", "--partition", "weak",
                       "--samples-per-client", "6", "--batch-size", "2", "--local-epochs", "1", "--targets", "4"),
                      attack_figures, "about 5 min", threat="real-small"))
    cells.append(Cell("cli-start", "startup", "fedsec --help and every command's --help, each a new process",
                      ("python", "bench/cli_start.py", "--runs", "5"), start_figures, "about 10 s",
                      depends=("fedsec", "bench/cli_start.py")))
    cells.append(Cell("device-gpu", "device", "GPU ÷ CPU: one FedeCouple round and batched IG (16 targets)",
                      ("python", "bench/device.py", "--threads", "1", "--ig-iterations", "50"), device_figures,
                      "about 2 min on a GPU machine", depends=CODE + ("bench/device.py",), needs_gpu=True))
    cells.append(Cell("device-main-job", "device", "the main job on the GPU (DLG on FedeCouple, --device cuda)",
                      MAIN + ("--device", "cuda"), attack_figures, "about 30 s on a GPU machine", needs_gpu=True))
    cells.append(Cell("device-audit-preset", "device", "fedsec report --preset audit on the GPU",
                      ("fedsec", "report", "--preset", "audit", "--device", "cuda", "--out", "runs/audit"),
                      audit_figures, "5-20 min on a GPU machine", depends=CODE + ("reports",), needs_gpu=True))
    return cells


CELLS = {cell.name: cell for cell in _attack_cells() + _other_cells()}


# ---------------------------------------------------------------- provenance

def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def git_available() -> bool:
    try:
        return git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"
    except OSError:
        return False


def commit_state(depends: tuple[str, ...]) -> tuple[str | None, bool]:
    """HEAD, and whether the cell's paths have uncommitted changes (tracked or untracked)."""
    if not git_available():
        return None, True
    head = git("rev-parse", "HEAD").stdout.strip()
    dirty = bool(git("status", "--porcelain", "--", *depends).stdout.strip())
    return head, dirty


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = kernels = None
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
        # the vector kernels torch runs (AVX512, AVX2, ...): figures repeat bit for bit only on the same ones
        kernels = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "kernels": kernels}


def versions() -> dict:
    from importlib import metadata
    out = {"python": platform.python_version()}
    for name in ("fedsec", "torch", "torchvision", "numpy", "scipy", "scikit-image", "opacus", "pandas"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- running a cell

PICTURE_WIDTH = 720  # pixels: a few tens of KB for the main job's panel


def keep_small(source: Path, target: Path) -> None:
    """A downscaled, palette-quantised copy of a picture the run wrote, written atomically."""
    from PIL import Image

    with Image.open(source) as image:
        image = image.convert("RGB")
        if image.width > PICTURE_WIDTH:
            image = image.resize((PICTURE_WIDTH, round(image.height * PICTURE_WIDTH / image.width)), Image.LANCZOS)
        image = image.quantize(colors=64)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".png")
    os.close(fd)
    try:
        image.save(tmp, format="PNG", optimize=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _argv(cell: Cell) -> list[str]:
    if cell.argv[0] == "fedsec":
        exe = Path(sys.executable).with_name("fedsec")
        head = [str(exe)] if exe.exists() else [sys.executable, "-c", "from fedsec.cli import main; main()"]
        return head + list(cell.argv[1:])
    return [sys.executable, str(ROOT / cell.argv[1]), *cell.argv[2:]]


def run_cell(cell: Cell, echo=print, keep: Path | None = None) -> dict:
    """Run the cell's command in an empty folder, read its figures and write ``results/<cell>.json``;
    ``keep``: copy the folder (every file the run wrote) to ``keep/<cell>`` too."""
    if cell.needs_gpu and not machine()["gpu"]:
        raise CellError(f"cell {cell.name} is measured on a GPU machine and torch sees no GPU here")
    commit, dirty = commit_state(cell.depends)
    echo(f"{cell.name}: {cell.command}  ({cell.cost})")
    with tempfile.TemporaryDirectory(prefix="fedsec-cell-") as tmp:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        start = time.perf_counter()
        proc = subprocess.Popen(_argv(cell), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            echo(line.rstrip("\n"))
        if proc.wait() != 0:
            last = next((x.strip() for x in reversed(lines) if x.strip()), "no output")
            raise CellError(f"cell {cell.name} failed (exit {proc.returncode}): {last}")
        seconds = time.perf_counter() - start
        figures = cell.figures(Path(tmp), printout("".join(lines)))  # no progress bar reaches a record
        for source, target in cell.pictures:
            keep_small(Path(tmp) / source, ROOT / target)
        if keep is not None:
            shutil.copytree(tmp, keep / cell.name, dirs_exist_ok=True)
    record = {"cell": cell.name, "command": cell.command, "source": MEASURED, "commit": commit, "dirty": dirty,
              "machine": machine(), "seconds": round(seconds, 1), "versions": versions(), "figures": figures}
    write_atomic(RESULTS / f"{cell.name}.json", json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    echo(f"{cell.name}: {figures['headline']}  ({seconds:.0f} s) → results/{cell.name}.json")
    return record


def select(names: str) -> list[Cell]:
    if names == "all":
        return [c for c in CELLS.values() if not c.needs_gpu or machine()["gpu"]]
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in CELLS]
    if unknown or not chosen:
        raise CellError(f"unknown cell {', '.join(unknown) or repr(names)}; known: all, {', '.join(CELLS)}")
    return [CELLS[n] for n in chosen]


# ---------------------------------------------------------------- rendering

def load_records() -> dict[str, dict]:
    records = {}
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("cell") != path.stem:
            raise CellError(f"{path.name}: its 'cell' is {record.get('cell')!r}, not {path.stem!r}")
        if record["cell"] not in CELLS:
            raise CellError(f"{path.name}: no cell of that name in bench/results.py")
        records[record["cell"]] = record
    return records


def staleness(record: dict, cell: Cell) -> str | None:
    """Why the record no longer describes the code, or None: the code the cell depends on changed in a
    commit after the one it was measured at (or that commit is not in this history)."""
    commit = record.get("commit")
    if not commit:
        return "measured at no recorded commit"
    return _staleness(commit, cell.depends)


@functools.lru_cache(maxsize=None)
def _staleness(commit: str, depends: tuple[str, ...]) -> str | None:
    # a render asks for each record several times; the history does not change meanwhile
    if git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        return f"commit {commit[:7]} is not in this history"
    changed = git("log", "-1", "--format=%h", f"{commit}..HEAD", "--", *depends).stdout.strip()
    return f"the code it depends on changed after it (last in {changed})" if changed else None


def cell_text(text) -> str:
    """A Markdown table cell: HTML escaped, no pipes or line breaks."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def code_text(text) -> str:
    """A command inside a code span of a table cell: Markdown escapes the span itself; only pipes and
    backticks would break it."""
    return str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ")


def machine_text(m: dict) -> str:
    text = f"{m.get('cpu', '?')}" + (f" ({m['kernels']})" if m.get("kernels") else "") + f", {m.get('cores', '?')} cores"
    return text + (f", {m['gpu']}" if m.get("gpu") else "")


def commit_text(record: dict) -> str:
    commit = record.get("commit") or "none"
    return f"{commit[:7]}" + (" (dirty)" if record.get("dirty") else "")


def status_text(record: dict | None, cell: Cell) -> str:
    if record is None:
        return "not measured"
    stale = staleness(record, cell)
    carried = record.get("source") != MEASURED
    if stale:
        changes = stale_changes(record, cell)
        since = f"{_commits(len(changes['commits']))} to its code since" if changes else stale
        return f"**stale**: {since} ([which](#stale-cells))" + ("; carried" if carried else "")
    return "carried" if carried else "current"


def stale_changes(record: dict, cell: Cell) -> dict | None:
    """What changed in the code a stale cell depends on since its commit: the commits (newest first: short
    hash, subject) and the files (git's status letter, path), and the files that existed at its commit and no
    longer do (deleted or renamed since); None when its commit is not in this history."""
    commit = record.get("commit")
    if not commit or git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        return None
    log = git("log", "--format=%h %s", f"{commit}..HEAD", "--", *cell.depends).stdout.splitlines()
    diff = [line.split("\t") for line in git("diff", "--name-status", "-M", commit, "HEAD", "--",
                                             *cell.depends).stdout.splitlines() if line.strip()]
    files = [(parts[0][0], parts[-1] if parts[0][0] != "R" else f"{parts[1]} → {parts[2]}") for parts in diff]
    gone = [parts[1] for parts in diff if parts[0][0] in "DR"]
    return {"commits": [tuple(line.split(" ", 1)) for line in log], "files": files, "gone": gone}


def _listed(items: list[str], most: int) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _commits(n: int) -> str:
    return f"{n} commit{'s' if n != 1 else ''}"


def _subject(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[:most - 1].rstrip() + "…"


def stale_section(records: dict[str, dict]) -> list[str]:
    """The stale cells, grouped by what changed since their measurement (the same commit and the same code
    paths): the commits (newest first) and the files, and which groups describe code that no longer exists
    (files under the code they depend on deleted or renamed since, or their commit gone from the history)."""
    groups: dict[tuple, list[str]] = {}
    for cell in CELLS.values():
        record = records.get(cell.name)
        if record is not None and staleness(record, cell):
            groups.setdefault((record.get("commit"), record.get("dirty"), cell.depends), []).append(cell.name)
    if not groups:
        return []
    rows, gone = [], []
    for (commit, dirty, depends), names in groups.items():
        record, cell = records[names[0]], CELLS[names[0]]
        changes = stale_changes(record, cell)
        who = f"**{', '.join(names)}** (measured at {commit_text(record)})"
        if changes is None:
            rows.append(f"* {who}: {cell_text(staleness(record, cell))}; what changed since cannot be read from this "
                        f"history.")
            gone += names
            continue
        commits = changes["commits"]
        newest = "; ".join(f"{h} {cell_text(_subject(subject))}" for h, subject in commits[:3])
        files = [path for _, path in changes["files"]]
        line = (f"* {who}: {_commits(len(commits))} to {', '.join(depends)} since ({newest}"
                f"{'; …' if len(commits) > 3 else ''}); {len(files)} file{'s' if len(files) != 1 else ''} changed: "
                f"{cell_text(_listed(files, 6))}")
        if changes["gone"]:
            gone += names
            line += f"; no longer exist: {cell_text(_listed(changes['gone'], 6))}"
        rows.append(line + ".")
    verdict = (f"Of these, {', '.join(gone)} describe code that no longer exists: files under the code they depend on "
               f"were deleted or renamed since they were measured (or their commit is gone), so rerun them before "
               f"relying on their figures." if gone else
               "Every file they depend on still exists; their figures may still move when rerun.")
    return ["## Stale cells", "", "Cells measured before the code they depend on last changed (`git log` of the "
            "cell's paths after its commit), grouped by what changed since: the commits, newest first, and the "
            "files. " + verdict, "", *rows, ""]


# ---------------------------------------------------------------- the exposure matrix of the records

def _method_of(cell: Cell) -> str | None:
    for flag in ("--method", "--methods"):
        if flag in cell.argv:
            value = cell.argv[cell.argv.index(flag) + 1]
            return value if "," not in value else None
    return None


CI_TEXT = re.compile(rf"^\s*({NUMBER})\s*(?:%\s*)?(?:\[({NUMBER}), ({NUMBER})\])?")


def _figure(text: str, scale: float = 1.0) -> tuple[float | None, float | None, float | None]:
    """(value, low, high) of a table's "18.94 [16.68, 20.87]" or "57 % [41, 73]" ("–": all None)."""
    m = CI_TEXT.match(str(text))
    if not m:
        return None, None, None
    value, low, high = (None if x is None else float(x) / scale for x in m.groups())
    return value, low, high


def _count_of(text: str) -> int | None:
    text = str(text).strip()
    return int(text) if text.isdigit() else None


def _checks(text: str) -> tuple[int | None, int | None]:
    """(mis-specified, stopped short) of a "0 / 16" check column ("–": not recorded)."""
    parts = [p.strip() for p in str(text).split("/")]
    return (_count_of(parts[0]), _count_of(parts[1])) if len(parts) >= 2 else (None, None)


def _attack_evidence(cell: Cell, record: dict, source: str) -> list:
    from reports.exposure import Evidence

    f, method, attack = record["figures"], _method_of(cell), cell.argv[2]
    out = []
    if f.get("mean_psnr") is not None:
        low, high = (f.get("mean_psnr_ci") or (None, None))[:2]
        out.append(Evidence(method=method, threat=cell.threat, source=source, what=attack, value=f["mean_psnr"],
                            low=low, high=high, chance=f.get("mean_prior_psnr"),
                            stopped_short=f.get("not_converged_targets"), n_targets=f.get("n_targets"),
                            no_model=f.get("model_unknown_targets") or 0,
                            mis_specified=f.get("mis_specified_targets") or 0))
    elif f.get("class_presence_accuracy") is not None:  # no interval nor label prior recorded: n/a by the rule
        out.append(Evidence(method=method, threat=cell.threat, source=source, what=attack, metric="class presence",
                            value=f["class_presence_accuracy"]))
    return out


def _row_evidence(cell: Cell, record: dict, source: str) -> list:
    """Evidence from a cell whose table rows each say where they belong: the client-size curve (by N), the
    audit preset (by cell and round) and the malicious-server table (the download check off)."""
    from reports.exposure import SMALL_CLIENT_IMAGES, Evidence, cell_threat

    f, out = record["figures"], []
    rows = (f.get("table") or {}).get("rows") or []
    if cell.figures is n_curve_figures:
        for n, figure, prior, _, images, checks, _ in rows:
            value, low, high = _figure(figure)
            wrong, short = _checks(checks)
            out.append(Evidence(method=_method_of(cell), threat="real-small" if int(n) <= SMALL_CLIENT_IMAGES
                                else "real-default", source=source, what=f"N = {n}", value=value, low=low, high=high,
                                chance=float(prior), stopped_short=short, mis_specified=wrong or 0,
                                n_targets=_count_of(images.split("(")[-1].rstrip(")"))))
    elif cell.figures is audit_figures:
        no_model = {}  # the Fig. 10 rows flag the clients whose server holds no model
        for r in (f.get("fig10") or {}).get("rows") or []:
            m = re.search(rf"{re.escape(NO_MODEL)} (\d+)/", r[-1])
            if m and " − " not in r[1]:
                no_model[(r[1], r[2], r[0])] = int(m.group(1))
        for method, key, rnd, images, figure, prior, _, checks in rows:
            value, low, high = _figure(figure)
            wrong, short = _checks(checks)
            out.append(Evidence(method=method, threat=cell_threat(key, int(rnd)), source=source,
                                what=f"{key}, round {rnd}", value=value, low=low, high=high,
                                chance=float(prior) if prior not in ("–", "") else None, stopped_short=short,
                                mis_specified=wrong or 0, no_model=no_model.get((method, key, rnd), 0),
                                n_targets=_count_of(images.split("(")[-1].rstrip(")"))))
    elif cell.figures is malicious_figures:
        for method, n, check, recovered, *_ in rows:
            if check != "off":  # the matrix shows the methods without a defence
                continue
            what = f"trap, N = {n}"
            if recovered.startswith("refused"):
                reason = recovered.removeprefix("refused: ").split(" (")[0].split(":")[0]
                out.append(Evidence(method=method, threat="malicious", source=source, what=what, refused=reason))
                continue
            value, low, high = _figure(recovered, 100.0)
            out.append(Evidence(method=method, threat="malicious", source=source, what=what, metric="recovered",
                                value=value, low=low, high=high))
    return out


def _mia_evidence(cell: Cell, record: dict, source: str) -> list:
    from reports.exposure import Evidence

    rows = (record["figures"].get("table") or {}).get("rows") or []
    personal = next((r for r in rows if r[0] == "personal"), None)
    value, low, high = _figure(personal[1]) if personal else (None, None, None)
    return [Evidence(method=_method_of(cell), threat="mia", source=source, what="LiRA, personal models",
                     metric="auc", value=value, low=low, high=high, stopped_short=0,
                     missing=None if personal else "no personal model")]


def declared_refusals(methods: list[str]) -> list:
    """What the methods' own declarations refuse (``fedecouple.methods``): secure aggregation where the server
    reads each client's upload, every server threat where the method sends nothing."""
    from fedecouple.methods import METHODS
    from fedecouple.methods.facets import PerClientFields, SecureSummation
    from fedsec.jobs.report.tables import SERVER_THREATS
    from reports.exposure import Evidence

    out = []
    for name in methods:
        method = METHODS.get(name)
        if method is None:
            continue
        if not method.communicates:
            out += [Evidence(method=name, threat=t, source="its declaration", refused="sends nothing to the server")
                    for t in SERVER_THREATS]
        elif not issubclass(method, SecureSummation):
            fields = method.per_client_fields if issubclass(method, PerClientFields) else ()
            out.append(Evidence(method=name, threat="secure", source="its declaration",
                                refused=f"its server reads {', '.join(fields)} of each client"))
    return out


def page_evidence(records: dict[str, dict]) -> list:
    """Every record's figures as ``reports.exposure`` evidence (a stale source says so), and the methods'
    declared refusals."""
    from reports.exposure import evidence_of

    out = []
    for cell in CELLS.values():
        record = records.get(cell.name)
        if record is None or cell.threat is None:
            continue
        source = cell.name + (" (stale)" if staleness(record, cell) else "")
        if cell.threat == "evidence":
            out += [evidence_of({**e, "source": source}) for e in record["figures"].get("evidence") or []]
        elif cell.threat == "rows":
            out += _row_evidence(cell, record, source)
        elif cell.threat == "mia":
            out += _mia_evidence(cell, record, source)
        else:
            out += _attack_evidence(cell, record, source)
    return out + declared_refusals(list(dict.fromkeys(e.method for e in out)))


def page_matrix(records: dict[str, dict]):
    from reports.exposure import exposure_matrix

    return exposure_matrix(page_evidence(records))


TRAINED_LABEL = {"trained": "curious server, trained (round 19)"}
MATRIX_NOTE = ("What leaks, for which method, under which threat: each cell is the worst verdict among the records "
               "that measured that method under that threat, with its figure and 95 % interval; \"≥\": the optimiser "
               "stopped short, so the true figure can only be higher. The last column is each method's worst exposure. "
               "Under the table, each cell's evidence: the prior, the checks behind the word, the attack or setting "
               "and the record it comes from ((stale): measured before its code last changed), and how many of the "
               "cell's other figures could not be judged (\"k more n/a\"). Small clients: at most 10 training images; "
               "default-size clients: more (the curve's N = 25–180 and the audit's N = 50 stand for the clients' own "
               "size where it was not measured).")

HOW_TO_READ = [
    "## How to read", "",
    "Each verdict follows one rule, the same on this page and in `fedsec report` "
    "([reading a result](reading-results.md#verdicts)):", "",
    "* **EXPOSED**: the figure's 95 % interval lies above the prior (or chance level): leakage shown. "
    "\"(at least)\": the optimiser also stopped short, so the true leakage can only be higher.",
    "* **LOWER BOUND**: not above the prior, while the optimiser stopped short on some target: the true leakage "
    "may be higher. Not evidence of safety.",
    "* **NOT SHOWN**: at the prior, with the optimiser reaching the truth's objective level on every target.",
    "* **NO MODEL**: the method uploads no model the attack can use (FedProto against weight attacks); its figure, "
    "where there is one, is a surrogate model's estimate, marked NO MODEL (estimate).",
    "* **REFUSED**: the attack does not apply, or the method refuses the setting (a server that reads each "
    "client's upload cannot run under secure aggregation).",
    "* **n/a**: the record lacks what a verdict needs (no interval, no prior, a MIS-SPECIFIED attack, or no word "
    "on whether the optimiser stopped short); the reason is given, never a guess.", "",
    "The figures:", "",
    "* **PSNR** (dB) compares a reconstruction with the image the client trained on, on pixels in [0, 1] "
    "(10·log10 of 1 over the mean squared error). About 12 dB is what a grey blur scores on a digit; at 17–20 dB "
    "the digit is recognisable under speckle noise (the main job's picture); at 30 dB and above it is a clean copy.",
    "* **prior**: that non-informative guess, the data set's mean image, scored the same way; leakage means above "
    "it. **class prior**: the mean image of the right class. An image counts as **recovered** at prior + 6 dB.",
    "* **[a, b]**: a 95 % interval that resamples the attacked clients (images of one client are not independent); "
    "n: the images scored.",
    "* **class-presence accuracy**: the share of (client, class) pairs whose presence in the client's data the "
    "label attack called right; its chance level is the label prior (always guessing the more frequent answer).",
    "* **LiRA AUC** (*Membership Inference Attacks From First Principles*): how well the likelihood-ratio attack "
    "tells a client's training records from its held-out ones (0.5: chance); **TPR at 1 % FPR**: the members it "
    "finds while wrongly flagging 1 % of non-members.",
    "* **inputs exact**: the share of first-linear-layer inputs a malicious server's crafted layer read back "
    "exactly (chance: 0 %).",
    "* **fishing share** (\"fished image rebuilt\"): the share of attacked client-rounds in which classifier "
    "fishing isolated and rebuilt its chosen image.",
    "* **stopped short**: the attack's own objective prefers the truth to its reconstruction, so the optimiser, "
    "not the method, set the number: a lower bound on leakage. **MIS-SPECIFIED**: the objective prefers the "
    "reconstruction, so the attack models the client wrongly and the number says nothing about privacy.",
    "* **NO MODEL (estimate)**: the server holds no model of the client; the figure is what a surrogate reaches.",
    "* **carried**: a record kept from an earlier measurement (hours on two CPU cores, or a GPU), with the commit "
    "it was made at. **stale**: the code the cell depends on changed after that commit; "
    "[Stale cells](#stale-cells) names the commits and files, and which stale cells describe code that no longer "
    "exists.", ""]

GROUP_NOTES = {
    "main": "The README's first command: DLG against FedeCouple's textbook one-step upload at round 0.",
    "round0": "Each attack against each method's upload at the initial weights (labels and proto read the real "
              "local training).",
    "trained": "The same attacks after 19 rounds of training, on 20 clients.",
    "malicious": "A malicious server's crafted downloads against clients of 10 (and 50) images.",
    "real": "fedavg-leak (FedProto: proto) against clients that train one epoch on N images, per method and N.",
    "audit": "`fedsec report --preset audit`: every method, image cell and round in one run (its table and Fig. 10 "
             "below).",
    "accuracy": "What each method gives the clients: mean client test accuracy over three seeds.",
    "mia": "LiRA against each method's models after 5 rounds of 5 local epochs.",
    "device": "The same work on one GPU and on one CPU thread.",
    "startup": "How long the command line takes to answer `--help`.",
    "secure": "A curious and a malicious server that see only each round's sum, and Flower's own SecAgg+.",
    "speed": "Our attacks' speed and strength beside another implementation, and batched against one by one.",
    "spear": "How much of a one-step batch a shared linear layer followed by ReLU gives back exactly, against the "
             "batch size (the picture: share exact and seconds against B).",
}


def render(records: dict[str, dict]) -> str:
    from reports.exposure import matrix_markdown, verdict_counts

    out = ["# Current results", "",
           "<!-- Generated by `python bench/results.py --render` from results/*.json: do not edit by hand. -->", "",
           "One value per cell, each written by the run that measured it: its command, the commit (*dirty*: the "
           "code had uncommitted changes), the machine and the seconds. Rerun a cell with `python bench/results.py "
           "--cell NAME` and render this page with `python bench/results.py --render`.", "", *HOW_TO_READ]
    matrix = page_matrix(records)
    counts = ", ".join(f"{w} {n}" for w, n in verdict_counts(matrix).items() if n)
    out += ["## Exposure matrix", "", MATRIX_NOTE, "", matrix_markdown(matrix, TRAINED_LABEL), "",
            f"Cells by verdict: {counts}.", ""]
    drawn = results_figures.markdown(results_figures.pictures(records, fig10_rows))
    # the pictures a cell's own run drew (kept under docs/img/results by ``run_cell``)
    kept = [f"![{cell.title}]({Path(target).relative_to('docs').as_posix()})" for cell in CELLS.values()
            if cell.name in records for _, target in cell.pictures
            if target.startswith("docs/img/results/") and (ROOT / target).exists()]
    if kept and not drawn:
        drawn = ["## Pictures", ""]
    out += drawn + [line for link in kept for line in (link, "")]
    details = []
    for group, title in GROUPS.items():
        out += [f"## {title}", "", GROUP_NOTES[group], "",
                "| cell | result | status | command | commit | machine | seconds |", "|---|---|---|---|---|---|---|"]
        for cell in (c for c in CELLS.values() if c.group == group):
            record = records.get(cell.name)
            if record is None:
                out.append(f"| {cell.name} | – | not measured (`python bench/results.py --cell {cell.name}`: "
                           f"{cell_text(cell.cost)}) | `{code_text(cell.command)}` | – | – | – |")
                continue
            seconds = "–" if record.get("seconds") is None else f"{record['seconds']:.0f}"
            out.append(f"| {cell.name} | {cell_text(record['figures']['headline'])} | "
                       f"{status_text(record, cell)} | `{code_text(record['command'])}` | "
                       f"{commit_text(record)} | {cell_text(machine_text(record['machine']))} | {seconds} |")
            details += _details(cell, record)
        out.append("")
    out += stale_section(records)
    out += ["## Details", "", "What each cell printed or tabulated, and the notes its record carries.", "", *details]
    out += SETTINGS
    return "\n".join(out).rstrip("\n") + "\n"


def with_sample_line(text: str, line: str) -> str:
    """``text`` with the main job's sample line (the ``text`` code block that starts with the main job's
    attack and method) replaced by ``line``."""
    pattern = re.compile(r"(```text\n)dlg on fedecouple \(.*?\n(```)")
    if not pattern.search(text):
        raise CellError("no sample line of the main job (a ```text block starting 'dlg on fedecouple (') found")
    return pattern.sub(lambda m: m.group(1) + line + "\n" + m.group(2), text, count=1)


def rendered_files(records: dict[str, dict]) -> dict[Path, str]:
    """Every file the records decide: the results page, and the sample line where the docs show it."""
    files = {PAGE: render(records)}
    main = records.get("main-job")
    if main and main["figures"].get("line"):
        for name in SAMPLE_LINE_FILES:
            files[ROOT / name] = with_sample_line((ROOT / name).read_text(encoding="utf-8"), main["figures"]["line"])
    return files


def _table(columns: list, rows: list) -> list[str]:
    return ["| " + " | ".join(cell_text(c) for c in columns) + " |", "|" + "---|" * len(columns),
            *["| " + " | ".join(cell_text(v) for v in row) + " |" for row in rows], ""]


PAIR = re.compile(rf"^({NUMBER}) \[({NUMBER}), ({NUMBER})\]")
REJUDGED = ("holds", "does not hold", "undetermined: the interval straddles", "undetermined (lower bound)")


def fig10_rows(f: dict) -> tuple[list[list[str]], list[str]]:
    """The audit record's Fig. 10 table with each paired verdict judged by the one rule
    (``reports.exposure.paired_verdict``: the stopped-short counts of each side from the audit's table), and
    per round the verdict on "FedeCouple leaks least"."""
    from reports.exposure import FAILS, HOLDS, paired_verdict
    from reports.fig10 import LEAKS_LEAST, claim_word

    from reports.exposure import Evidence, cell_threat, judge

    audit = {(r[0], r[1], r[2]): r for r in (f.get("table") or {}).get("rows") or []}
    stopped = {key: _checks(r[7])[1] for key, r in audit.items()}
    rows, claims = [], {}
    for r in f["fig10"]["rows"]:
        r = list(r)
        row = audit.get((r[1], r[2], r[0]))
        if " − " not in r[1] and row is not None:  # a method's own row: its verdict by the same rule
            value, low, high = _figure(r[4])
            wrong, short = _checks(row[7])
            unknown = re.search(rf"{re.escape(NO_MODEL)} (\d+)/", r[6])
            n = _count_of(row[3].split("(")[-1].rstrip(")"))
            word = judge(Evidence(method=r[1], threat=cell_threat(r[2], int(r[0])), source="", value=value, low=low,
                                  high=high, chance=float(row[5]), stopped_short=short, n_targets=n,
                                  mis_specified=wrong or 0, no_model=int(unknown.group(1)) if unknown else 0)).word
            flags = [x for x in r[6].split(", ") if x not in ("–", "LOWER BOUND")]
            flags += [f"{short}/{n} stopped short"] if short else []
            r[6] = "; ".join([word, *flags])
        if " − " in r[1]:
            a, b = r[1].split(" − ")
            m = PAIR.match(r[4])
            old = r[6]
            if m and (old.startswith(REJUDGED) or old.endswith(" leaks more") or " is a lower bound" in old):
                word, why = paired_verdict(m.group(2), m.group(3), a, b, stopped.get((a, r[2], r[0])),
                                           stopped.get((b, r[2], r[0])))
                if r[5] in ("–", "") and word in (HOLDS, FAILS):  # no claim: say which one leaks more
                    word = f"{a if word == HOLDS else b} leaks more"
                r[6] = f"{word}: {why}" if why else word
            if b == "fedecouple":
                claims.setdefault(r[0], {})[a] = r[6]
        rows.append(r)
    return rows, [f"Round {rnd}: {LEAKS_LEAST}: {claim_word(v)}" for rnd, v in claims.items()]


def _details(cell: Cell, record: dict) -> list[str]:
    f = record["figures"]
    extra = attack_details(f) if cell.figures is attack_figures else []
    if not (f.get("line") or f.get("table") or f.get("tables") or record.get("notes") or extra):
        return []
    lines = [f"### {cell.name}", "", f"{cell_text(cell.title)}.", ""]
    if f.get("line") and not f.get("tables"):
        lines += ["It printed:", "", "```text", f["line"], "```", ""]
    lines += [f"* {cell_text(x)}" for x in extra] + ([""] if extra else [])
    if f.get("table"):
        lines += _table(f["table"]["columns"], f["table"]["rows"])
    if f.get("fig10"):
        rows, claims = fig10_rows(f)
        lines += ["The FedeCouple paper's Fig. 10 (the report's section of that name: each method's headline cell, "
                  "then paired comparisons over the same clients' images; each verdict by the rule above, so a "
                  "comparison whose lower side stopped short is undetermined (lower bound)):", ""]
        lines += _table(f["fig10"]["columns"], rows) + [f"* {cell_text(c)}" for c in claims] + [""]
    for table in f.get("tables") or []:
        lines += [f"{cell_text(table['title'])}:", ""] + _table(table["columns"], table["rows"])
    if f.get("line") and f.get("tables"):  # the whole print-out stays in the record, folded away here
        lines += ['<details markdown="1"><summary>The whole print-out</summary>', "", "```text", f["line"], "```", "",
                  "</details>", ""]
    lines += [f"* {cell_text(note)}" for note in record.get("notes", [])]
    return lines + ([""] if record.get("notes") else [])


SETTINGS = ["## Settings and sources", "",
            "* Rounding: the same command repeats bit for bit on the same machine with the same thread count; "
            "across CPUs an attack's optimisation can end elsewhere, so compare machines by the intervals.",
            "",
            "The settings behind each group, unless a command says otherwise: mnist5k (5,000 real MNIST "
            "digits), pathological partition with 3 classes per client, seed 0, the paper's 28×28 CNN without "
            "padding (`cnn28`), SGD with lr 0.05 and batches of 10, one thread.",
            "",
            "* **The main job and round 0**: 10 clients; the attacked clients train one local step on one image "
            "at the federation's initial weights (the textbook setting); the server knows the hyperparameters "
            "and the classifier, and replays each method's own local training. `labels` and `proto` attack the "
            "clients' real local training.",
            "* **The trained round**: 20 clients trained for 19 rounds, then the attacked clients take the "
            "textbook step on the trained model.",
            "* **Malicious server**: clients of exactly 10 (and 50) training images on their real local "
            "training; the server crafts the attacked clients' download at round 0 (fishing: round 1, from the "
            "label counts it read at round 0).",
            "* **Real local training**: one-round federations of 10 clients of exactly N images, one epoch in "
            "batches of 10, 4 clients attacked, every image they trained on rebuilt.",
            "* **The audit preset**: 20 clients, 20 rounds, attacks at round 0 and round 19 (see the attacks "
            "page for its cells).",
            "* **Accuracy**: 20 clients, 5 rounds of 1 local epoch, three seeds; the mean over clients of each "
            "client's test accuracy after the last round, mean ± sample std over seeds.",
            "* **Membership inference**: 20 clients, 5 rounds of 5 local epochs, 4 reference federations; LiRA "
            "(online, global variance) per model; members 3,740, non-members 1,260.",
            "* **Devices**: one FedeCouple round of 10 clients and batched IG on 16 one-step targets (50 Adam "
            "steps), images per second on each device of one machine.",
            "",
            "The attacks, by the papers they follow: DLG (*Deep Leakage from Gradients*), iDLG (*iDLG: Improved "
            "Deep Leakage from Gradients*), IG (*Inverting Gradients — How easy is it to break privacy in "
            "federated learning?*), fedavg-leak (*Data Leakage in Federated Averaging*), trap/binning (*When the "
            "Curious Abandon Honesty: Federated Learning Is Not Private*; *Robbing the Fed: Directly Obtaining "
            "Private Data in Federated Learning with Modified Models*), fish (*Fishing for User Data in "
            "Large-Batch Federated Learning via Gradient Magnification*), LiRA (*Membership Inference Attacks From "
            "First Principles*). The methods: *FedeCouple: Fine-Grained "
            "Balancing of Global-Generalization and Local-Adaptability in Federated Learning*, FedPer "
            "(*Federated Learning with Personalization Layers*), FedRep (*Exploiting Shared Representations "
            "for Personalized Federated Learning*), FedPAC (*Personalized Federated Learning with Feature "
            "Alignment and Classifier Collaboration*), FedProto (*FedProto: Federated Prototype Learning across "
            "Heterogeneous Clients*). Each topic page explains its cells: [attacks](attacks.md), "
            "[malicious server](malicious-server.md), [real local training](real-training.md), "
            "[devices](devices.md).", ""]


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", help="a cell name, several comma-separated, or all")
    parser.add_argument("--render", action="store_true", help="write docs/results.md from results/*.json")
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/results.md differs from --render's")
    parser.add_argument("--list", action="store_true", help="list the cells")
    parser.add_argument("--keep", type=Path, help="with --cell: also copy each run's folder to KEEP/<cell>")
    args = parser.parse_args(argv)
    try:
        if not (args.cell or args.render or args.check or args.list):
            raise CellError("nothing to do: give --cell NAME, --render, --check or --list")
        if args.keep is not None and not args.cell:
            raise CellError("--keep keeps the folders of the cells --cell runs: give --cell NAME too")
        if args.list:
            for cell in CELLS.values():
                print(f"{cell.name:24} {cell.cost:40} {cell.command}")
        for cell in select(args.cell) if args.cell else []:
            run_cell(cell, keep=args.keep)
        if args.render or args.check:
            if not git_available():
                raise CellError("rendering needs git (the commits decide which cells are stale)")
            records = load_records()
            files = rendered_files(records)
            stale = [path for path, text in files.items()
                     if not path.exists() or path.read_text(encoding="utf-8") != text]
            if args.check:
                if stale:
                    print(f"{', '.join(str(p.relative_to(ROOT)) for p in stale)} out of step with results/*.json: "
                          f"run 'python bench/results.py --render'", file=sys.stderr)
                    return 1
            else:
                for path in stale:
                    write_atomic(path, files[path])
                results_figures.write(results_figures.pictures(records, fig10_rows), PAGE.parent)
                print(f"rendered from {len(records)} records; rewrote "
                      f"{', '.join(str(p.relative_to(ROOT)) for p in stale) or 'nothing (all in step)'}")
    except CellError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
