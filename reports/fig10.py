"""The report's "Fig. 10: leakage by method" section: pure tables from the report's per-round rows and
per-image results (frames in, Markdown, HTML and a CSV frame out; nothing touches the disk).

The FedeCouple paper's Fig. 10 ranks the methods by the mean PSNR a gradient-inversion attack reaches:
FedeCouple leaks least, FedPer more than FedAvg, FedPAC and FedProto more than FedeCouple. Here each
method's figure is its mean PSNR in the report's headline image cell (``ig@textbook`` in the audit
preset; where a method has no such cell, the first image cell the report ran for it, e.g. ``proto``
for FedProto) per attacked round, and each claim is judged on a paired comparison: the same clients'
same images (round, client, image) attacked under both methods (the report trains every method on the
same partition and seed and attacks the same clients), the mean PSNR difference with a 95 % interval
over the attacked clients (images of one client are not independent).

A claim "A leaks more than B" holds where the interval lies above 0 and does not hold where it lies
below; it stays undetermined where the interval straddles 0 or is missing (too few clients), where
either side's attack was MIS-SPECIFIED or lacked the model the client trained (the server holds none),
and where the two methods were measured by different cells (nothing to pair). Where the side the
interval puts lower, the side said to leak less, stopped short on some client (its optimiser ended with
its objective above the truth's), the comparison is "undetermined (lower bound)", never "holds": that
side's true leakage may be higher, so the order could flip (``reports.exposure.paired_verdict``, the
exposure matrix's rule). A higher side that stopped short changes nothing: its true figure is higher
still. Each method's own row carries its exposure verdict by the same rule (``reports.exposure.judge``).

Input rows: ``by_round`` (``fedsec.jobs.report.tables.leakage_by_round``: method, attack, round, n_images,
n_targets, mean_psnr, mean_psnr_ci_low/high, prior_psnr, mis_specified_targets, not_converged_targets
(the targets whose optimiser stopped short) and, where recorded, ``model_unknown_targets``) and
``results`` (one row per scored image: method, attack, round, client, image, psnr, mis_specified,
model_unknown)."""
from __future__ import annotations

import html
import math
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from . import exposure
from .comparison import html_table, md_table
from .formatting import NO_MODEL, finite_or_none, interval_text, is_true

HEADLINE_CELL = "ig@textbook"  # the audit preset's headline image attack: 16 clients, one SGD step on 2 images
ANCHORS = ("fedecouple", "fedavg")  # the methods every other method is compared against
# the paper's claims, as (A, B): "A leaks more than B"; every method against FedeCouple is "FedeCouple leaks least"
CLAIMS = {("fedper", "fedavg"): "FedPer > FedAvg", ("fedpac", "fedecouple"): "FedPAC > FedeCouple",
          ("fedproto", "fedecouple"): "FedProto > FedeCouple"}
LEAKS_LEAST = "FedeCouple leaks least"
HOLDS, FAILS, UNDETERMINED = exposure.HOLDS, exposure.FAILS, exposure.UNDETERMINED
COLUMNS = ["kind", "round", "method", "versus", "cell", "n", "n_targets", "mean", "ci_low", "ci_high", "prior_psnr",
           "lower_bound", "stopped_short_targets", "mis_specified_targets", "model_unknown_targets", "claim", "verdict"]
NOTE = ("The FedeCouple paper's Fig. 10 (mean PSNR under a gradient-inversion attack): FedeCouple leaks least, "
        "FedPer more than FedAvg, FedPAC and FedProto more than FedeCouple. First each method's mean PSNR per attacked "
        "round in the report's headline image cell, with its 95 % interval and n images (clients); then paired "
        "comparisons against FedeCouple and against FedAvg over the same clients' same images: the mean PSNR "
        "difference A − B with a 95 % interval over the attacked clients. Each method's row carries its exposure "
        "verdict (EXPOSED, LOWER BOUND, NOT SHOWN, NO MODEL, n/a: the rule of the exposure matrix). A claim holds "
        "where the interval lies above 0, does not hold where it lies below, and is undetermined where it straddles "
        "0, where either attack was MIS-SPECIFIED or the server lacks the client's model (NO MODEL), or where the "
        "methods were measured by different cells. Where the side the interval puts lower (the side said to leak "
        "less) stopped short on some client, it is undetermined (lower bound): that side's true leakage may be "
        "higher, so a lower bound never makes a claim hold.")
Interval = Callable[[np.ndarray, np.ndarray], "Sequence[float] | None"]


