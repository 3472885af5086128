"""Upload-content audit behind ``fedsec audit``: what exactly leaves each client, and what it gives away.

The audit trains with a recorder on every round and inspects every message the server received:

* ``audit.csv`` — one row per uploaded field: method, round, client, field, kind (from the
  method's manifest; ``other`` for anything undeclared), shape, dtype, bytes;
* ``summary.json`` — upload and download bytes (and MB) per round and in total, per client and
  round on average, next to the paper's communication formula;
* ``findings.json`` and ``audit.md`` — findings with a severity, a code, a sentence and the
  evidence. Claims are verified, not repeated: e.g. for FedeCouple every uploaded tensor and every
  row of it is compared with the anchors the client computed (cosine similarity and exact match),
  using the harness-only record of the client's private values.

Evidence from attacks (DLG PSNR, prototype-inversion PSNR, label-inference accuracy) is measured
by ``fedsec.attack.run_attack`` on the same config, each written under ``evidence/<attack>/``.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from attacks.base import Budget
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.engine import GroundTruth
from fedecouple.errors import UserError
from fedecouple.methods.base import FieldSpec

from . import io
from .runner import RunConfig, build_federation, prepare
from .versions import package_versions

SEVERITIES = ("high", "medium", "low", "info")
AUDIT_COLUMNS = ["method", "round", "client", "field", "kind", "shape", "dtype", "bytes"]
KIB = 1024.0


def field_pattern(spec: FieldSpec) -> re.Pattern:
    if not spec.per_class:
        return re.compile(re.escape(spec.name) + r"\Z")
    head, tail = spec.name.split("{k}", 1)
    return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"\Z")


def classify_field(name: str, manifest: list[FieldSpec]) -> FieldSpec | None:
    """The manifest entry an uploaded field name belongs to, or None (an undeclared field)."""
    for spec in manifest:
        if field_pattern(spec).match(name):
            return spec
    return None


def field_rows(method_name: str, upload, manifest: list[FieldSpec]) -> list[dict]:
    rows = []
    for name, tensor in upload.tensors.items():
        spec = classify_field(name, manifest)
        rows.append({"method": method_name, "round": upload.round, "client": upload.client_id, "field": name,
                     "kind": spec.kind if spec else "other", "shape": "x".join(map(str, tensor.shape)) or "scalar",
                     "dtype": str(tensor.dtype).replace("torch.", ""), "bytes": tensor.numel() * tensor.element_size()})
    return rows


def anchor_check(upload_tensors: dict[str, torch.Tensor], anchors: torch.Tensor, atol: float = 1e-6) -> dict:
    """Compare every uploaded float tensor, and every row of it of the anchors' width, with each anchor.

    Returns the maximum cosine similarity found, where, and how many exact matches (allclose)."""
    best = {"max_cosine": -1.0, "field": None, "exact_matches": 0, "rows_compared": 0}
    if anchors.numel() == 0:
        return best
    d = anchors.shape[1]
    for name, tensor in upload_tensors.items():
        if not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1).to(torch.float64)
        candidates = []
        if flat.numel() % d == 0:
            candidates.append(flat.reshape(-1, d))
        if tensor.ndim >= 1 and tensor.shape[-1] == d and tensor.ndim > 1:
            candidates.append(tensor.detach().reshape(-1, d).to(torch.float64))
        for rows in candidates:
            a = anchors.to(torch.float64)
            cos = F.cosine_similarity(rows.unsqueeze(1), a.unsqueeze(0), dim=2)
            best["rows_compared"] += rows.shape[0]
            exact = torch.isclose(rows.unsqueeze(1), a.unsqueeze(0), atol=atol, rtol=0).all(dim=2)
            best["exact_matches"] += int(exact.sum())
            m = float(cos.max())
            if m > best["max_cosine"]:
                best["max_cosine"], best["field"] = m, name
    return best


def paper_communication_kib(num_classes: int) -> float:
    """The paper's per-round formula (Table, comm.): 2 × (415.6 KB + 0.504·C KB + 2.25·C KB)."""
    return 2 * (415.6 + 0.504 * num_classes + 2.25 * num_classes)


def _finding(severity: str, code: str, sentence: str, **evidence) -> dict:
    assert severity in SEVERITIES
    return {"severity": severity, "code": code, "finding": sentence, "evidence": evidence}


