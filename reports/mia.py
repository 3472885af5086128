"""Render membership-inference results: tables in, Markdown / HTML snippets and PNG bytes out.

Pure rendering: nothing here trains, attacks or touches the disk, and this module imports neither
``fedsec`` nor ``attacks`` (imports flow ``fedsec`` → ``reports``).

Inputs
------
``summary``  the dict ``fedsec mia`` writes to summary.json (or any dict of that shape):
             ``method``, ``targets`` → {target: {``available``, ``note``, ``attacks`` → {attack:
             {``auc``, ``auc_ci``, ``advantage``, ``tpr_at_1pct_fpr`` (number or refusal sentence),
             ``tpr_at_1pct_fpr_ci``, ``tpr_at_0_1pct_fpr``, ``n_members``, ``n_nonmembers``,
             ``per_client_auc``, ``empirical_epsilon``} or {``not_applicable``: sentence}}}},
             optional ``dp`` → {``noise_multiplier``, ``epsilon_accounted_max``, ``delta``}.
``rows``     ``summary_rows(summary)`` flattens that into one dict per (target, attack) (several
             summaries can be concatenated for a method comparison).

Outputs
-------
``markdown_table(rows)`` and ``html_table(rows)`` (every string from the data passes
``html.escape``); ``roc_png(curves)`` (linear and log-log ROC per target), ``histograms_png``
(member vs non-member scores) and ``exposed_png`` (a grid of the most exposed records) as PNG bytes.
"""
from __future__ import annotations

import html
import io
from typing import Any, Mapping, Sequence

import numpy as np

from .formatting import finite_or_none

TARGETS = ("personal", "global", "upload")
COLUMNS = ("method", "target", "attack", "AUC [95% CI]", "TPR@1%FPR [95% CI]", "TPR@0.1%FPR", "advantage",
           "per-client AUC (median, IQR)", "members / non-members", "empirical ε ≥ (δ)", "accounted ε")


def _with_ci(value: Any, ci: Any, digits: int = 3) -> str:
    v = finite_or_none(value)
    if v is None:
        return str(value) if isinstance(value, str) else "n/a"
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and finite_or_none(ci[0]) is not None and finite_or_none(ci[1]) is not None:
        return f"{v:.{digits}f} [{float(ci[0]):.{digits}f}, {float(ci[1]):.{digits}f}]"
    return f"{v:.{digits}f}"


def _short(value: Any) -> str:
    """A refusal sentence shortened to its first clause for a table cell (the full one is in summary.json)."""
    if isinstance(value, str):
        return value.split(";")[0]
    v = finite_or_none(value)
    return "n/a" if v is None else f"{v:.3f}"


def summary_rows(summary: Mapping) -> list[dict]:
    """One row per (target, attack) of one ``fedsec mia`` summary, formatted for a table."""
    rows = []
    method = str(summary.get("method", ""))
    dp = summary.get("dp") or {}
    accounted = finite_or_none(dp.get("epsilon_accounted_max"))
    for target, info in (summary.get("targets") or {}).items():
        if not info.get("available", False):
            rows.append({"method": method, "target": target, "attack": "—", "AUC [95% CI]": "not applicable: "
                         + str(info.get("note", ""))})
            continue
        for attack, m in (info.get("attacks") or {}).items():
            row = {"method": method, "target": target, "attack": attack}
            if "auc" not in m:
                row["AUC [95% CI]"] = "not applicable: " + str(m.get("not_applicable", m.get("note", "")))
                rows.append(row)
                continue
            pc = m.get("per_client_auc") or {}
            eps = m.get("empirical_epsilon") or {}
            row.update({
                "AUC [95% CI]": _with_ci(m.get("auc"), m.get("auc_ci")),
                "TPR@1%FPR [95% CI]": _with_ci(m.get("tpr_at_1pct_fpr"), m.get("tpr_at_1pct_fpr_ci")),
                "TPR@0.1%FPR": _short(m.get("tpr_at_0_1pct_fpr")),
                "advantage": _with_ci(m.get("advantage"), m.get("advantage_ci")),
                "per-client AUC (median, IQR)": (f"{pc['median']:.3f} ({pc['q1']:.3f}–{pc['q3']:.3f})"
                                                 if finite_or_none(pc.get("median")) is not None else "n/a"),
                "members / non-members": f"{m.get('n_members', 0)} / {m.get('n_nonmembers', 0)}",
                "empirical ε ≥ (δ)": (f"{eps['epsilon_lower_bound']:.3f} ({eps.get('delta', 0):g})"
                                      if finite_or_none(eps.get("epsilon_lower_bound")) is not None else "n/a"),
                "accounted ε": f"{accounted:.3g}" if accounted is not None else "—",
            })
            rows.append(row)
    return rows


def markdown_table(rows: Sequence[Mapping], columns: Sequence[str] = COLUMNS) -> str:
    def cell(x: Any) -> str:
        return str(x if x is not None else "").replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def html_table(rows: Sequence[Mapping], columns: Sequence[str] = COLUMNS) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '') or ''))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f'<table class="mia"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def metric_cell(summary: Mapping, target: str, attack: str, key: str) -> str:
    """``key`` (``auc``, ``tpr_at_1pct_fpr``, ...) of one target and attack with its interval; "—"
    where the model or attack does not exist."""
    info = (summary.get("targets") or {}).get(target) or {}
    if not info.get("available", False):
        return "—"
    m = (info.get("attacks") or {}).get(attack) or {}
    if "auc" not in m:
        return "—"
    return _with_ci(m.get(key), m.get(key + "_ci"))


