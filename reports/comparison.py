"""Render a method-by-method privacy comparison: tables in, file contents out.

Pure rendering: nothing here trains, attacks or touches the disk. ``render`` takes the tables
``fedsec.jobs.report`` assembled and returns the contents of every output file; the caller writes them
(atomically). This package never imports ``fedsec``: imports flow ``fedsec`` → ``reports``.

Inputs
------
``summary``  one row per method: ``method, accuracy_mean, accuracy_std, upload_mb_per_round,
             upload_kib_per_client_round``, for every attack ``a`` in ``meta["attacks"]``:
             ``a_status`` (``done`` or ``not applicable: <reason>`` / ``unavailable: <reason>``),
             ``a_mean_psnr, a_median_psnr, a_max_psnr, a_prior_psnr, a_ssim, a_label_accuracy``
             (the reconstructions' predicted labels), ``a_class_presence_accuracy`` (label
             attacks), ``a_images``, ``a_lower_bound`` (the caller's LOWER BOUND verdict, the exposure matrix's
             rule: not above the prior by its interval while the optimiser stopped short); then
             ``findings_high, findings_medium, findings_low, findings_info``; optionally ``secure_aggregation`` (the audit's "runs on the sum", "secure
             variant: ..." or "refuses: ...", a column of the headline table when present).
``results``  one row per scored image (and, for ``labels``, per class): at least ``method,
             attack, psnr, prior_psnr`` for image attacks.
``findings`` one row per finding: ``method, severity, code, finding, evidence, measured``.
``grids``    ``{(method, attack): {"png": bytes, "path": "relative/path.png"}}``: reconstruction
             figures to embed (HTML) or link (Markdown).
``meta``     ``title, command, methods, attacks, image_attacks`` (the attacks that rebuild images),
             ``label_attacks``, ``psnr_cap_db`` (what an infinite PSNR counts as), ``leak_gap_db`` (the
             audit's "at chance" margin), ``config, method_hyperparameters, seeds, attack_settings,
             versions, psnr_definition, notes, stages, findings_note`` (see ``render``); ``exposure``: the
             ``reports.exposure`` evidence (dicts) of the exposure matrix shown first.

Outputs (``render`` returns ``{filename: str | bytes}``)
-------------------------------------------------------
``report.md``, ``report.html`` (self-contained: images are base64 PNG data URIs, no external
reference; every string taken from the data passes ``html.escape``), ``psnr_by_method.png`` and
``accuracy_vs_leakage.png`` (and ``malicious_by_size.png`` with ``meta["malicious"]``: the
malicious-server section, ``reports.malicious``).
"""
from __future__ import annotations

import base64
import html
import json
from typing import Any, Mapping

import numpy as np
import pandas as pd

from .audit import SEVERITIES
from .figures import png_bytes
from .formatting import NO_MODEL, finite_or_none, interval_text, is_true
from . import client_size
from .malicious import PLOT_MALICIOUS, section_html, section_markdown, share_by_size_figure

PLOT_PSNR = "psnr_by_method.png"
PLOT_SCATTER = "accuracy_vs_leakage.png"
PLOT_BY_ROUND = "leakage_by_round.png"


# ----------------------------------------------------------------------------------------------
# formatting helpers
# ----------------------------------------------------------------------------------------------
def headline_note(meta: Mapping) -> str:
    """The legend under the headline table (Markdown and HTML)."""
    return HEADLINE_NOTE.format(rule=success_rule(meta))


def success_rule(meta: Mapping) -> str:
    """When an image counts as recovered, in words (from the attacks' own constant, via ``meta``)."""
    return meta.get("success_rule") or "see summary.json"


HEADLINE_NOTE = (
    "Accuracy: mean ± std over clients of each client's personalised model on its own test split (last round). "
    "PSNR: mean [95 % interval over the attacked clients] / median / max over the reconstructed images, in dB, "
    "with the prior baseline (the data set's mean image scored the same way), the number of images and the share "
    "recovered ({rule}); leakage means above the prior. A cell "
    "<attack>@textbook is the attack on clients that took one step on a few images, <attack>@real on their real "
    "local training (<attack>@real-n<N>: clients that hold N training images). MIS-SPECIFIED: for some target the true data matched the upload worse than the "
    "reconstruction under the attack's own objective (its forward model was wrong), so that PSNR says nothing "
    "about the method's privacy. NO MODEL (estimate): the method uploads no model of the client (FedProto: "
    "prototypes only), so the server inverted with one of its own (a surrogate trained on public data, or the "
    "initial model): the PSNR is what that attacker reaches, an estimate, and no forward check applies. "
    "LOWER BOUND (the exposure matrix's rule): not above the prior by its interval while, on some target, the "
    "truth matched better than the reconstruction: the optimiser stopped short, so the PSNR is set by the attack's "
    "budget, not by the method, and the true leakage may be higher. Upload: all clients' uploads per round.")


