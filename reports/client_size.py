"""Leakage as a function of how many images a client trains on: pure rendering of the
cells ``bench/n_curve.py`` measures (rows in, Markdown text or PNG bytes out; nothing touches the
disk). A row: method, attack, train_images (N), mean_psnr, mean_psnr_low/high (its interval),
prior_psnr, success_rate, n_images, n_targets, iterations and restarts (the budget), seconds, and ``note`` (why a
cell has no figure)."""
from __future__ import annotations

import math
from typing import Mapping

from .figures import png_bytes
from .formatting import NO_MODEL, finite_or_none, interval_text


PLOT_CLIENT_SIZE = "leakage_by_client_size.png"
NOTE = ("The gradient attacks on the clients' real local training, one federation per client size N (every client "
        "trains on exactly N images, one local epoch; every image an attacked client trained on is rebuilt and "
        "matched to the truth one to one). Intervals are 95 % and resample the attacked clients. A client size is "
        "exposed where the interval lies above the prior (the data set's mean image); a cell at its prior whose "
        "targets stopped short of the truth is a lower bound set by the attack's budget, not evidence of little "
        "leakage.")


def section_markdown(meta: Mapping) -> list[str]:
    """The report's "Leakage vs client size" section (Markdown lines): the note, the table, the figure;
    nothing without sized real-training cells (``meta["client_size"]``)."""
    rows = list(meta.get("client_size") or [])
    if not rows:
        return []
    return ["## Leakage vs client size", "", NOTE, "", client_size_table(rows), "",
            f"![Leakage vs client size]({PLOT_CLIENT_SIZE})", ""]


def largest_exposed(rows: list[dict]) -> dict[str, int | None]:
    """Per method, the largest N whose mean-PSNR interval lies above the prior (lower bound > prior):
    "clients holding at most N images are exposed"; None where no measured N is."""
    out: dict[str, int | None] = {}
    for row in rows:
        if finite_or_none(row.get("mean_psnr")) is None:  # not measured (a note): says nothing either way
            continue
        method = row["method"]
        out.setdefault(method, None)
        low, prior = finite_or_none(row.get("mean_psnr_low")), finite_or_none(row.get("prior_psnr"))
        if low is not None and prior is not None and low > prior:
            out[method] = max(out[method] or 0, int(row["train_images"]))
    return out


HEADER = ["method", "attack", "N", "mean PSNR [95 % interval]", "prior", "recovered", "images (clients)", "iterations",
          "seconds", "mis-specified / stopped short"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    """The table's lines as plain strings (``HEADER``'s columns), one per (method, N), in that order."""
    body = []
    for row in sorted(rows, key=lambda r: (r["method"], int(r["train_images"]))):
        lead = [str(row["method"]), str(row.get("attack", "")), str(row["train_images"])]
        mean = finite_or_none(row.get("mean_psnr"))
        if mean is None:
            body.append(lead + [str(row.get("note") or "not measured")] + [""] * (len(HEADER) - 4))
            continue
        rate = finite_or_none(row.get("success_rate"))
        body.append(lead + [f"{mean:.2f}{interval_text(row.get('mean_psnr_low'), row.get('mean_psnr_high'))}",
                            f"{_or(row.get('prior_psnr'), float('nan')):.2f}",
                            "n/a" if rate is None else f"{100 * rate:.0f} %",
                            f"{row.get('n_images')} ({row.get('n_targets')})", _budget(row), _seconds(row),
                            _check(row)])
    return body


def exposed_lines(rows: list[dict]) -> list[str]:
    """One sentence per method: the largest N whose interval clears the prior, or that none does."""
    return [f"{m}: " + (f"exposed up to N = {n} (interval above the prior)" if n is not None
                        else "no measured N has its interval above the prior")
            for m, n in largest_exposed(rows).items()]


def client_size_table(rows: list[dict]) -> str:
    """A Markdown table, one line per (method, N), and the largest exposed N per method under it."""
    lines = ["| " + " | ".join(HEADER) + " |", "|---|---|---:|---|---:|---:|---|---:|---:|---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in table_rows(rows)]
    return "\n".join(lines + [""] + [f"- {x}" for x in exposed_lines(rows)])


def _seconds(row: dict) -> str:
    number = finite_or_none(row.get("seconds"))
    return "–" if number is None else f"{number:.0f}"


def _budget(row: dict) -> str:
    """The attack's iterations per start in a cell ("default" where the row predates the column), and its
    starts where the row records them (``200 × 1 start``): cells
    of large N may run on a cut budget, which makes a figure at the prior a weaker lower bound."""
    number, starts = finite_or_none(row.get("iterations")), finite_or_none(row.get("restarts"))
    text = "default" if number is None else str(int(number))
    return text if starts is None else f"{text} × {int(starts)} start{'s' if int(starts) != 1 else ''}"


def _check(row: dict) -> str:
    """The forward check's counts over the cell's targets ("not recorded" where the row has none): a cell
    at its prior with targets stopped short is a lower bound, not a method that leaks little; targets whose
    server holds no model of the client follow as "NO MODEL (estimate) k" (the figure is an estimate)."""
    counts = [finite_or_none(row.get(k)) for k in ("mis_specified_targets", "not_converged_targets")]
    unknown = finite_or_none(row.get("model_unknown_targets"))
    return (" / ".join("not recorded" if c is None else str(int(c)) for c in counts)
            + (f" / {NO_MODEL} {int(unknown)}" if unknown else ""))


def _or(value, default: float) -> float:
    """``value`` as a finite float, else ``default`` (a measured 0.0 stays 0.0)."""
    number = finite_or_none(value)
    return default if number is None else number


def client_size_figure(rows: list[dict], title: str = "Leakage vs client size") -> bytes:
    """Mean PSNR with its interval against N (log axis), one line per method, its prior dashed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for k, method in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == method and finite_or_none(r.get("mean_psnr")) is not None),
                      key=lambda r: int(r["train_images"]))
        if not mine:
            continue
        n = [int(r["train_images"]) for r in mine]
        mean = [float(r["mean_psnr"]) for r in mine]
        low = [m - _or(r.get("mean_psnr_low"), m) for m, r in zip(mean, mine)]
        high = [_or(r.get("mean_psnr_high"), m) - m for m, r in zip(mean, mine)]
        colour = f"C{k % 10}"
        ax.errorbar(n, mean, yerr=[low, high], marker="o", capsize=3, color=colour, label=method)
        prior = [finite_or_none(r.get("prior_psnr")) for r in mine]
        # a dash marks the prior at each N too, so that a single client size shows its prior
        ax.plot(n, [math.nan if p is None else p for p in prior], linestyle="--", marker="_", markersize=14,
                color=colour, alpha=0.6)
    ax.set_xscale("log")
    sizes = sorted({int(r["train_images"]) for r in rows if finite_or_none(r.get("mean_psnr")) is not None})
    if sizes:  # the measured N as plain numbers, not powers of ten
        from matplotlib.ticker import NullFormatter

        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("training images per client (N)")
    ax.set_ylabel("mean PSNR (dB); dashed: prior")
    ax.set_title(title)
    if methods:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig, 120)