def student_t_interval(differences: np.ndarray, clusters: np.ndarray, confidence: float = 0.95):
    """Student's t interval for the mean of per-cluster (per-client) means of ``differences``;
    None with fewer than two clusters."""
    from scipy.stats import t as student_t

    _, inverse = np.unique(np.asarray(clusters), return_inverse=True)
    means = np.bincount(inverse, weights=np.asarray(differences, dtype=float)) / np.bincount(inverse)
    if len(means) < 2:
        return None
    centre, se = float(means.mean()), float(means.std(ddof=1) / math.sqrt(len(means)))
    half = float(student_t.ppf(0.5 + confidence / 2, len(means) - 1)) * se
    return centre - half, centre + half


def cell_of(by_round: pd.DataFrame, method: str, preferred: str = HEADLINE_CELL) -> str | None:
    """The cell that stands for ``method``: ``preferred`` where it measured the method, else the first
    image cell (in the report's order) that did; None where none did."""
    cells = list(dict.fromkeys(by_round.loc[by_round["method"] == method, "attack"]))
    return preferred if preferred in cells else (cells[0] if cells else None)


def _flag_count(row: Mapping, column: str) -> int:
    number = finite_or_none(row.get(column))
    return 0 if number is None else int(number)


def _recorded_count(row: Mapping, column: str) -> int | None:
    """A count that may be missing (None: not recorded, which is not 0)."""
    number = finite_or_none(row.get(column))
    return None if number is None else int(number)


def method_verdict(row: Mapping) -> str:
    """A method row's exposure verdict (``reports.exposure.judge``): EXPOSED, LOWER BOUND, NOT SHOWN, NO MODEL
    or n/a."""
    return exposure.judge(exposure.Evidence(
        method=str(row["method"]), threat=exposure.cell_threat(str(row["cell"]), int(row["round"])),
        source=str(row["cell"]), value=finite_or_none(row["mean"]), low=finite_or_none(row["ci_low"]),
        high=finite_or_none(row["ci_high"]), chance=finite_or_none(row["prior_psnr"]),
        stopped_short=row["stopped_short_targets"], n_targets=row["n_targets"],
        no_model=row["model_unknown_targets"], mis_specified=row["mis_specified_targets"])).word


def method_rows(by_round: pd.DataFrame, methods: Iterable[str], preferred: str = HEADLINE_CELL) -> list[dict]:
    """One row per method and attacked round: its cell's mean PSNR, interval, n, prior and flags."""
    out = []
    for m in methods:
        cell = cell_of(by_round, m, preferred)
        if cell is None:
            continue
        for r in by_round[(by_round["method"] == m) & (by_round["attack"] == cell)].to_dict("records"):
            row = {"kind": "method", "round": int(r["round"]), "method": m, "versus": "", "cell": cell,
                   "n": int(r["n_images"]), "n_targets": int(r["n_targets"]), "mean": r["mean_psnr"],
                   "ci_low": r.get("mean_psnr_ci_low"), "ci_high": r.get("mean_psnr_ci_high"),
                   "prior_psnr": r.get("prior_psnr"),
                   "stopped_short_targets": _recorded_count(r, "not_converged_targets"),
                   "mis_specified_targets": _flag_count(r, "mis_specified_targets"),
                   "model_unknown_targets": _flag_count(r, "model_unknown_targets"), "claim": ""}
            row["verdict"] = method_verdict(row)
            row["lower_bound"] = row["verdict"] == exposure.LOWER_BOUND
            out.append(row)
    return sorted(out, key=lambda r: r["round"])


def comparison_pairs(methods: Sequence[str]) -> list[tuple[str, str, str]]:
    """(A, B, the paper's claim that A leaks more than B, or "") for every method against FedeCouple
    and every other method against FedAvg, among ``methods``."""
    pairs = []
    for anchor in ANCHORS:
        if anchor not in methods:
            continue
        for m in methods:
            if m == anchor or (anchor == "fedavg" and m == "fedecouple"):  # that pair is FedAvg vs FedeCouple
                continue
            claims = [LEAKS_LEAST] if anchor == "fedecouple" else []
            claims += [CLAIMS[(m, anchor)]] if (m, anchor) in CLAIMS else []
            pairs.append((m, anchor, "; ".join(claims)))
    return pairs


def paired_difference(results: pd.DataFrame, a: str, b: str, cell: str, rnd: int, interval: Interval,
                      cap: float = 100.0) -> dict:
    """A − B over the images both methods' attacks scored in ``cell`` at round ``rnd``, paired by
    (client, image): n pairs, clients, the mean PSNR difference (PSNR capped at ``cap``) and its interval."""
    sel = results[(results["attack"] == cell) & (results["round"] == rnd)]
    key = ["client", "image"]
    both = sel[sel["method"] == a].merge(sel[sel["method"] == b], on=key, suffixes=("_a", "_b"))
    diff = both["psnr_a"].clip(upper=cap).to_numpy(float) - both["psnr_b"].clip(upper=cap).to_numpy(float)
    if not len(diff):
        return {"n": 0, "n_targets": 0, "mean": None, "ci": None}
    ci = interval(diff, both["client"].to_numpy())
    return {"n": len(diff), "n_targets": int(both["client"].nunique()), "mean": float(diff.mean()),
            "ci": None if ci is None else (float(ci[0]), float(ci[1]))}