def _evidence(config: RunConfig, attack: str, out: Path, iterations: int) -> dict | None:
    """Run one attack on the same config for evidence; None when it does not apply to the method."""
    from .attack import run_attack

    try:
        return run_attack(config, attack, attack_rounds=(0,), targets=2, budget=Budget(iterations=iterations),
                          out=out / "evidence" / attack, progress=False)
    except UserError as exc:
        return {"not_applicable": str(exc)}


LEAK_GAP_DB = 3.0  # measured leakage less than this far above the prior is at chance level: "low"


def psnr_gap(summary: dict | None) -> float | None:
    """Mean PSNR minus mean prior PSNR of an attack summary (None when not measured)."""
    if not summary or summary.get("mean_psnr") is None or summary.get("mean_prior_psnr") is None:
        return None
    return float(summary["mean_psnr"]) - float(summary["mean_prior_psnr"])


def at_chance(summary: dict | None) -> bool | None:
    """Whether an attack's measured leakage is at chance level (within LEAK_GAP_DB of the prior)."""
    gap = psnr_gap(summary)
    return None if gap is None else gap < LEAK_GAP_DB


def _leak_severity(summary: dict | None, base: str) -> tuple[str, str]:
    """Downgrade a finding whose measured leakage is at chance level (``at_chance``)."""
    gap = psnr_gap(summary)
    if gap is None:
        return base, "not measured"
    if at_chance(summary):
        return "low", (f"measured mean PSNR {summary['mean_psnr']:.1f} dB is within {LEAK_GAP_DB:.0f} dB of the prior "
                       f"({summary['mean_prior_psnr']:.1f} dB)")
    return base, f"measured mean PSNR {summary['mean_psnr']:.1f} dB vs prior {summary['mean_prior_psnr']:.1f} dB (+{gap:.1f} dB)"