def fmt(x: Any, digits: int = 1, unit: str = "") -> str:
    v = finite_or_none(x)
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def accuracy_cell(mean: Any, std: Any) -> str:
    m, s = finite_or_none(mean), finite_or_none(std)
    if m is None:
        return "n/a"
    return f"{100 * m:.1f} ± {100 * s:.1f}" if s is not None else f"{100 * m:.1f}"


def status_of(row: Mapping, attack: str) -> str:
    return str(row.get(f"{attack}_status", "not run"))


def mis_specified(row: Mapping, attack: str) -> bool:
    """Whether the attack's forward model was wrong for some target (the truth matched the upload
    worse than the reconstruction): its PSNR is then no evidence of privacy."""
    return is_true(row.get(f"{attack}_mis_specified"))




def model_unknown(row: Mapping, attack: str) -> bool:
    """Whether, for some target, the server holds no model of the client (``<attack>_model_unknown_targets``,
    the NO MODEL verdict the attacks decided): the PSNR is a surrogate-model estimate, a property of the
    method's threat model, not a wrong forward model."""
    return (finite_or_none(row.get(f"{attack}_model_unknown_targets")) or 0) > 0


def stopped_short(row: Mapping, attack: str) -> bool:
    """Whether the attack's figure is a LOWER BOUND: not above the prior by its interval while the optimiser
    stopped short of a truth its own objective prefers (``not_converged`` on some target), a figure set by
    the attack's budget, not a measure of the method's privacy. The caller decided it by the exposure
    matrix's rule (``reports.exposure.judge``) and passes it as the summary's ``<attack>_lower_bound`` flag."""
    return is_true(row.get(f"{attack}_lower_bound"))


def psnr_cell(row: Mapping, attack: str) -> str:
    status = status_of(row, attack)
    if status != "done":
        return "n/a"
    flag = (" MIS-SPECIFIED" if mis_specified(row, attack) else f" {NO_MODEL}" if model_unknown(row, attack)
            else " LOWER BOUND" if stopped_short(row, attack) else "")
    interval = interval_text(row.get(f"{attack}_mean_psnr_ci_low"), row.get(f"{attack}_mean_psnr_ci_high"), digits=1)
    rate = finite_or_none(row.get(f"{attack}_success_rate"))
    success = "" if rate is None else f", {100 * rate:.0f} % recovered"
    n = finite_or_none(row.get(f"{attack}_n_images"))
    return (f"{fmt(row.get(f'{attack}_mean_psnr'))}{interval} / {fmt(row.get(f'{attack}_median_psnr'))} / "
            f"{fmt(row.get(f'{attack}_max_psnr'))} (prior {fmt(row.get(f'{attack}_prior_psnr'))}"
            f"{'' if n is None else f'; n={n:.0f}'}{success}){flag}")


def findings_cell(row: Mapping) -> str:
    return " / ".join(str(int(finite_or_none(row.get(f"findings_{s}")) or 0)) for s in SEVERITIES)


def headline_rows(summary: pd.DataFrame, meta: Mapping) -> tuple[list[str], list[list[str]]]:
    """The headline table as plain strings: (header, rows). Shared by Markdown and HTML."""
    header = ["method", "accuracy (%) mean ± std", "upload MB / round"]
    for a in meta["image_attacks"]:
        header += [f"{a} PSNR dB mean [95 % CI] / median / max (prior; n images; recovered)", f"{a} SSIM"]
    # an attack on a secure-aggregation round's sum reports the round's label histogram instead
    histogram = {a for a in meta["label_attacks"] if f"{a}_histogram" in summary.columns}
    header += [f"{a} (secure aggregation): round label histogram" if a in histogram else
               f"{a}: class-presence accuracy" for a in meta["label_attacks"]]
    header += ["findings high / medium / low / info"]
    secure = "secure_aggregation" in summary.columns  # the audit's declaration; older tables lack it
    header += ["secure aggregation"] if secure else []
    rows = []
    for _, r in summary.iterrows():
        row = [str(r["method"]), accuracy_cell(r.get("accuracy_mean"), r.get("accuracy_std")),
               fmt(r.get("upload_mb_per_round"), 3)]
        for a in meta["image_attacks"]:
            row += [psnr_cell(r, a), fmt(r.get(f"{a}_ssim"), 2) if status_of(r, a) == "done" else "n/a"]
        row += [(r[f"{a}_histogram"] if isinstance(r.get(f"{a}_histogram"), str) else "n/a")
                if a in histogram else fmt(r.get(f"{a}_class_presence_accuracy"), 2) for a in meta["label_attacks"]]
        row.append(findings_cell(r))
        row += [str(r["secure_aggregation"]) if isinstance(r["secure_aggregation"], str) else "n/a"] if secure else []
        rows.append(row)
    return header, rows