def judge(d: dict, a: dict, b: dict) -> tuple[str, str]:
    """(verdict, why) of "``a`` leaks more than ``b``" from their paired difference ``d`` and their
    method rows (flags): holds / does not hold / undetermined."""
    for side in (a, b):
        if side["mis_specified_targets"]:
            return UNDETERMINED, (f"MIS-SPECIFIED on {side['method']} "
                                  f"({side['mis_specified_targets']}/{side['n_targets']} clients)")
        if side["model_unknown_targets"]:
            return UNDETERMINED, (f"NO MODEL on {side['method']}: the server lacks its clients' model, the figure "
                                  f"is an estimate ({side['model_unknown_targets']}/{side['n_targets']} clients)")
    if a["cell"] != b["cell"]:
        return UNDETERMINED, f"different cells ({a['cell']} vs {b['cell']}): nothing to pair"
    if not d["n"]:
        return UNDETERMINED, "no image attacked under both"
    if d["ci"] is None:
        return UNDETERMINED, "too few clients for an interval"
    low, high = d["ci"]
    return exposure.paired_verdict(low, high, a["method"], b["method"], a["stopped_short_targets"],
                                   b["stopped_short_targets"])


def fig10_frame(by_round: pd.DataFrame, results: pd.DataFrame, methods: Sequence[str],
                interval: Interval = student_t_interval, preferred: str = HEADLINE_CELL,
                cap: float = 100.0) -> pd.DataFrame:
    """The section's rows (``COLUMNS``): per method and round (kind "method"), then per compared pair
    and round (kind "paired": ``mean`` is A − B in dB, ``n`` the pairs, ``claim`` the paper's, ``verdict``
    holds / does not hold / undetermined with why; without a claim, which one leaks more)."""
    rows = method_rows(by_round, methods, preferred)
    side = {(r["method"], r["round"]): r for r in rows}
    for rnd in sorted({r["round"] for r in rows}):
        for a, b, claim in comparison_pairs([m for m in methods if (m, rnd) in side]):
            ra, rb = side[(a, rnd)], side[(b, rnd)]
            d = paired_difference(results, a, b, ra["cell"], rnd, interval, cap) if ra["cell"] == rb["cell"] \
                else {"n": 0, "n_targets": 0, "mean": None, "ci": None}
            verdict, why = judge(d, ra, rb)
            if not claim and verdict in (HOLDS, FAILS):  # no claim: say which one leaks more
                verdict = f"{a if verdict == HOLDS else b} leaks more"
            low, high = d["ci"] or (None, None)
            cell = ra["cell"] if ra["cell"] == rb["cell"] else f"{ra['cell']} vs {rb['cell']}"
            rows.append({"kind": "paired", "round": rnd, "method": a, "versus": b, "cell": cell, "n": d["n"],
                         "n_targets": d["n_targets"], "mean": d["mean"], "ci_low": low, "ci_high": high,
                         "prior_psnr": None, "lower_bound": None, "stopped_short_targets": None,
                         "mis_specified_targets": None,
                         "model_unknown_targets": None, "claim": claim,
                         "verdict": f"{verdict}: {why}" if why else verdict})
    frame = pd.DataFrame(rows, columns=COLUMNS)
    counts = ["round", "n", "n_targets", "stopped_short_targets", "mis_specified_targets", "model_unknown_targets"]
    return frame.astype({c: "Int64" for c in counts})  # whole numbers in fig10.csv, blank where a row has none


def _flags(r: Mapping) -> str:
    """A method row's exposure verdict, then the checks behind it."""
    words = [f"MIS-SPECIFIED {r['mis_specified_targets']}/{r['n_targets']}"] if r["mis_specified_targets"] else []
    words += [f"{NO_MODEL} {r['model_unknown_targets']}/{r['n_targets']}"] if r["model_unknown_targets"] else []
    stopped = finite_or_none(r.get("stopped_short_targets"))
    words += [f"{stopped:.0f}/{r['n_targets']} stopped short"] if stopped else []
    verdict = str(r.get("verdict") or "") or ("LOWER BOUND" if is_true(r["lower_bound"]) else "")
    return "; ".join(x for x in [verdict, ", ".join(words)] if x) or "–"


