"""What the commands print: the one-line attack headline, its notes, the audit lines, the
membership-inference lines, and the command line a report records. Each command of ``fedsec.commands`` and ``fedsec.flower_commands`` prints through
these (they return text; the caller echoes it)."""
from __future__ import annotations

import shlex
import sys

import attacks
from attacks.verdicts import forward_check_verdict, model_unknown_targets
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
                                    len(summary.get("per_target") or []), model_unknown_targets(summary))
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
    """An audit's upload size and findings by severity, how the method meets secure aggregation, then
    one line per finding."""
    summary = result["summary"]
    secure = summary.get("secure_aggregation")  # absent from audits written before it was recorded
    return [f"{name}: {summary['upload_kib_per_client_round']:.1f} KiB up per client and round; "
            + ", ".join(f"{n} {s}" for s, n in summary["findings_by_severity"].items() if n) + f" findings → {out}",
            *([f"  secure aggregation: {secure}"] if secure else []),
            *(f"  [{f['severity']}] {f['code']}: {f['finding']}" for f in result["findings"]),
            *(f"  evidence {ev.get('attack', kind)}: not applicable ({ev['not_applicable']})"
              for kind, ev in (summary.get("evidence") or {}).items() if ev and ev.get("not_applicable"))]


def _power_of_two(n: int) -> str:
    return f"2**{int(n).bit_length() - 1}" if n > 0 and int(n) & (int(n) - 1) == 0 else str(n)


def train_protocol_lines(summary: dict, out) -> list[str]:
    """A training run's secure aggregation and dropout (summary's ``secure_aggregation`` and ``round_log``):
    what the server held, the protocol's parameters, what arrived, and a ``warning:`` line for every
    round whose sum was biased by clipping or that was aborted (neither is ever silent)."""
    log = summary.get("round_log")
    if log is None:
        return []
    lines, secure = [], summary.get("secure_aggregation")
    if secure is not None:
        p = secure["protocol"]
        clear = secure.get("in_the_clear")
        hidden = " (hidden: stricter than Flower's SecAgg+)" if p.get("clear_fields") == "hidden" else ""
        beside = ("" if clear is None else f"; in the clear beside it: {', '.join(clear)}" if clear
                  else f"; nothing in the clear{hidden}")
        lines.append(f"  secure aggregation: the server held only each round's sum of the summands, never one "
                     f"client's{beside} (masks with {_share_words(p)}; clipping ±{p['clipping_range']:g}, "
                     f"{_power_of_two(p['quantization_range'])} quantisation steps of {p['quantum']:.3g}, modulus "
                     f"{_power_of_two(p['modulus'])}, weights n / {p['max_weight']:g}"
                     f"{' sent as exact factors' if 'num_shares' in p else ''})")
    where = f"  → {out}/rounds.csv" if out is not None else ""
    dropout = f"dropout {summary['dropout']:g}: " if summary.get("dropout") else ""
    lines.append(f"  {dropout}{log['survivors']} of {log['participants']} uploads arrived over {log['rounds']} "
                 f"rounds ({log['dropped']} dropped out), {log['clipped']} values clipped, "
                 f"{len(log['aborted_rounds'])} round(s) aborted{where}")
    if log["clipped"]:
        clip = secure["protocol"]["clipping_range"] if secure else None
        lines.append(f"warning: {log['clipped']} summed values were beyond ±{clip:g} and clipped before masking, "
                     f"in round(s) {', '.join(map(str, log['clipped_rounds']))}: those sums are biased; raise "
                     f"--sa-clipping-range or --sa-max-weight")
    if log["aborted_rounds"]:
        lines.append(f"warning: round(s) {', '.join(map(str, log['aborted_rounds']))} aborted: some client's "
                     f"neighbourhood kept fewer surviving share-holders than --sa-threshold needs (or a round had "
                     f"fewer than 2 clients), so the server could not unmask and kept its model; lower --dropout or "
                     f"--sa-threshold, or raise --sa-num-shares")
    return lines


def _share_words(p: dict) -> str:
    """The masking graph and unmasking threshold of a protocol's ``describe()`` (a summary written before
    the shares were recorded names ``neighbours`` and a fraction of the round's clients instead)."""
    if "num_shares" not in p:
        graph = "every other client" if p.get("neighbours") is None else f"{p['neighbours']} neighbours (SecAgg+)"
        return f"{graph}; unmasking needs {100 * p['reconstruction_threshold']:g} % of a round's clients"
    shares, threshold = p["num_shares"], p["reconstruction_threshold"]
    if isinstance(shares, float):
        graph = ("every other client" if shares >= 1 else
                 f"its ring neighbours, {100 * shares:g} % of a round's clients sharing its secrets (SecAgg+)")
    else:
        graph = f"its {shares - 1} ring neighbours (SecAgg+)"
    need = (f"{100 * threshold:g} % of them (at least 2)" if isinstance(threshold, float) else f"{threshold} of them")
    return f"{graph}; unmasking needs every client's share-holders, itself included, to keep {need} alive"


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
