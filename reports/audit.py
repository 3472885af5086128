"""The audit's Markdown page: pure rendering (summary and findings in, text out)."""
from __future__ import annotations

import math

# finding severities, most severe first (``fedsec.jobs.audit`` grades with these; reports sort by them)
SEVERITIES = ("high", "medium", "low", "info")


def audit_markdown(summary: dict, findings: list[dict]) -> str:
    """``audit.md``: traffic, the findings table and each finding's evidence."""
    where = f" on {summary['dataset']}" if summary.get("dataset") else ""
    setup = ", ".join(f"{summary[k]} {word}" for k, word in (("clients", "clients"), ("rounds", "rounds"))
                      if summary.get(k) is not None)
    extra = ", ".join(f"{word} {summary[k]}" for k, word in (("partition", "partition"), ("seed", "seed"))
                      if summary.get(k) is not None)
    lines = [f"# Upload audit: {summary['method']}{where}", "",
             f"{', '.join(p for p in (setup, extra) if p)}.", "",
             f"* upload per client and round: {summary['upload_kib_per_client_round']:.1f} KiB; "
             f"download: {summary['download_kib_per_client_round']:.1f} KiB",
             f"* upload per round (all clients): {summary['upload_mb_per_round']:.3f} MB; total "
             f"{summary['total_upload_mb']:.3f} MB up, {summary['total_download_mb']:.3f} MB down",
             f"* paper's formula 2 × (415.6 + 0.504·C + 2.25·C) KB: {summary['paper_formula_kb_per_client_round']:.1f} KB",
             *([f"* secure aggregation: {summary['secure_aggregation']}"] if summary.get("secure_aggregation") else []),
             "", "## Findings", "", "| severity | code | finding |", "| --- | --- | --- |"]
    for f in findings:
        lines.append(f"| {f['severity']} | {f['code']} | {f['finding'].replace('|', '/')} |")
    lines += ["", "## Evidence", ""]
    for f in findings:
        lines.append(f"* **{f['code']}**: `{f['evidence']}`".replace("|", "/"))
    attacks = [(kind, ev) for kind, ev in (summary.get("evidence") or {}).items() if ev]
    if attacks:
        lines += ["", "## Evidence attacks", ""]
        for kind, ev in attacks:
            lines.append(f"* {kind}: `{ev.get('attack', '?')}`: {_evidence_text(ev)}")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()), ""]
    return "\n".join(lines)


def _evidence_text(evidence: dict) -> str:
    """One evidence attack's outcome in words: why it did not apply, or its headline figure."""
    if evidence.get("not_applicable"):
        return f"not applicable ({evidence['not_applicable']})"

    def finite(key):
        value = evidence.get(key)
        return value if isinstance(value, (int, float)) and math.isfinite(value) else None

    if finite("mean_psnr") is not None and finite("mean_prior_psnr") is not None:
        return f"mean PSNR {evidence['mean_psnr']:.2f} dB vs prior {evidence['mean_prior_psnr']:.2f} dB"
    if finite("class_presence_accuracy") is not None:
        return f"class-presence accuracy {evidence['class_presence_accuracy']:.2f}"
    return "ran; nothing scored"
