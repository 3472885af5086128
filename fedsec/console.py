"""What the commands print: the one-line attack headline, its notes, the audit lines, the
membership-inference lines, and the command line a report records. Each command of ``fedsec.cli`` and ``fedsec.flower.cli`` prints through
these (they return text; the caller echoes it)."""
from __future__ import annotations

import shlex
import sys

import attacks
from attacks.verdicts import forward_check_verdict
from reports.formatting import interval_text

NOTES_SHOWN = 3


def attack_headline(summary: dict, out) -> str:
    """One line of an attack summary for the terminal."""
    def fmt(x, unit=""):
        return "n/a" if x is None else f"{x:.2f}{unit}"

    where = f"{summary['attack']} on {summary['method']}"
    if summary.get("not_applicable"):  # every target answered that the attack does not apply
        return f"{where}: not applicable ({summary['not_applicable']})  → {out}"
    if attacks.get(summary["attack"]).scoring == "labels":
        return f"{where}: class-presence accuracy {fmt(summary['class_presence_accuracy'])}  → {out}"
    modes = ",".join(summary["threat_model"]["modes_used"]) or "n/a"
    ci, rate, rate_ci = summary.get("mean_psnr_ci") or (None, None), summary.get("success_rate"), summary.get("success_rate_ci")
    recovered = (f", recovered {100 * rate:.0f} %{interval_text(*rate_ci, digits=0, scale=100)}"
                 if rate is not None and rate_ci else "")
    verdict = forward_check_verdict(summary.get("mis_specified_targets"), summary.get("not_converged_targets"),
                                    len(summary.get("per_target") or []))
    return (f"{where} ({modes}): mean PSNR {fmt(summary['mean_psnr'], ' dB')}{interval_text(*ci)} "
            f"(prior {fmt(summary['mean_prior_psnr'], ' dB')}, max {fmt(summary['max_psnr'], ' dB')}), "
            f"label accuracy {fmt(summary['label_accuracy'])}, n = {summary['images_scored']} images over "
            f"{summary.get('n_targets', 0)} targets{recovered}  → {out}{' — ' + verdict if verdict else ''}")


def note_lines(notes: list[str], out) -> list[str]:
    """The first notes of a summary, indented, and where the others are."""
    lines = [f"  note: {note}" for note in notes[:NOTES_SHOWN]]
    if len(notes) > NOTES_SHOWN:
        lines.append(f"  ({len(notes) - NOTES_SHOWN} more notes in {out}/summary.json)")
    return lines


def attack_lines(summary: dict, out, prefix: str = "") -> list[str]:
    """An attack's headline (after ``prefix``), the lines the attack adds (``AttackSpec.summary_lines``:
    e.g. classifier fishing's per-round outcome) and its notes."""
    own = attacks.get(summary["attack"]).summary_lines
    return [prefix + attack_headline(summary, out), *(own(summary) if own is not None else []),
            *note_lines(summary["notes"], out)]


def audit_lines(name: str, result: dict, out) -> list[str]:
    """An audit's upload size and findings by severity, then one line per finding."""
    summary = result["summary"]
    return [f"{name}: {summary['upload_kib_per_client_round']:.1f} KiB up per client and round; "
            + ", ".join(f"{n} {s}" for s, n in summary["findings_by_severity"].items() if n) + f" findings → {out}",
            *(f"  [{f['severity']}] {f['code']}: {f['finding']}" for f in result["findings"]),
            *(f"  evidence {ev.get('attack', kind)}: not applicable ({ev['not_applicable']})"
              for kind, ev in (summary.get("evidence") or {}).items() if ev and ev.get("not_applicable"))]


def mia_lines(method: str, summary: dict, out) -> list[str]:
    """A membership-inference audit: the target's accuracy and records, each model's AUC and TPR at
    1 % FPR per attack, the accounted ε with DP, and where the outputs are."""
    records = summary["records"]
    lines = [f"{method}: target accuracy {summary['target_accuracy']:.4f}; {records['members']} members / "
             f"{records['nonmembers']} non-members over {records['clients']} clients"]
    for target, info in summary["targets"].items():
        if not info["available"]:
            lines.append(f"  {target}: not applicable ({info['note']})")
            continue
        parts = []
        for name, m in info["attacks"].items():
            if "auc" in m:
                tpr = m.get("tpr_at_1pct_fpr")
                tpr_text = f"{tpr:.3f}" if isinstance(tpr, float) else "refused"
                parts.append(f"{name} AUC {m['auc']:.3f} TPR@1%FPR {tpr_text}")
        lines.append(f"  {target}: " + "; ".join(parts))
    if "dp" in summary:
        lines.append(f"  DP-SGD sigma {summary['dp']['noise_multiplier']}: accounted epsilon "
                     f"{summary['dp']['epsilon_accounted_max']:.3g} at delta {summary['dp']['delta']:g}")
    lines.append(f"→ {out}/summary.json, {out}/mia.csv, {out}/mia.md, {out}/roc.png")
    return lines


def command_line(command: str, argv: list[str] | None = None) -> str | None:
    """The command line that ran ``fedsec <command>``, for the files that record it; None when this
    process was not started as that command (a library call, a test)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != command:
        return None
    return "fedsec " + shlex.join(argv)
