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
changed the code it depends on (``git log`` of the cell's paths) is shown as **stale**. Records
carried from an earlier measurement say so (``source``) and keep the commit of that measurement.
Unknown cell names and cells this machine cannot run end with a one-line error and exit status 2.
"""
from __future__ import annotations

import argparse
import csv
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
    """One value for an attack cell: the mean PSNR with its interval, the priors, the share recovered,
    and the forward-model check's counts, NO MODEL included (or the class-presence accuracy of the label
    attack)."""
    if f.get("class_presence_accuracy") is not None and f.get("mean_psnr") is None:
        return f"class-presence accuracy {f['class_presence_accuracy']:.2f}"
    parts = [f"{f['mean_psnr']:.2f} dB{_interval(f.get('mean_psnr_ci'))}",
             f"prior {f['mean_prior_psnr']:.2f}" + (f", class prior {f['mean_class_prior_psnr']:.2f}"
                                                   if f.get("mean_class_prior_psnr") is not None else "")]
    text = f"{parts[0]} ({parts[1]})"
    if f.get("success_rate") is not None:
        text += f"; recovered {_pct(f['success_rate'])}{_interval(f.get('success_rate_ci'), 0, 100)}"
    if f.get("inputs_exact_share") is not None:
        text += f"; inputs exact {_pct(f['inputs_exact_share'])}"
    if f.get("fishing_success_share") is not None:
        text += f"; fished image rebuilt in {_pct(f['fishing_success_share'])} of attacked client-rounds"
    text += f"; n = {f['n_images']} images over {f['n_targets']} targets"
    checks = []
    if f.get("mis_specified_targets"):
        checks.append(f"{f['mis_specified_targets']} mis-specified")
    if f.get("not_converged_targets"):
        checks.append(f"{f['not_converged_targets']} stopped short")
    if f.get("model_unknown_targets"):  # the server holds no model of these clients: a surrogate's estimate
        checks.append(f"{f['model_unknown_targets']} {NO_MODEL}")
    return text + (f" ({', '.join(checks)})" if checks else "")


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
    best = max(table, key=lambda r: float(r[1].split(" ")[0]))
    return {"headline": f"best {best[0]} {best[1]} %; " + ", ".join(f"{r[0]} {r[1].split(' ')[0]}" for r in table),
            "table": {"columns": ["method", "accuracy % (mean ± std over seeds)", "client std", "seeds"], "rows": table}}


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
    """The report's ``malicious.csv``: per method, client size and download check, the share rebuilt."""
    def share(value):
        return "–" if value in ("", None) else _pct(float(value))

    table = []
    for r in _csv(out, "runs/*/malicious.csv"):
        if r["status"] != "done":
            table.append([r["method"], r["train_images"], r["download_check"], f"{r['status']}: {r['reason']}",
                          "", "", "", ""])
            continue
        refused = (f"{r['crafted_refused']}/{r['crafted_downloads']} / {r['honest_refused']}/{r['honest_downloads']}"
                   if r["crafted_downloads"] else "–")
        table.append([r["method"], r["train_images"], r["download_check"], share(r["recovered_share"]),
                      share(r["rebuilt_30db_share"]),
                      f"{_num(r['mean_psnr'])} ({_num(r['prior_psnr'])})" if r["mean_psnr"] else "nothing rebuilt",
                      share(r["inputs_exact_share"]), refused])
    off = [row for row in table if row[2] == "off" and row[4]]
    return {"headline": "check off: " + ", ".join(f"{row[0]} N = {row[1]} {row[3]} recovered" for row in off),
            "table": {"columns": ["method", "N", "check", "recovered (≥ prior + 6 dB)", "≥ 30 dB", "mean PSNR dB (prior)",
                                  "inputs exact", "crafted / honest refused"], "rows": table}}


def mia_figures(out: Path, stdout: str) -> dict:
    """``fedsec mia``'s ``summary.json``: LiRA's AUC and TPR at 1 % FPR per attacked model."""
    summary = json.loads(next(out.glob("runs/*/summary.json")).read_text(encoding="utf-8"))
    rows = []
    for target, info in summary["targets"].items():
        lira = info.get("attacks", {}).get("lira", {}) if info.get("available") else {}
        if "auc" in lira:
            tpr = lira.get("tpr_at_1pct_fpr")
            rows.append([target, f"{lira['auc']:.3f}", f"{tpr:.3f}" if isinstance(tpr, float) else "refused"])
        else:
            rows.append([target, "none", "none"])
    personal = next((r for r in rows if r[0] == "personal"), ["personal", "none", "none"])
    return {"headline": f"accuracy {summary['target_accuracy']:.4f}; personal models LiRA AUC {personal[1]}, "
                        f"TPR at 1 % FPR {personal[2]}",
            "table": {"columns": ["model", "LiRA AUC", "TPR at 1 % FPR"], "rows": rows}}


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