def skipped(summary: pd.DataFrame, meta: Mapping) -> list[tuple[str, str, str]]:
    """(method, attack, reason) for every attack that was not run or did not apply."""
    out = []
    for _, r in summary.iterrows():
        for a in meta["attacks"]:
            status = status_of(r, a)
            if status != "done":
                out.append((str(r["method"]), a, status))
    return out


def settings_rows(meta: Mapping) -> tuple[list[str], list[list[str]]]:
    """The attack settings as a table: one row per attack, one column per setting."""
    settings = meta.get("attack_settings") or {}
    keys = list(dict.fromkeys(k for v in settings.values() for k in v))
    rows = [[a] + [", ".join(map(str, v[k])) if isinstance(v.get(k), (list, tuple)) else str(v.get(k, ""))
                   for k in keys] for a, v in settings.items()]
    return ["attack"] + [k.replace("_", " ") for k in keys], rows


def stage_rows(stages: list[Mapping]) -> tuple[list[str], list[list[str]]]:
    """The stages as a table: status, the wall seconds and, for a stage computed in this run, the
    seconds ``fedsec.estimate`` gave it before the run (on its reference machine), and where the
    figures came from; a last row with the totals of the stages that have both."""
    rows = [[s.get("method", ""), s.get("stage", ""), s.get("status", ""), fmt(s.get("seconds"), 1),
             fmt(s.get("estimated"), 1), s.get("source", "")] for s in stages]
    both = [s for s in stages if s.get("seconds") is not None and s.get("estimated") is not None]
    if both:
        rows.append(["all computed", f"{len(both)} stages", "", fmt(sum(s["seconds"] for s in both), 1),
                     fmt(sum(s["estimated"] for s in both), 1), ""])
    return ["method", "stage", "status", "seconds", "estimated seconds", "source"], rows


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# plots (matplotlib's object API with the Agg canvas: no pyplot, no global state)
# ----------------------------------------------------------------------------------------------
def _png(fig) -> bytes:
    return png_bytes(fig, 100)