def run_audit(config: RunConfig, out: str | Path, evidence: bool = True, evidence_iterations: int = 300,
              progress: bool = True) -> dict:
    start = time.perf_counter()
    prep = prepare(config)
    out = Path(out)
    method = prep.method
    recorder = Recorder()
    ground_truth = GroundTruth()
    fed = build_federation(prep, channel=ServerChannel(recorder=recorder), ground_truth=ground_truth)
    manifest = method.manifest(fed.model)
    from tqdm import tqdm

    bar = tqdm(total=config.rounds, desc=f"audit {config.method}", unit="round", disable=not progress)
    per_round = []
    try:
        for _ in range(config.rounds):
            up0, down0 = fed.channel.bytes_up, fed.channel.bytes_down
            fed.run_round()
            per_round.append({"round": fed.completed_rounds - 1, "upload_bytes": fed.channel.bytes_up - up0,
                              "download_bytes": fed.channel.bytes_down - down0})
            bar.update(1)
    finally:
        fed.close()  # e.g. shut down the Ray this run started
        bar.close()

    rows = [r for up in recorder.uploads() for r in field_rows(config.method, up, manifest)]
    frame = pd.DataFrame(rows, columns=AUDIT_COLUMNS)
    labels = prep.dataset.labels
    findings: list[dict] = []
    kinds = set(frame["kind"]) if len(frame) else set()
    num_classes = prep.dataset.num_classes

    if "other" in kinds:
        extra = sorted(set(frame.loc[frame["kind"] == "other", "field"]))
        findings.append(_finding("high", "UNDECLARED_FIELDS",
                                 f"{config.method} uploads fields its manifest does not declare: {', '.join(extra[:10])}",
                                 fields=extra))
    if not getattr(method, "communicates", True) or len(frame) == 0:
        findings.append(_finding("info", "NOTHING_UPLOADED", f"{config.method} sent nothing to the server."))

    ev = {}
    if evidence and len(frame):
        if kinds & {"extractor", "classifier"}:
            ev["dlg"] = _evidence(config, "dlg", out, evidence_iterations)
        if "prototype" in kinds:
            ev["proto"] = _evidence(config, "proto", out, evidence_iterations)
        if kinds & {"classifier", "class_counts", "statistic", "prototype"}:
            ev["labels"] = _evidence(config, "labels", out, evidence_iterations)
    label_ev = ev.get("labels") or {}

    # label distribution disclosed outright
    if kinds & {"class_counts", "statistic"}:
        fields = sorted(set(frame.loc[frame["kind"].isin(["class_counts", "statistic"]), "field"]))
        findings.append(_finding("high", "LABEL_DISTRIBUTION_DISCLOSED",
                                 "Uploads carry per-class counts or statistics from which the server reads the client's "
                                 "exact label distribution.", fields=fields,
                                 label_inference_accuracy=label_ev.get("label_accuracy"),
                                 label_inference_notes=label_ev.get("notes") or label_ev.get("not_applicable")))
    # class presence through per-class keys
    per_class = [s for s in manifest if s.per_class]
    if per_class:
        agree, total = 0, 0
        for up in recorder.uploads():
            keys = set()
            for s in per_class:
                pat = field_pattern(s)
                keys |= {int(m.group(1)) for n in up.tensors if (m := pat.match(n))}
            truth = set(torch.unique(labels[torch.from_numpy(ground_truth.training_set(up.round, up.client_id))]).tolist())
            agree += int(keys == truth)
            total += 1
        findings.append(_finding("medium", "CLASS_PRESENCE_DISCLOSED",
                                 "Per-class fields are sent only for the classes a client holds, so their keys tell the "
                                 "server which classes each client has.",
                                 fields=[s.name for s in per_class], uploads_where_keys_equal_true_classes=f"{agree}/{total}"))
    if "prototype" in kinds:
        sev, why = _leak_severity(ev.get("proto"), "high")
        findings.append(_finding(sev, "PROTOTYPES_DISCLOSED",
                                 f"Uploads carry per-class feature means (prototypes); prototype inversion: {why}.",
                                 proto_attack=_brief(ev.get("proto"))))
    if kinds & {"extractor", "classifier"}:
        full = {"extractor", "classifier"} <= kinds
        sev, why = _leak_severity(ev.get("dlg"), "high" if full else "medium")
        what = "the full model (extractor and classifier)" if full else "the " + ", ".join(sorted(kinds & {"extractor", "classifier"}))
        findings.append(_finding(sev, "MODEL_DISCLOSED",
                                 f"Uploads carry {what}: a gradient-inversion surface; DLG in the textbook setting: {why}.",
                                 dlg_attack=_brief(ev.get("dlg"))))
    if "classifier" in kinds and not kinds & {"class_counts", "statistic"}:
        acc = label_ev.get("label_accuracy")
        findings.append(_finding("medium" if acc is None or acc >= 0.8 else "low", "LABELS_INFERABLE_FROM_UPDATE",
                                 "The uploaded classifier's update reveals which classes the client trained on"
                                 + (f" (measured class-presence accuracy {acc:.2f})." if acc is not None else "."),
                                 labels_attack=_brief(label_ev)))

    # verify claims about private values: anchors must never be uploaded, nor per-class counts
    checked = [(key, priv["anchors"]) for key, priv in ground_truth.private.items() if "anchors" in priv]
    if checked:
        worst = {"max_cosine": -1.0, "field": None, "exact_matches": 0, "rows_compared": 0}
        for (rnd, cid), anchors in checked:
            ex = recorder.get(rnd, cid)
            if ex is None or ex.upload is None:
                continue
            res = anchor_check(dict(ex.upload.tensors), anchors)
            worst["exact_matches"] += res["exact_matches"]
            worst["rows_compared"] += res["rows_compared"]
            if res["max_cosine"] > worst["max_cosine"]:
                worst.update(max_cosine=res["max_cosine"], field=res["field"], where=f"round {rnd} client {cid}")
        leaked = worst["exact_matches"] > 0 or worst["max_cosine"] > 0.999
        findings.append(_finding(
            "high" if leaked else "info", "ANCHORS_UPLOADED" if leaked else "ANCHORS_NOT_UPLOADED",
            ("An uploaded field matches the anchors the client computed: the client's per-class feature means leave it."
             if leaked else
             "Verified: no uploaded tensor, nor any row of one, equals or points the same way as an anchor the client "
             "computed (the paper's claim holds in this run)."),
            anchor_sets_checked=len(checked), **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in worst.items()}))
    if config.method == "fedecouple" or checked:
        count_like = 0
        for up in recorder.uploads():
            truth = torch.bincount(labels[torch.from_numpy(ground_truth.training_set(up.round, up.client_id))],
                                   minlength=num_classes)
            for t in up.tensors.values():
                if t.numel() == num_classes and torch.equal(t.reshape(-1).round().to(torch.int64), truth):
                    count_like += 1
        has_counts = "class_counts" in kinds
        findings.append(_finding(
            "high" if has_counts or count_like else "info",
            "PER_CLASS_COUNTS_UPLOADED" if has_counts or count_like else "NO_PER_CLASS_COUNTS",
            ("Per-class sample counts are uploaded." if has_counts or count_like else
             "Verified: no upload declares per-class counts and no uploaded tensor equals the client's true class counts "
             "(only the total sample count is sent, for eq. 16's weights)."),
            tensors_equal_to_true_counts=count_like))

    rounds_n = max(config.rounds, 1)
    clients_per_round = np.mean([len(fed.sample_clients(r)) for r in range(config.rounds)]) if config.rounds else 0
    total_up = int(sum(r["upload_bytes"] for r in per_round))
    total_down = int(sum(r["download_bytes"] for r in per_round))
    per_client_round_up = total_up / max(rounds_n * clients_per_round, 1)
    per_client_round_down = total_down / max(rounds_n * clients_per_round, 1)
    paper = paper_communication_kib(num_classes)
    findings.append(_finding(
        "info", "COMMUNICATION",
        f"Measured per client and round: {per_client_round_up / KIB:.1f} KiB up + {per_client_round_down / KIB:.1f} KiB "
        f"down = {(per_client_round_up + per_client_round_down) / KIB:.1f} KiB; the paper's formula 2 × (415.6 + "
        f"0.504·C + 2.25·C) KB gives {paper:.1f} KB for C = {num_classes} (for its 32×32 model).",
        measured_kib_per_client_round=(per_client_round_up + per_client_round_down) / KIB, paper_formula_kb=paper))

    findings.sort(key=lambda f: SEVERITIES.index(f["severity"]))
    summary = {
        "method": config.method, "dataset": config.dataset, "rounds": config.rounds, "clients": config.clients,
        "per_round": [{**r, "upload_mb": r["upload_bytes"] / 1e6, "download_mb": r["download_bytes"] / 1e6}
                      for r in per_round],
        "total_upload_bytes": total_up, "total_download_bytes": total_down,
        "total_upload_mb": total_up / 1e6, "total_download_mb": total_down / 1e6,
        "upload_mb_per_round": total_up / 1e6 / rounds_n,
        "upload_kib_per_client_round": per_client_round_up / KIB,
        "download_kib_per_client_round": per_client_round_down / KIB,
        "paper_formula_kb_per_client_round": paper,
        "findings_by_severity": {s: sum(f["severity"] == s for f in findings) for s in SEVERITIES},
        "seconds": round(time.perf_counter() - start, 2), "config": config.to_dict(), "versions": package_versions(),
    }
    io.write_csv(out / "audit.csv", frame)
    io.write_json(out / "findings.json", findings)
    io.write_text(out / "audit.md", audit_markdown(config, summary, findings))
    io.write_json(out / "summary.json", summary)
    return {"summary": summary, "findings": findings}