# the lines of bench/secure_malicious.py that answer its questions: binning on one client of 100 images and
# through the sum at the default quantisation, the inconsistency attack's images, the check's decisions
MALICIOUS_PHRASES = ("sized      craft,  1 x 100", "secure, quantization_range 2**22 ", "target's images, n =",
                     "isolate, SecAgg, 10 clients, check on", "honest server, SecAgg, 10 clients, check on")


WARNING_LINE = re.compile(r"^\S+:\d+: \w*Warning: ")


def printed_figures(*phrases: str) -> Callable[[Path, str], dict]:
    """A bench that prints its figures: the whole print-out (shown under the cell's details) and, as the
    headline, its lines that hold one of ``phrases``."""
    def figures(out: Path, stdout: str) -> dict:
        # a library's warning names a file of this machine's environment: not a figure, left out
        lines = [line.rstrip() for line in stdout.splitlines()
                 if line.strip() and not WARNING_LINE.match(line) and line.strip() != "warnings.warn("]
        picked = [line.strip() for line in lines if any(p in line for p in phrases)]
        if not picked:
            raise CellError(f"the bench printed none of: {', '.join(phrases)}")
        return {"headline": "; ".join(picked), "line": "\n".join(lines)}

    return figures


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
}


def _attack_cells() -> list[Cell]:
    cells = [Cell("main-job", "main", "DLG on FedeCouple (the README's first command)", MAIN, attack_figures,
                  "about 2-4 min", pictures=(("runs/attack-dlg-fedecouple/reconstructions.png", "docs/img/main-job.png"),))]
    plan = [("dlg", ("fedper", "fedpac")), ("ig", ("fedecouple", "fedper", "fedpac")), ("proto", ("fedpac", "fedproto")),
            ("labels", ("fedecouple", "fedpac", "fedproto"))]
    for attack, methods in plan:
        for method in methods:
            cells.append(Cell(f"{attack}-{method}-r0", "round0", f"{attack} on {method}",
                              ("fedsec", "attack", attack, "--method", method, "--targets", "8", "--threads", "1"),
                              attack_figures, "1-5 min"))
    for attack, methods in [("dlg", ("fedecouple", "fedper", "fedpac")), ("ig", ("fedecouple", "fedper", "fedpac")),
                            ("proto", ("fedpac", "fedproto")), ("labels", ("fedecouple", "fedpac", "fedproto"))]:
        for method in methods:
            cells.append(Cell(f"{attack}-{method}-r19", "trained", f"{attack} on {method}",
                              ("fedsec", "attack", attack, "--method", method, *TRAINED, "--targets", "8",
                               "--threads", "1"), attack_figures, "3-15 min (20 rounds of training first)"))
    return cells