def psnr_plot(summary: pd.DataFrame, results: pd.DataFrame, meta: Mapping) -> bytes:
    """Mean PSNR per method and attack (bars), every scored image (dots), the prior (black dash)."""
    from matplotlib.figure import Figure

    attacks = list(meta["image_attacks"])
    methods = [str(m) for m in summary["method"]]
    fig = Figure(figsize=(max(6.0, 1.6 * len(methods) + 2), 7.0 if attacks and methods else 4.2))
    ax = fig.add_subplot(2, 1, 1) if attacks and methods else fig.add_subplot(1, 1, 1)
    if not attacks or not methods:
        ax.text(0.5, 0.5, "no image attack in this report", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _png(fig)
    width = 0.8 / len(attacks)
    colors = [f"C{i}" for i in range(len(attacks))]
    rng = np.random.default_rng(0)
    prior_drawn = False
    top = 1.0
    for j, a in enumerate(attacks):
        for i, (_, r) in enumerate(summary.iterrows()):
            x = i - 0.4 + width * (j + 0.5)
            if status_of(r, a) != "done" or finite_or_none(r.get(f"{a}_mean_psnr")) is None:
                ax.text(x, 0.5, "n/a", ha="center", va="bottom", fontsize=7, rotation=90, color="0.4")
                continue
            mean = finite_or_none(r.get(f"{a}_mean_psnr"))
            # hatched: the attack's forward model was wrong; dashed outline: no model at the server, an estimate
            outline = ({"edgecolor": "black", "linestyle": "--", "linewidth": 1.2}
                       if model_unknown(r, a) and not mis_specified(r, a) else {})
            ax.bar(x, mean, width * 0.9, color=colors[j], alpha=0.55, label=a,
                   hatch="//" if mis_specified(r, a) else None, **outline)
            top = max(top, mean)
            low, high = finite_or_none(r.get(f"{a}_mean_psnr_ci_low")), finite_or_none(r.get(f"{a}_mean_psnr_ci_high"))
            if low is not None and high is not None:  # the 95 % interval of the mean
                ax.errorbar(x, mean, yerr=[[max(mean - low, 0.0)], [max(high - mean, 0.0)]], fmt="none",
                            ecolor="black", elinewidth=1.0, capsize=3, zorder=5)
                top = max(top, high)
            if len(results) and {"method", "attack", "psnr"} <= set(results.columns):
                sel = results[(results["method"] == r["method"]) & (results["attack"] == a)]["psnr"]
                vals = pd.to_numeric(sel, errors="coerce").to_numpy(dtype=float)
                vals = np.where(np.isinf(vals), float(meta["psnr_cap_db"]), vals)
                vals = vals[np.isfinite(vals)]
                if len(vals):
                    jitter = rng.uniform(-width * 0.25, width * 0.25, size=len(vals))
                    ax.scatter(x + jitter, vals, s=10, color=colors[j], edgecolor="black", linewidth=0.3, zorder=3)
                    top = max(top, float(vals.max()))
            prior = finite_or_none(r.get(f"{a}_prior_psnr"))
            if prior is not None:
                top = max(top, prior)
                ax.hlines(prior, x - width * 0.45, x + width * 0.45, colors="black", linestyles="--", linewidth=1.2,
                          label="prior baseline (mean image)" if not prior_drawn else None, zorder=4)
                prior_drawn = True
    handles, labels = ax.get_legend_handles_labels()
    seen, keep = set(), []
    for h, lab in zip(handles, labels):
        if lab and lab not in seen:
            seen.add(lab)
            keep.append((h, lab))
    if keep:
        ax.legend([h for h, _ in keep], [lab for _, lab in keep], fontsize=8, loc="upper right")
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods)
    ax.set_ylim(0, top * 1.18 + 1)
    ax.set_ylabel("PSNR (dB) — higher = more leakage")
    ax.set_title("Reconstruction PSNR by method (bars: mean, whiskers: 95 % interval; dots: images; dashes: prior)",
                 fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    success_axis(fig.add_subplot(2, 1, 2), summary, attacks, methods, width, colors)
    fig.tight_layout()
    return _png(fig)


def success_axis(ax, summary: pd.DataFrame, attacks: list[str], methods: list[str], width: float,
                 colors: list[str]) -> None:
    """Share of images recovered per method and attack, with its 95 % interval as whiskers."""
    for j, a in enumerate(attacks):
        for i, (_, r) in enumerate(summary.iterrows()):
            x = i - 0.4 + width * (j + 0.5)
            rate = finite_or_none(r.get(f"{a}_success_rate"))
            if status_of(r, a) != "done" or rate is None:
                continue
            ax.bar(x, 100 * rate, width * 0.9, color=colors[j], alpha=0.55, label=a)
            low, high = finite_or_none(r.get(f"{a}_success_rate_ci_low")), finite_or_none(r.get(f"{a}_success_rate_ci_high"))
            if low is not None and high is not None:
                ax.errorbar(x, 100 * rate, yerr=[[100 * max(rate - low, 0.0)], [100 * max(high - rate, 0.0)]],
                            fmt="none", ecolor="black", elinewidth=1.0, capsize=3, zorder=5)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods)
    ax.set_ylim(0, 105)
    ax.set_ylabel("images recovered (%)")
    ax.set_title("Share of images recovered (whiskers: 95 % interval)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def leakage_points(summary: pd.DataFrame, meta: Mapping) -> list[dict]:
    """One point per method × image attack that ran: accuracy (%) and mean PSNR gain over the prior (dB)."""
    points = []
    for _, r in summary.iterrows():
        acc = finite_or_none(r.get("accuracy_mean"))
        for a in meta["attacks"]:
            if a not in meta["image_attacks"] or status_of(r, a) != "done":
                continue
            mean, prior = finite_or_none(r.get(f"{a}_mean_psnr")), finite_or_none(r.get(f"{a}_prior_psnr"))
            if acc is None or mean is None or prior is None:
                continue
            points.append({"method": str(r["method"]), "attack": a, "accuracy": 100 * acc, "gain": mean - prior,
                           "mis_specified": mis_specified(r, a), "model_unknown": model_unknown(r, a)})
    return points


def scatter_plot(summary: pd.DataFrame, meta: Mapping) -> bytes:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.add_subplot(1, 1, 1)
    points = leakage_points(summary, meta)
    if not points:
        ax.text(0.5, 0.5, "no leakage measured (no image attack applied)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return _png(fig)
    methods = list(dict.fromkeys(str(m) for m in summary["method"]))
    markers = dict(zip(meta["image_attacks"], "osD^v"))
    for p in points:
        c = f"C{methods.index(p['method']) % 10}"
        # a mis-specified attack is drawn hollow: its leakage is not measured, whatever its position
        ax.scatter(p["gain"], p["accuracy"], s=60, color="none" if p["mis_specified"] else c,
                   marker=markers.get(p["attack"], "o"), edgecolor=c if p["mis_specified"] else "black",
                   linewidth=1.2 if p["mis_specified"] else 0.5, zorder=3)
        estimate = p.get("model_unknown") and not p["mis_specified"]
        if estimate:  # no model at the server: a dashed ring around the point, the figure is an estimate
            ax.scatter(p["gain"], p["accuracy"], s=180, color="none", marker="o", edgecolor=c, linewidth=1.0,
                       linestyle="--", zorder=2)
        flag = ", mis-specified" if p["mis_specified"] else f", {NO_MODEL}" if estimate else ""
        ax.annotate(f"{p['method']} ({p['attack']}{flag})",
                    (p["gain"], p["accuracy"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.axvline(0.0, color="black", linestyle="--", linewidth=1)
    gap = float(meta["leak_gap_db"])
    ax.axvline(gap, color="0.5", linestyle=":", linewidth=1)
    ymin, ymax = ax.get_ylim()
    ax.text(0.1, ymin + 0.02 * (ymax - ymin), "prior", fontsize=7)
    ax.text(gap + 0.1, ymin + 0.02 * (ymax - ymin), f"+{gap:g} dB", fontsize=7, color="0.4")
    ax.set_xlabel("leakage: mean PSNR above the prior baseline (dB)")
    ax.set_ylabel("mean client test accuracy (%)")
    ax.set_title("Accuracy versus leakage (up-left is better)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)


# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------
def _json_block(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)


COMPARISON_NOTE = ("Paired over the images both methods' attacks scored (same partition, seed and attacked "
                   "clients), over all attacked rounds and per round: the mean difference of PSNR above the prior with "
                   "a 95 % interval that resamples the attacked clients. A difference is called only when the "
                   "interval excludes zero; a mis-specified attack is compared with nothing, and where the side that "
                   "leaks less stopped short of the truth on some target the order is undetermined (lower bound): "
                   "its true leakage may be higher; a NO MODEL attack (the server holds no "
                   "model of the client) is compared as the estimate it is, and the sentence says so. "
                   "\"Recovered\": {rule}.")
MIA_NOTE = ("Membership inference (`fedsec mia`): can a model tell a client's training records from its own "
            "held-out records? LiRA (online, global variance) on each client's personal model, the global model and "
            "the uploads, with shadow federations of the same method as references; [95 % intervals that resample "
            "clients]. Chance: the LOSS AUC of the split under reference models that trained on neither.")


BY_ROUND_NOTE = ("Each image cell per attacked round (round 0: the initial weights; later rounds: the federation as "
                 "trained by then): n images over n targets, mean PSNR [95 % interval over the targets], the prior, "
                 "the share recovered [95 % interval], and the forward-model check: targets mis-specified / targets "
                 "where the optimiser stopped short of the truth (its own objective preferred the true images), and, "
                 "after a slash, the targets marked NO MODEL (the server holds no model of the client: an estimate).")


def _no_model_count(row: Mapping) -> str:
    """The suffix ' / NO MODEL (estimate) k' of a by-round row with k targets whose server holds no model of
    the client; empty for none."""
    unknown = finite_or_none(row.get("model_unknown_targets"))
    return f" / {NO_MODEL} {unknown:.0f}" if unknown else ""


def by_round_rows(meta: Mapping) -> tuple[list[str], list[list[str]]]:
    """The by-round table as plain strings (Markdown and HTML)."""
    header = ["method", "cell", "round", "n images (targets)", "mean PSNR dB [95 % CI]", "prior",
              "recovered % [95 % CI]", "mis-specified / stopped short"]
    rows = []
    for r in meta.get("by_round") or []:
        rate = finite_or_none(r.get("success_rate"))
        rows.append([str(r["method"]), str(r["attack"]), str(r["round"]), f"{r['n_images']} ({r['n_targets']})",
                     f"{fmt(r.get('mean_psnr'))}{interval_text(r.get('mean_psnr_ci_low'), r.get('mean_psnr_ci_high'), digits=1)}",
                     fmt(r.get("prior_psnr")),
                     "n/a" if rate is None else f"{100 * rate:.0f} [{100 * (finite_or_none(r.get('success_rate_ci_low')) or 0):.0f}, "
                                               f"{100 * (finite_or_none(r.get('success_rate_ci_high')) or 0):.0f}]",
                     f"{r.get('mis_specified_targets', 0)} / {r.get('not_converged_targets', 0)}{_no_model_count(r)}"])
    return header, rows


def _mia_markdown(meta: Mapping) -> list[str]:
    from .mia import METHOD_COLUMNS, markdown_table, method_rows

    if not meta.get("mia"):
        return []
    return ["## Membership inference", "", MIA_NOTE, "", markdown_table(method_rows(meta["mia"]), METHOD_COLUMNS), ""]


def _mia_html(meta: Mapping) -> list[str]:
    from .mia import METHOD_COLUMNS, html_table, method_rows

    if not meta.get("mia"):
        return []
    return ["<h2>Membership inference</h2>", f'<p class="muted">{e(MIA_NOTE)}</p>',
            html_table(method_rows(meta["mia"]), METHOD_COLUMNS)]


EXPOSURE_NOTE = ("What leaks, for which method, under which threat: one verdict per cell, the worst of the cell's "
                 "figures, with the figure and its 95 % interval (\"≥\": the optimiser stopped short, so the true "
                 "figure can only be higher); the last column is each method's worst exposure, and each cell's "
                 "evidence follows the table. ")


def exposure_matrix(meta: Mapping):
    """The exposure matrix of the report's evidence (``meta["exposure"]``, ``fedsec.jobs.report``), or None."""
    from .exposure import exposure_matrix as build

    evidence = meta.get("exposure")
    return build(evidence, meta.get("methods") or ()) if evidence else None


def exposure_labels(meta: Mapping) -> dict[str, str]:
    """The trained column's header with the rounds this report attacked after round 0."""
    rounds = sorted({int(r) for s in (meta.get("attack_settings") or {}).values() for r in (s or {}).get("rounds") or ()
                     if finite_or_none(r) is not None and int(r) > 0})
    return {"trained": f"curious server, trained (round {', '.join(map(str, rounds))})"} if rounds else {}


def _exposure_markdown(meta: Mapping) -> list[str]:
    from .exposure import RULE, matrix_markdown

    matrix = exposure_matrix(meta)
    if matrix is None:
        return []
    return ["## Exposure matrix", "", EXPOSURE_NOTE + RULE, "", matrix_markdown(matrix, exposure_labels(meta)), ""]


def _exposure_html(meta: Mapping) -> list[str]:
    from .exposure import RULE, matrix_html

    matrix = exposure_matrix(meta)
    if matrix is None:
        return []
    return ["<h2>Exposure matrix</h2>", f'<p class="muted">{e(EXPOSURE_NOTE + RULE)}</p>',
            matrix_html(matrix, exposure_labels(meta))]


def render_markdown(summary: pd.DataFrame, findings: pd.DataFrame, grids: Mapping, meta: Mapping) -> str:
    header, rows = headline_rows(summary, meta)
    out = [f"# {meta.get('title', 'Privacy comparison')}", ""]
    if meta.get("command"):
        out += ["```", str(meta["command"]), "```", ""]
    out += _exposure_markdown(meta)
    out += ["## Headline", "", md_table(header, rows), "",
            headline_note(meta), ""]
    skips = skipped(summary, meta)
    if skips:
        out += ["Not run:", ""] + [f"* {_md_cell(m)} × {_md_cell(a)}: {_md_cell(why)}" for m, a, why in skips] + [""]
    out += ["## Plots", "", f"![PSNR by method]({PLOT_PSNR})", "", f"![Accuracy versus leakage]({PLOT_SCATTER})", ""]
    out += ["## Reconstructions", "", "Ground truth (top) above reconstruction (bottom), PSNR under each.", ""]
    if not grids:
        out += ["No reconstruction was made.", ""]
    for (method, attack), g in grids.items():
        out += [f"### {method}: {attack}", "", f"![{attack} on {method}]({g['path']})", ""]
    out += ["## Audit findings", ""]
    if meta.get("findings_note"):
        out += [str(meta["findings_note"]), ""]
    for method in meta["methods"]:
        sub = findings[findings["method"] == method] if len(findings) else findings
        out += [f"### {method}", ""]
        if sub.empty:
            out += ["No findings recorded.", ""]
            continue
        out.append(md_table(["severity", "code", "finding", "measured in this report"],
                            [[r["severity"], r["code"], r["finding"], r.get("measured", "") or ""]
                             for _, r in sub.iterrows()]))
        out.append("")
    if meta.get("by_round"):
        out += ["## Leakage by round", "", BY_ROUND_NOTE, "", md_table(*by_round_rows(meta)), "",
                f"![Leakage by round]({PLOT_BY_ROUND})", ""]
    if meta.get("comparisons"):
        out += ["## Which method leaks more", "", COMPARISON_NOTE.format(rule=success_rule(meta)), ""] + [f"* {_md_cell(c)}" for c in meta["comparisons"]] + [""]
    out += client_size.section_markdown(meta)
    out += section_markdown(meta, meta["methods"])
    out += _mia_markdown(meta)
    out += ["## PSNR definition", "", str(meta.get("psnr_definition", "")).strip(), ""]
    out += ["## Configuration", "", "Shared run configuration (every method: the same partition and seeds; only "
            "`method` and its own hyperparameters differ):", "", "```json", _json_block(meta.get("config", {})), "```", "",
            "Method hyperparameters:", "", "```json", _json_block(meta.get("method_hyperparameters", {})), "```", "",
            "Seeds:", "", "```json", _json_block(meta.get("seeds", {})), "```", "",
            "Attack settings:", "", md_table(*settings_rows(meta)), "",
            "Package versions:", "", "```json", _json_block(meta.get("versions", {})), "```", ""]
    stages = meta.get("stages") or []
    if stages:
        out += ["## Stages", "", md_table(*stage_rows(stages)), ""]
    for note in meta.get("notes") or []:
        out.append(f"* {_md_cell(note)}")
    return "\n".join(out).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------
# HTML (self-contained; every data string escaped)
# ----------------------------------------------------------------------------------------------
CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1150px;color:#222;
line-height:1.4;padding:0 12px}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:3px;margin-top:1.8em}
table{border-collapse:collapse;margin:8px 0 16px;font-size:0.88em}
th,td{border:1px solid #ccc;padding:4px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;white-space:nowrap}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:0.82em}
img{max-width:100%;border:1px solid #ddd;margin:4px 0}
figure{margin:8px 0 18px}figcaption{font-size:0.85em;color:#555}
.sev-high{color:#fff;background:#b3261e}.sev-medium{background:#f6c26b}.sev-low{background:#e6eef7}
.sev-info{background:#eee}.muted{color:#666;font-size:0.9em}
.verdict-exposed{background:#f4c7c3}.verdict-lower-bound{background:#fce8b2}.verdict-not-shown{background:#d9ead3}
"""


def e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def html_table(header: list[str], rows: list[list[str]], numeric_from: int = 1, classes: list[str] | None = None) -> str:
    parts = ["<table>", "<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{e(classes[i])}"' if classes else ""
        cells = "".join(f'<td class="num">{e(c)}</td>' if j >= numeric_from else f"<td>{e(c)}</td>"
                        for j, c in enumerate(row))
        parts.append(f"<tr{cls}>{cells}</tr>")
    parts.append("</table>")
    return "\n".join(parts)


def _client_size_html(meta: Mapping, plot: bytes | None) -> list[str]:
    """``reports.client_size``'s section in HTML (every string escaped; the figure as a data URI)."""
    rows = list(meta.get("client_size") or [])
    if not rows:
        return []
    out = ["<h2>Leakage vs client size</h2>", f'<p class="muted">{e(client_size.NOTE)}</p>',
           html_table(client_size.HEADER, client_size.table_rows(rows), numeric_from=99),
           "<ul>" + "".join(f"<li>{e(x)}</li>" for x in client_size.exposed_lines(rows)) + "</ul>"]
    if plot is not None:
        out.append(f'<figure><img src="{data_uri(plot)}" alt="Leakage vs client size"><figcaption>Mean PSNR '
                   f"against the number of training images per client</figcaption></figure>")
    return out


def render_html(summary: pd.DataFrame, findings: pd.DataFrame, grids: Mapping, meta: Mapping,
                plots: Mapping[str, bytes]) -> str:
    title = meta.get("title", "Privacy comparison")
    header, rows = headline_rows(summary, meta)
    h = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
         f"<style>{CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    if meta.get("command"):
        h.append(f"<pre>{e(meta['command'])}</pre>")
    h += _exposure_html(meta)
    h += ["<h2>Headline</h2>", html_table(header, rows),
          f'<p class="muted">{e(headline_note(meta))}</p>']
    skips = skipped(summary, meta)
    if skips:
        h.append("<p>Not run:</p><ul>" + "".join(f"<li>{e(m)} × {e(a)}: {e(why)}</li>" for m, a, why in skips)
                 + "</ul>")
    h.append("<h2>Plots</h2>")
    for name, alt in ((PLOT_PSNR, "PSNR by method"), (PLOT_SCATTER, "Accuracy versus leakage")):
        if name in plots:
            h.append(f'<figure><img src="{data_uri(plots[name])}" alt="{e(alt)}"><figcaption>{e(alt)}</figcaption></figure>')
    h += ["<h2>Reconstructions</h2>", "<p>Ground truth (top) above reconstruction (bottom), PSNR under each.</p>"]
    if not grids:
        h.append("<p>No reconstruction was made.</p>")
    for (method, attack), g in grids.items():
        h.append(f"<h3>{e(method)}: {e(attack)}</h3>"
                 f'<figure><img src="{data_uri(g["png"])}" alt="{e(attack)} on {e(method)}">'
                 f"<figcaption>{e(g.get('path', ''))}</figcaption></figure>")
    h.append("<h2>Audit findings</h2>")
    if meta.get("findings_note"):
        h.append(f'<p class="muted">{e(meta["findings_note"])}</p>')
    for method in meta["methods"]:
        sub = findings[findings["method"] == method] if len(findings) else findings
        h.append(f"<h3>{e(method)}</h3>")
        if sub.empty:
            h.append("<p>No findings recorded.</p>")
            continue
        h.append("<table><tr><th>severity</th><th>code</th><th>finding</th><th>measured in this report</th>"
                 "<th>evidence</th></tr>")
        for _, r in sub.iterrows():
            sev = str(r["severity"])
            h.append(f'<tr><td class="sev-{e(sev)}">{e(sev)}</td><td>{e(r["code"])}</td><td>{e(r["finding"])}</td>'
                     f'<td>{e(r.get("measured", "") or "")}</td><td><code>{e(r.get("evidence", "") or "")}</code></td></tr>')
        h.append("</table>")
    if meta.get("by_round"):
        h += ["<h2>Leakage by round</h2>", f'<p class="muted">{e(BY_ROUND_NOTE)}</p>',
              html_table(*by_round_rows(meta), numeric_from=2),
              f'<figure><img src="{data_uri(plots[PLOT_BY_ROUND])}" alt="Leakage by round"><figcaption>Mean PSNR above the prior per attacked round</figcaption></figure>']
    if meta.get("comparisons"):
        h += ["<h2>Which method leaks more</h2>", f'<p class="muted">{e(COMPARISON_NOTE.format(rule=success_rule(meta)))}</p>',
              "<ul>" + "".join(f"<li>{e(c)}</li>" for c in meta["comparisons"]) + "</ul>"]
    h += _client_size_html(meta, plots.get(client_size.PLOT_CLIENT_SIZE))
    h += section_html(meta, meta["methods"], plots.get(PLOT_MALICIOUS), data_uri)
    h += _mia_html(meta)
    h += ["<h2>PSNR definition</h2>", f"<pre>{e(str(meta.get('psnr_definition', '')).strip())}</pre>",
          "<h2>Configuration</h2>",
          "<p>Shared run configuration (every method: the same partition and seeds; only <code>method</code> and its "
          "own hyperparameters differ):</p>", f"<pre>{e(_json_block(meta.get('config', {})))}</pre>",
          "<p>Method hyperparameters:</p>", f"<pre>{e(_json_block(meta.get('method_hyperparameters', {})))}</pre>",
          "<p>Seeds:</p>", f"<pre>{e(_json_block(meta.get('seeds', {})))}</pre>",
          "<p>Attack settings:</p>", html_table(*settings_rows(meta), numeric_from=99),
          "<p>Package versions:</p>", f"<pre>{e(_json_block(meta.get('versions', {})))}</pre>"]
    stages = meta.get("stages") or []
    if stages:
        h += ["<h2>Stages</h2>", html_table(*stage_rows(stages), numeric_from=99)]
    notes = meta.get("notes") or []
    if notes:
        h.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul>")
    h.append("</body></html>")
    return "\n".join(h) + "\n"


def render(summary: pd.DataFrame, results: pd.DataFrame, findings: pd.DataFrame, grids: Mapping,
           meta: Mapping) -> dict[str, str | bytes]:
    """Every output file's content: ``report.md``, ``report.html`` and the plots (the by-round one when
    the attacks ran at several rounds, the client-size one with sized real-training cells)."""
    plots = {PLOT_PSNR: psnr_plot(summary, results, meta), PLOT_SCATTER: scatter_plot(summary, meta)}
    if meta.get("by_round"):  # attacks at several rounds: leakage across training
        from .figures import leakage_by_round

        plots[PLOT_BY_ROUND] = leakage_by_round(results, meta["psnr_cap_db"])
    if meta.get("client_size"):  # sized real-training cells: leakage against the client's size
        plots[client_size.PLOT_CLIENT_SIZE] = client_size.client_size_figure(list(meta["client_size"]))
    if meta.get("malicious"):  # the malicious-server section's figure
        plots[PLOT_MALICIOUS] = share_by_size_figure(meta)
    return {"report.md": render_markdown(summary, findings, grids, meta),
            "report.html": render_html(summary, findings, grids, meta, plots), **plots}