def _number(value, digits: int = 2, sign: bool = False) -> str:
    number = finite_or_none(value)
    return "–" if number is None else f"{number:+.{digits}f}" if sign else f"{number:.{digits}f}"


METHOD_HEADER = ["round", "method", "cell", "mean PSNR dB [95 % interval]", "prior", "n images (clients)",
                 "verdict; flags"]
PAIRED_HEADER = ["round", "A − B", "cell", "n pairs (clients)", "mean difference dB [95 % interval]",
                 "paper's claim", "verdict"]


def table_rows(frame: pd.DataFrame) -> tuple[list[list[str]], list[list[str]]]:
    """(per-method lines, paired lines) as plain strings (``METHOD_HEADER``, ``PAIRED_HEADER``)."""
    methods, paired = [], []
    for r in frame.to_dict("records"):
        if r["kind"] == "method":
            methods.append([str(r["round"]), r["method"], r["cell"],
                            f"{_number(r['mean'])}{interval_text(r['ci_low'], r['ci_high'])}",
                            _number(r["prior_psnr"]), f"{r['n']} ({r['n_targets']})", _flags(r)])
        else:
            mean = "–" if finite_or_none(r["mean"]) is None else \
                f"{_number(r['mean'], sign=True)}{interval_text(r['ci_low'], r['ci_high'])}"
            paired.append([str(r["round"]), f"{r['method']} − {r['versus']}", r["cell"],
                           f"{r['n']} ({r['n_targets']})", mean, r["claim"] or "–", r["verdict"]])
    return methods, paired


def claim_lines(frame: pd.DataFrame) -> list[str]:
    """Per attacked round, "FedeCouple leaks least" over all its pairs (``claim_word``)."""
    out = []
    paired = frame[(frame["kind"] == "paired") & (frame["versus"] == "fedecouple")]
    for rnd, group in paired.groupby("round", sort=True):
        verdicts = dict(zip(group["method"], group["verdict"].astype(str)))
        out.append(f"Round {rnd}: {LEAKS_LEAST}: {claim_word(verdicts)}")
    return out


def claim_word(verdicts: Mapping[str, str]) -> str:
    """"FedeCouple leaks least" from its pairs' verdicts (method → verdict): holds where every pair holds,
    does not hold where one does not (naming it), else undetermined naming the undetermined pairs, and
    "undetermined (lower bound)" where one of them is a lower bound: never holds on a lower bound."""
    failed = [m for m, v in verdicts.items() if v.startswith(FAILS)]
    open_ = [m for m, v in verdicts.items() if v.startswith(UNDETERMINED)]
    bounded = any(v.startswith(exposure.UNDETERMINED_LOWER_BOUND) for v in verdicts.values())
    if failed:
        return f"{FAILS} ({', '.join(failed)} leaks less)"
    if open_:
        return f"{exposure.UNDETERMINED_LOWER_BOUND if bounded else UNDETERMINED} (against {', '.join(open_)})"
    return f"{HOLDS} (all {len(verdicts)} pairs)"


def section_markdown(frame: pd.DataFrame) -> list[str]:
    """The section's Markdown lines (nothing when no method has an image cell)."""
    if not len(frame):
        return []
    methods, paired = table_rows(frame)
    out = ["## Fig. 10: leakage by method", "", NOTE, "", md_table(METHOD_HEADER, methods), ""]
    out += [md_table(PAIRED_HEADER, paired), ""] + [f"- {x}" for x in claim_lines(frame)] + [""] if paired else ["No pair to compare (the report has neither FedeCouple nor "
                                                            "FedAvg beside another method).", ""]
    return out


def section_html(frame: pd.DataFrame) -> str:
    """The section in HTML (every string escaped); "" when no method has an image cell."""
    if not len(frame):
        return ""
    methods, paired = table_rows(frame)
    parts = ["<h2>Fig. 10: leakage by method</h2>", f'<p class="muted">{html.escape(NOTE)}</p>',
             html_table(METHOD_HEADER, methods)]
    lines = "".join(f"<li>{html.escape(x)}</li>" for x in claim_lines(frame))
    parts += [html_table(PAIRED_HEADER, paired), f"<ul>{lines}</ul>"] if paired else ["<p>No pair to compare.</p>"]
    return "\n".join(parts)


BEFORE_MD, BEFORE_HTML = "## PSNR definition", "<h2>PSNR definition</h2>"


def insert_section(report: str, section: str, before: str) -> str:
    """``report`` with ``section`` inserted before the first ``before`` (appended where there is none)."""
    if not section:
        return report
    at = report.find(before)
    return report + "\n" + section + "\n" if at < 0 else report[:at] + section + "\n" + report[at:]