def _other_cells() -> list[Cell]:
    cells = [
        Cell("trap-fedavg-n10", "malicious", "trap weights (binning) on FedAvg, clients of 10 images",
             ("fedsec", "attack", "trap", "--method", "fedavg", "--victim-batch", "0", "--train-images", "10",
              "--targets", "4", "--threads", "1"), attack_figures, "about 1-2 min"),
        Cell("fish-fedavg-n10", "malicious", "classifier fishing on FedAvg, clients of 10 images, round 1",
             ("fedsec", "attack", "fish", "--method", "fedavg", "--victim-batch", "0", "--train-images", "10",
              "--targets", "10", "--attack-rounds", "1", "--threads", "1"), attack_figures, "about 1-2 min"),
    ]
    for method in ("fedavg", "fedper", "fedpac", "fedecouple", "fedproto"):
        cells.append(Cell(f"n-curve-{method}", "real", f"{method}: fedavg-leak (FedProto: proto) against N",
                          ("python", "bench/n_curve.py", "--methods", method, "--sizes", "4,10,25,50,100,180",
                           "--out", "n_curve.csv"), n_curve_figures,
                          "hours (N = 50-180 at the default budget)", depends=CODE + ("bench/n_curve.py",)))
    cells.append(Cell("audit-preset", "audit", "fedsec report --preset audit", ("fedsec", "report", "--preset", "audit",
                                                                                "--out", "runs/audit"),
                      audit_figures, "about 28 min", depends=CODE + ("reports",)))
    cells.append(Cell("malicious-table", "malicious", "trap against clients of 10 and 50 images, the download check off and on",
                      ("fedsec", "report", "--methods", "fedavg,fedper,fedpac,fedecouple,fedproto", "--attacks", "trap",
                       "--malicious-sizes", "10,50", "--targets", "4", "--seed", "0", "--threads", "1", "--out",
                       "runs/report-trap"), malicious_figures, "about 13 min", depends=CODE + ("reports",)))
    for method in ("fedecouple", "fedper", "fedpac", "fedavg", "fedproto", "local"):
        cells.append(Cell(f"mia-{method}", "mia", f"membership inference on {method}",
                          ("fedsec", "mia", "--method", method, "--clients", "20", "--rounds", "5", "--local-epochs", "5",
                           "--reference-runs", "4", "--threads", "1", "--out", f"runs/mia-{method}"), mia_figures,
                          "3-10 min"))
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
                      printed_figures("round histogram exact", "PSNR - prior per image", "label counts exact:",
                                      "paired difference"), "about 10 min",
                      depends=CODE + ("bench/secure_curious.py",)))
    cells.append(Cell("secure-malicious", "secure", "a malicious server through secure aggregation: binning through "
                      "the sum, model inconsistency, the consistency check",
                      ("python", "bench/secure_malicious.py"), printed_figures(*MALICIOUS_PHRASES), "about 10 min",
                      depends=CODE + ("defenses", "bench/secure_malicious.py")))
    cells.append(Cell("flower-secagg", "secure", "Flower's SecAgg+ recorded and attacked: 10 nodes, 3 rounds",
                      ("python", "bench/flower_secagg.py"),
                      printed_figures("aggregate vs true", "uniformity", "sum-labels: histogram exact"),
                      "about 2-4 min", depends=CODE + ("bench/flower_secagg.py", "examples/flower_secagg")))
    cells.append(Cell("vs-breaching", "speed", "our IG beside breaching's IG: the same model, gradient and 1000 "
                      "iterations, one start, 8 photographs (breaching 0.1.2 installed beside the pinned torch)",
                      ("python", "bench/vs_breaching.py", "--images", "8", "--threads", "1"),
                      printed_figures("mean: ours", "ratio"), "about 2 min",
                      depends=CODE + ("bench/vs_breaching.py",)))
    cells.append(Cell("batched-ig", "speed", "IG on 16 targets of one model, batched ÷ one by one",
                      ("python", "bench/batched_attack.py", "--attacks", "ig"), printed_figures("throughput ratio"),
                      "about 1 min", depends=CODE + ("bench/batched_attack.py", "bench/attack_speed.py")))
    cells.append(Cell("leak-small-clients", "speed", "fedavg-leak on FedAvg's smallest clients: 6 images, batches of "
                      "2, one epoch, 4 targets",
                      ("fedsec", "attack", "fedavg-leak", "--method", "fedavg", "--partition", "weak",
                       "--samples-per-client", "6", "--batch-size", "2", "--local-epochs", "1", "--targets", "4"),
                      attack_figures, "about 5 min"))
    cells.append(Cell("cli-start", "startup", "fedsec --help and every command's --help, each a new process",
                      ("python", "bench/cli_start.py", "--runs", "5"), start_figures, "about 10 s",
                      depends=("fedsec", "bench/cli_start.py")))
    cells.append(Cell("device-gpu", "device", "GPU ÷ CPU: one FedeCouple round and batched IG (16 targets)",
                      ("python", "bench/device.py", "--threads", "1", "--ig-iterations", "50"), device_figures,
                      "about 2 min on a GPU machine", depends=CODE + ("bench/device.py",), needs_gpu=True))
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
    gpu = None
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu}


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
        figures = cell.figures(Path(tmp), "".join(lines))
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
    if git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        return f"commit {commit[:7]} is not in this history"
    changed = git("log", "-1", "--format=%h", f"{commit}..HEAD", "--", *cell.depends).stdout.strip()
    return f"the code it depends on changed after it (last in {changed})" if changed else None


