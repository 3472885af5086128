"""The report's malicious-server section: pure rendering (rows in, Markdown/HTML text or PNG bytes
out; nothing touches the disk). A row (``fedsec.jobs.report.malicious.SECTION_COLUMNS``): method,
attack, craft, train_images (N), download_check (on/off), status (done, refused, failed) and reason,
n_targets, n_images, the shares of the attacked clients' images rebuilt at ≥ 30 dB
(``rebuilt_30db_share``) and at ≥ prior + 6 dB (``recovered_share``) with ``_ci_low``/``_ci_high``,
mean_psnr with its interval, prior_psnr, inputs_exact_share with its interval, and the check's
crafted_downloads, crafted_refused, honest_downloads, honest_refused."""
from __future__ import annotations

import html
from typing import Mapping

from .figures import png_bytes
from .formatting import finite_or_none, interval_text

PLOT_MALICIOUS = "malicious_by_size.png"
HEADER = ["attack (craft)", "N", "check", "images (clients)", "rebuilt ≥ {db:g} dB [95 % CI]",
          "recovered ≥ prior + {margin:g} dB [95 % CI]", "mean PSNR dB [95 % CI] (prior)", "inputs exact [95 % CI]",
          "crafted downloads refused", "honest downloads refused"]
NOTE = ("A malicious server crafts the download of the attacked clients{rounds} and reads their images back "
        "from the upload; each client trains on exactly N images (its real local training). Shares are of the "
        "attacked clients' images (N each): an image counts as rebuilt at PSNR ≥ {db:g} dB, as recovered at ≥ the "
        "prior (the data set's mean image) + {margin:g} dB; a client that refused its crafted download uploaded "
        "nothing that round, so none of its images is rebuilt. Intervals are 95 % and resample the attacked "
        "clients (shares: hulled with Clopper–Pearson). \"inputs exact\": the crafted layer's input recovered to a "
        "relative error ≤ 1e-3, where the attack reports it. check on: every client tests each download before "
        "training and refuses one that looks crafted (`defenses.download_check`); honest downloads "
        "refused are its false alarms in the same run.")


def _share(row: Mapping, name: str) -> str:
    share = finite_or_none(row.get(f"{name}_share"))
    if share is None:
        return "n/a"
    low, high = finite_or_none(row.get(f"{name}_ci_low")), finite_or_none(row.get(f"{name}_ci_high"))
    interval = "" if low is None or high is None else f" [{100 * low:.0f}, {100 * high:.0f}]"
    count = row.get(name)
    return f"{100 * share:.0f} %{interval}" + ("" if count is None else f" ({int(count)})")


def _psnr(row: Mapping) -> str:
    mean = finite_or_none(row.get("mean_psnr"))
    if mean is None:
        return "nothing rebuilt" if row.get("status") == "done" else "n/a"
    prior = finite_or_none(row.get("prior_psnr"))
    return (f"{mean:.2f}{interval_text(row.get('mean_psnr_ci_low'), row.get('mean_psnr_ci_high'))}"
            + ("" if prior is None else f" ({prior:.2f})"))


def _downloads(row: Mapping, refused: str, total: str) -> str:
    if row.get("download_check") != "on" or row.get(total) is None:
        return "–"
    return f"{int(row[refused])} / {int(row[total])}"


def method_rows(rows: list[Mapping], method: str) -> list[list[str]]:
    """One method's table as plain strings: one line per (attack, N, check); a method the attack
    cannot reach gets one line per attack with the reason."""
    body, refused = [], set()
    for r in rows:
        if r["method"] != method:
            continue
        what = f"{r['attack']} ({r['craft']})" if r.get("craft") else str(r["attack"])
        if r.get("status") != "done":
            if (r["attack"], r.get("reason")) not in refused:  # the same reason at every N: said once
                refused.add((r["attack"], r.get("reason")))
                body.append([what, "all", "–", f"{r.get('status')}: {r.get('reason') or 'not run'}"] + [""] * 6)
            continue
        exact = finite_or_none(r.get("inputs_exact_share"))
        body.append([what, str(r["train_images"]), str(r["download_check"]),
                     f"{int(r['n_images'])} ({int(r['n_targets'])})", _share(r, "rebuilt_30db"), _share(r, "recovered"),
                     _psnr(r), "n/a" if exact is None else
                     f"{100 * exact:.0f} %{_percent_interval(r.get('inputs_exact_ci_low'), r.get('inputs_exact_ci_high'))}",
                     _downloads(r, "crafted_refused", "crafted_downloads"),
                     _downloads(r, "honest_refused", "honest_downloads")])
    return body


def _percent_interval(low, high) -> str:
    low, high = finite_or_none(low), finite_or_none(high)
    return "" if low is None or high is None else f" [{100 * low:.0f}, {100 * high:.0f}]"


def header(meta: Mapping) -> list[str]:
    return [h.format(db=meta.get("rebuilt_db", 30.0), margin=meta.get("margin_db", 6.0)) for h in HEADER]