def _brief(summary: dict | None) -> dict | None:
    if not summary:
        return None
    keys = ("mean_psnr", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_ssim", "label_accuracy", "not_applicable")
    return {k: summary[k] for k in keys if k in summary}


def audit_markdown(config: RunConfig, summary: dict, findings: list[dict]) -> str:
    lines = [f"# Upload audit: {config.method} on {config.dataset}", "",
             f"{config.clients} clients, {config.rounds} rounds, partition {config.partition}, seed {config.seed}.", "",
             f"* upload per client and round: {summary['upload_kib_per_client_round']:.1f} KiB; "
             f"download: {summary['download_kib_per_client_round']:.1f} KiB",
             f"* upload per round (all clients): {summary['upload_mb_per_round']:.3f} MB; total "
             f"{summary['total_upload_mb']:.3f} MB up, {summary['total_download_mb']:.3f} MB down",
             f"* paper's formula 2 × (415.6 + 0.504·C + 2.25·C) KB: {summary['paper_formula_kb_per_client_round']:.1f} KB",
             "", "## Findings", "", "| severity | code | finding |", "| --- | --- | --- |"]
    for f in findings:
        lines.append(f"| {f['severity']} | {f['code']} | {f['finding'].replace('|', '/')} |")
    lines += ["", "## Evidence", ""]
    for f in findings:
        lines.append(f"* **{f['code']}**: `{f['evidence']}`".replace("|", "/"))
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()), ""]
    return "\n".join(lines)
