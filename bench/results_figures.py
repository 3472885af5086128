"""The results page's pictures, drawn from the same records as its tables (``bench/results.py --render``):
the audit preset's Fig. 10 comparison as bars with their intervals, and the client-size curve per method.

Each picture is drawn only from figures a record holds (its table rows: "mean [low, high]"), so a picture
and the table beside it cannot disagree; a record that lacks them draws nothing.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

INTERVAL = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*\[\s*([+-]?\d+(?:\.\d+)?),\s*([+-]?\d+(?:\.\d+)?)\]")
IMAGES = "img/results"  # under docs/: the page links them relative to itself


def interval(text: str) -> tuple[float, float, float] | None:
    """(mean, low, high) of a table entry such as "18.94 [16.68, 20.87]"; None for anything else."""
    match = INTERVAL.match(str(text))
    return tuple(float(g) for g in match.groups()) if match else None


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    # no creation date or software version in the file: the same records draw the same bytes
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    return buffer.getvalue()


def fig10_bars(judged_rows: list[list[str]], priors: dict[str, float]) -> bytes | None:
    """Mean PSNR per method at round 0 and round 19 of the audit preset, with the 95 % intervals and each
    round's prior (``priors``: round → dB); hatched bars: the optimiser stopped short on some target, so the
    bar is a lower bound. ``judged_rows``: the Fig. 10 table's rows with their verdicts
    (``bench/results.py``'s ``fig10_rows``)."""
    rows = [r for r in judged_rows if " − " not in r[1] and interval(r[4])]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = list(dict.fromkeys(r[0] for r in rows))
    methods = list(dict.fromkeys(r[1] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    width = 0.8 / len(rounds)
    for j, rnd in enumerate(rounds):
        for i, method in enumerate(methods):
            row = next((r for r in rows if r[0] == rnd and r[1] == method), None)
            if row is None:
                continue
            mean, low, high = interval(row[4])
            x = i + (j - (len(rounds) - 1) / 2) * width
            lower_bound = "stopped short" in row[6]
            surrogate = "NO MODEL" in row[6]  # no model to attack: a surrogate's estimate, drawn pale
            ax.bar(x, mean, width * 0.9, color=f"C{j}", alpha=0.35 if surrogate else 1.0,
                   hatch="//" if lower_bound else None, edgecolor="black", linewidth=0.5,
                   label=f"round {rnd}" if i == 0 else None)
            ax.errorbar(x, mean, yerr=[[mean - low], [high - mean]], color="black", capsize=3, linewidth=1)
    for j, rnd in enumerate(rounds):
        if rnd in priors:
            ax.axhline(priors[rnd], color=f"C{j}", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("mean PSNR (dB), 95 % interval")
    ax.set_title("The audit's Fig. 10 cells (dotted: each round's prior; hatched: stopped short, a lower bound; "
                 "pale: NO MODEL, a surrogate's estimate)", fontsize=8)
    ax.legend(frameon=False, fontsize=8)
    data = _png(fig)
    plt.close(fig)
    return data


def _mis_specified(checks: str) -> bool:
    """Whether a table's "mis-specified / stopped short" entry (e.g. "2 / 4", "– / –") counts any."""
    first = str(checks).split("/")[0].strip()
    return first.isdigit() and int(first) > 0


def n_curve(records: dict[str, dict]) -> bytes | None:
    """Mean PSNR against the client's training images N, one line per method with its intervals and the
    prior: where each method's leakage meets the prior."""
    curves = {}
    for name, record in sorted(records.items()):
        if not name.startswith("n-curve-"):
            continue
        table = record.get("figures", {}).get("table")
        if not table:
            continue
        # a point whose attack was MIS-SPECIFIED says nothing about the method: not drawn
        points = [(int(r[0]), *interval(r[1]), float(r[2])) for r in table["rows"]
                  if interval(r[1]) and not _mis_specified(r[5])]
        if points:
            curves[name[len("n-curve-"):]] = points
    if not curves:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    for k, (method, points) in enumerate(curves.items()):
        n = [p[0] for p in points]
        ax.errorbar(n, [p[1] for p in points], yerr=[[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]],
                    color=f"C{k}", marker="o", markersize=3, capsize=2, linewidth=1, label=method)
    prior = [p[4] for points in curves.values() for p in points]
    ax.axhspan(min(prior), max(prior), color="grey", alpha=0.15, label="prior (range)")
    ax.set_xscale("log")
    ax.set_xlabel("training images per client, N")
    ax.set_ylabel("mean PSNR (dB), 95 % interval")
    ax.set_title("Leakage against client size (MIS-SPECIFIED points left out; records may be stale: see the table)",
                 fontsize=9)
    ax.legend(frameon=False, fontsize=8, ncol=3)
    data = _png(fig)
    plt.close(fig)
    return data


def pictures(records: dict[str, dict], judged_fig10=None) -> list[tuple[str, str, bytes]]:
    """(file name under ``IMAGES``, alt text, PNG bytes) of every picture the records can draw.
    ``judged_fig10(figures) -> (rows, claims)``: the audit's Fig. 10 rows with their verdicts."""
    out = []
    figures = (records.get("audit-preset") or {}).get("figures") or {}
    bars = None
    if figures.get("fig10") and judged_fig10 is not None:
        # the image attacks' prior of each round (the audit table: method, cell, round, ..., prior, ...)
        priors = {r[2]: float(r[5]) for r in (figures.get("table") or {}).get("rows") or []
                  if r[1] == "ig@textbook" and interval(f"{r[5]} [0, 0]")}
        bars = fig10_bars(judged_fig10(figures)[0], priors)
    if bars:
        out.append(("fig10.png", "The audit's Fig. 10 cells: mean PSNR per method at round 0 and round 19, with 95 % "
                                 "intervals", bars))
    curve = n_curve(records)
    if curve:
        out.append(("n-curve.png", "Mean PSNR against the client's training images N, per method, with 95 % "
                                   "intervals and the prior", curve))
    return out


def markdown(pictures_: list[tuple[str, str, bytes]]) -> list[str]:
    """The page's "Pictures" section (empty without pictures)."""
    if not pictures_:
        return []
    lines = ["## Pictures", "", "Drawn from the records below by `python bench/results.py --render`; a picture "
             "shows the same figures as its table, and is as stale as its records.", ""]
    for name, alt, _ in pictures_:
        lines += [f"![{alt}]({IMAGES}/{name})", ""]
    return lines


def write(pictures_: list[tuple[str, str, bytes]], docs: Path) -> list[Path]:
    """Write the pictures that changed under ``docs/IMAGES``; the paths written."""
    folder = docs / IMAGES
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, _, data in pictures_:
        path = folder / name
        if not path.exists() or path.read_bytes() != data:
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
            written.append(path)
    return written