def note(meta: Mapping) -> str:
    by_attack = meta.get("rounds") or {}
    if not isinstance(by_attack, Mapping):  # one list for every attack
        by_attack = {"": by_attack}

    def named(rounds: list) -> str:
        return f"round{'s' if len(rounds) > 1 else ''} {', '.join(map(str, rounds))}"

    distinct = {tuple(r) for r in by_attack.values() if r}
    if len(distinct) == 1:
        where = f" in {named(list(distinct.pop()))}"
    else:
        where = "" if not distinct else " in " + "; ".join(f"{named(r)} ({a})" for a, r in by_attack.items() if r)
    return NOTE.format(rounds=where, db=meta.get("rebuilt_db", 30.0), margin=meta.get("margin_db", 6.0))


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def section_markdown(meta: Mapping, methods: list[str]) -> list[str]:
    """The section's Markdown lines: the note, one table per method, the figure."""
    section = meta.get("malicious") or {}
    if not section:
        return []
    out = ["## Malicious server", "", note(section), ""]
    head = header(section)
    for method in methods:
        body = method_rows(section["rows"], method)
        if not body:
            continue
        out += [f"### {method}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in body] + [""]
    return out + [f"![Share of a client's images rebuilt against N]({PLOT_MALICIOUS})", ""]


def section_html(meta: Mapping, methods: list[str], plot: bytes | None, data_uri) -> list[str]:
    """The same section in HTML (every string escaped; the figure as a data URI)."""
    section = meta.get("malicious") or {}
    if not section:
        return []
    e = lambda text: html.escape(str(text), quote=True)  # noqa: E731
    out = ["<h2>Malicious server</h2>", f'<p class="muted">{e(note(section))}</p>']
    head = "<tr>" + "".join(f"<th>{e(h)}</th>" for h in header(section)) + "</tr>"
    for method in methods:
        body = method_rows(section["rows"], method)
        if not body:
            continue
        out += [f"<h3>{e(method)}</h3>", "<table>", head]
        out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in body] + ["</table>"]
    if plot is not None:
        out.append(f'<figure><img src="{data_uri(plot)}" alt="Share rebuilt against N">'
                   f"<figcaption>Share of a client's images rebuilt against its number of images N</figcaption></figure>")
    return out


def share_by_size_figure(meta: Mapping) -> bytes:
    """Two panels against N: the share of the attacked clients' images rebuilt at ≥ 30 dB, and at ≥
    prior + 6 dB; one line per method and attack (the check off; with it, crosses on a dotted line),
    with the 95 % intervals as error bars."""
    from matplotlib.figure import Figure

    section = meta.get("malicious") or {}
    rows = [r for r in section.get("rows", []) if r.get("status") == "done"
            and finite_or_none(r.get("rebuilt_30db_share")) is not None]
    fig = Figure(figsize=(10.0, 4.2))
    axes = fig.subplots(1, 2, sharey=True)
    rules = (("rebuilt_30db", f"rebuilt at ≥ {section.get('rebuilt_db', 30.0):g} dB"),
             ("recovered", f"recovered at ≥ prior + {section.get('margin_db', 6.0):g} dB"))
    for ax, (name, title) in zip(axes, rules):
        _share_panel(ax, rows, name)
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("attacked clients' images (%)")
    unreached = sorted({r["method"] for r in section.get("rows", []) if r.get("status") == "refused"})
    if unreached:
        axes[0].text(0.01, 0.98, f"not reached: {', '.join(unreached)}", transform=axes[0].transAxes, va="top",
                     fontsize=7)
    if rows:
        axes[1].legend(fontsize=7)
    else:
        axes[0].text(0.5, 0.5, "no method reached", ha="center", va="center", transform=axes[0].transAxes)
    fig.suptitle("Malicious server: share of a client's images rebuilt", fontsize=10)
    fig.tight_layout()
    return png_bytes(fig, 100)


def _share_panel(ax, rows: list[Mapping], name: str) -> None:
    """One panel: ``<name>_share`` with its interval against N, one line per (method, attack, check)."""
    from matplotlib.ticker import NullLocator

    lines = list(dict.fromkeys((r["method"], r["attack"]) for r in rows))
    for k, (method, attack) in enumerate(lines):
        for check, style in (("off", dict(marker="o", linestyle="-")), ("on", dict(marker="x", linestyle=":"))):
            mine = sorted((r for r in rows if (r["method"], r["attack"]) == (method, attack)
                           and r["download_check"] == check), key=lambda r: int(r["train_images"]))
            if not mine:
                continue
            share = [100 * float(r[f"{name}_share"]) for r in mine]
            low = [s - 100 * _or(r.get(f"{name}_ci_low"), s / 100) for s, r in zip(share, mine)]
            high = [100 * _or(r.get(f"{name}_ci_high"), s / 100) - s for s, r in zip(share, mine)]
            label = f"{method} ({attack})" + (", download check on" if check == "on" else "")
            ax.errorbar([int(r["train_images"]) for r in mine], share, yerr=[low, high], capsize=3,
                        color=f"C{k % 10}", label=label, **style)
    sizes = sorted({int(r["train_images"]) for r in rows})
    ax.set_xscale("log")
    if sizes:  # the measured N as plain numbers, not powers of ten
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_ylim(-3, 103)
    ax.set_xlabel("training images per client (N)")


def _or(value, default: float) -> float:
    """``value`` as a finite float, else ``default`` (a measured 0.0 stays 0.0)."""
    number = finite_or_none(value)
    return default if number is None else number