METHOD_COLUMNS = ("method", "accuracy", "chance (LOSS AUC, untrained-on)", "personal AUC", "personal TPR@1%FPR",
                  "global AUC", "global TPR@1%FPR", "upload AUC", "upload TPR@1%FPR", "update test AUC",
                  "update test TPR@1%FPR", "empirical ε ≥ (personal)", "accounted ε")


def method_rows(summaries: Sequence[Mapping], attack: str = "lira") -> list[dict]:
    """One row per ``fedsec mia`` summary: the chance level of its split (LOSS AUC of the personal
    models' reference runs on records they left out), AUC and TPR at 1 % FPR [95 % client-bootstrap
    interval] of ``attack`` on the personal, global and uploaded models, of the server's update test, and
    (with DP) the empirical ε lower bound of ``attack`` on the personal models next to the
    accountant's ε. "—": the method has no such model (or the attack does not apply)."""
    rows = []
    for summary in summaries:
        dp = summary.get("dp") or {}
        name = str(summary.get("method", ""))
        if dp:
            name += f" (DP-SGD σ={dp.get('noise_multiplier')})"
        personal = ((summary.get("targets") or {}).get("personal") or {}).get("attacks", {}).get(attack, {})
        eps = (personal.get("empirical_epsilon") or {}).get("epsilon_lower_bound")
        accounted = finite_or_none(dp.get("epsilon_accounted_max"))
        chance = (((summary.get("targets") or {}).get("personal") or {}).get("chance_level") or {}).get("loss_auc_mean")
        rows.append({
            "method": name, "accuracy": _with_ci(summary.get("target_accuracy"), None, 4),
            "chance (LOSS AUC, untrained-on)": _with_ci(chance, None),
            **{f"{t} AUC": metric_cell(summary, t, attack, "auc") for t in TARGETS},
            **{f"{t} TPR@1%FPR": metric_cell(summary, t, attack, "tpr_at_1pct_fpr") for t in TARGETS},
            "update test AUC": metric_cell(summary, "upload", "update", "auc"),
            "update test TPR@1%FPR": metric_cell(summary, "upload", "update", "tpr_at_1pct_fpr"),
            "empirical ε ≥ (personal)": f"{eps:.3f}" if finite_or_none(eps) is not None else "—",
            "accounted ε": f"{accounted:.3g}" if accounted is not None else "—",
        })
    return rows


# ---------------------------------------------------------------------------------------------
# figures (PNG bytes)


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roc_png(curves: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]], title: str = "") -> bytes:
    """One row per target: ROC on linear axes and on log-log axes (where low FPR is visible)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(curves), 2, figsize=(10, 4.2 * len(curves)), squeeze=False)
    for row, (target, by_attack) in enumerate(curves.items()):
        lin, log = axes[row]
        for attack, (fpr, tpr) in by_attack.items():
            lin.plot(fpr, tpr, label=attack)
            log.plot(np.maximum(fpr, 1e-5), np.maximum(tpr, 1e-5), label=attack)
        lin.plot([0, 1], [0, 1], "k:", lw=1)
        log.plot([1e-5, 1], [1e-5, 1], "k:", lw=1)
        log.set_xscale("log")
        log.set_yscale("log")
        log.set_xlim(1e-4, 1)
        log.set_ylim(1e-4, 1)
        for ax, kind in ((lin, "linear"), (log, "log-log")):
            ax.set_xlabel("false positive rate")
            ax.set_ylabel("true positive rate")
            ax.set_title(f"{target} model ({kind})")
            ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    return _png(fig)


def histograms_png(histograms: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]]) -> bytes:
    """Rows = targets, columns = attacks: member vs non-member score histograms (density)."""
    plt = _pyplot()
    attacks = list(dict.fromkeys(a for by in histograms.values() for a in by))
    fig, axes = plt.subplots(len(histograms), len(attacks), figsize=(3.2 * len(attacks), 2.6 * len(histograms)),
                             squeeze=False)
    for row, (target, by_attack) in enumerate(histograms.items()):
        for col, attack in enumerate(attacks):
            ax = axes[row][col]
            if attack not in by_attack:
                ax.axis("off")
                continue
            members, nonmembers = (np.asarray(v, float) for v in by_attack[attack])
            both = np.concatenate([members, nonmembers])
            lo, hi = np.percentile(both, [0.5, 99.5]) if len(both) else (0, 1)
            bins = np.linspace(lo, hi if hi > lo else lo + 1, 40)
            ax.hist(np.clip(nonmembers, lo, hi), bins=bins, density=True, alpha=0.55, histtype="stepfilled",
                    label="non-members")  # one polygon per histogram: 40 bar patches each took most of the drawing
            ax.hist(np.clip(members, lo, hi), bins=bins, density=True, alpha=0.55, histtype="stepfilled", label="members")
            ax.set_title(f"{target}: {attack}", fontsize=9)
            ax.tick_params(labelsize=7)
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    return _png(fig)


def exposed_png(images: np.ndarray, captions: Sequence[str], title: str = "") -> bytes:
    """A grid of images (N, C, H, W) in [0, 1], each with its caption."""
    plt = _pyplot()
    n = len(images)
    cols = min(8, max(n, 1))
    rows = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(1.5 * cols, 1.75 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= n:
            continue
        img = np.clip(np.asarray(images[i], float), 0, 1)
        if img.shape[0] == 1:
            ax.imshow(img[0], cmap="gray", vmin=0, vmax=1)
        else:
            ax.imshow(np.transpose(img, (1, 2, 0)))
        ax.set_title(str(captions[i]), fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    return _png(fig)