def cell_text(text) -> str:
    """A Markdown table cell: HTML escaped, no pipes or line breaks."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def code_text(text) -> str:
    """A command inside a code span of a table cell: Markdown escapes the span itself; only pipes and
    backticks would break it."""
    return str(text).replace("`", "'").replace("|", "\\|").replace("\n", " ")


def machine_text(m: dict) -> str:
    text = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
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
        return f"**stale**: {stale}" + ("; carried" if carried else "")
    return "carried" if carried else "current"


def render(records: dict[str, dict]) -> str:
    out = ["# Current results", "",
           "<!-- Generated by `python bench/results.py --render` from results/*.json: do not edit by hand. -->", "",
           "One value per cell, each written by the run that measured it: its command, the commit (*dirty*: the "
           "code had uncommitted changes), the machine and the seconds. A cell is **stale** when the code it "
           "depends on changed after the commit it was measured at; *carried* cells keep an earlier measurement "
           "with the commit it was made at (these runs take hours on two CPU cores, or need a GPU). Rerun a cell "
           "with `python bench/results.py --cell NAME` and render this page with `python bench/results.py "
           "--render`. What each figure means is [below](#how-to-read-these-figures).", ""]
    details = []
    for group, title in GROUPS.items():
        out += [f"## {title}", "", "| cell | result | status | command | commit | machine | seconds |",
                "|---|---|---|---|---|---|---|"]
        for cell in (c for c in CELLS.values() if c.group == group):
            record = records.get(cell.name)
            if record is None:
                out.append(f"| {cell.name} | – | not measured (`python bench/results.py --cell {cell.name}`: "
                           f"{cell_text(cell.cost)}) | `{code_text(cell.command)}` | – | – | – |")
                continue
            seconds = "–" if record.get("seconds") is None else f"{record['seconds']:.0f}"
            out.append(f"| {cell.name} | {cell_text(record['figures']['headline'])} | "
                       f"{cell_text(status_text(record, cell))} | `{code_text(record['command'])}` | "
                       f"{commit_text(record)} | {cell_text(machine_text(record['machine']))} | {seconds} |")
            details += _details(cell, record)
        out.append("")
    out += ["## Details", "", "What each cell printed or tabulated, and the notes its record carries.", "", *details]
    out += EXPLANATIONS
    return "\n".join(out).rstrip("\n") + "\n"


def with_sample_line(text: str, line: str) -> str:
    """``text`` with the main job's sample line (the ``text`` code block that starts with the main job's
    attack and method) replaced by ``line``."""
    import re

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


def _details(cell: Cell, record: dict) -> list[str]:
    f = record["figures"]
    if not (f.get("line") or f.get("table") or record.get("notes")):
        return []
    lines = [f"### {cell.name}", "", f"{cell_text(cell.title)}.", ""]
    if f.get("line"):
        lines += ["It printed:", "", "```text", f["line"], "```", ""]
    for table in (f.get("table"), f.get("fig10")):
        if not table:
            continue
        if table is f.get("fig10"):
            lines += ["The FedeCouple paper's Fig. 10 (the report's section of that name: each method's headline "
                      "cell, then paired comparisons over the same clients' images):", ""]
        lines += ["| " + " | ".join(cell_text(c) for c in table["columns"]) + " |",
                  "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(cell_text(v) for v in row) + " |" for row in table["rows"]]
        lines.append("")
    lines += [f"* {cell_text(note)}" for note in record.get("notes", [])]
    return lines + ([""] if record.get("notes") else [])


EXPLANATIONS = ["## How to read these figures", "",
                "* **PSNR** (dB) compares a reconstruction with the image the client trained on, per image, on "
                "pixels in [0, 1] (10·log10 of 1 over the mean squared error). About 12 dB is what a grey blur "
                "scores on a digit (the data set's mean image); at 17–20 dB the digit is recognisable under speckle "
                "noise (the main job's picture); at 30 dB and above it is a clean copy.",
                "* **prior** is that non-informative guess (the data set's mean image) scored the same way; "
                "**class prior** is the mean image of the right class, from data the server could hold. Leakage "
                "means above the prior, and an image counts as **recovered** at prior + 6 dB.",
                "* **[a, b]** is a 95 % interval that resamples the attacked clients (images of one client are not "
                "independent); n is the number of images scored.",
                "* **stopped short**: the attack's own objective prefers the truth to its reconstruction, so the "
                "optimiser, not the method, set the number: a lower bound on leakage. **mis-specified**: the "
                "objective prefers the reconstruction, so the attack models the client wrongly and the number says "
                "nothing about privacy.",
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
                "Large-Batch Federated Learning via Gradient Magnification*). The methods: *FedeCouple: Fine-Grained "
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
            files = rendered_files(load_records())
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
                print(f"rendered from {len(load_records())} records; rewrote "
                      f"{', '.join(str(p.relative_to(ROOT)) for p in stale) or 'nothing (all in step)'}")
    except CellError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
