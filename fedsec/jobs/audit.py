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

Evidence from attacks is measured by ``fedsec.jobs.attack.run_attack`` on the same config, each written
under ``evidence/<attack>/``: for each kind of attack (gradient, image, labels) the first registered
attack of that kind that applies to what the method uploads (today: DLG, prototype inversion, label
inference).

Two halves, as for attacks: ``run_audit`` trains in fedsec's engine and hands the recorded run to
``audit_recorded``; a federation recorded elsewhere (a Flower app) goes straight to it.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

import attacks
from attacks.recorded import RecordedRun
from attacks.verdicts import (LEAK_GAP_DB, at_chance, forward_check_verdict, model_unknown_targets, no_model_words,
                             presence_is_low, psnr_gap)
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.engine import GroundTruth
from fedecouple.errors import UserError
from fedecouple.methods.base import FieldSpec
from fedecouple.methods.facets import PerClientFields, SecureSummation, facet
from fedecouple.models import group_of, set_params
from reports.audit import SEVERITIES, audit_markdown
from reports.formatting import interval_text

from .. import io
from ..field_names import for_cli
from ..runner import RunConfig, build_federation, prepare
from ..versions import provenance

AUDIT_COLUMNS = ["method", "round", "client", "field", "kind", "shape", "dtype", "bytes"]
KIB = 1024.0


def classify_field(name: str, manifest: list[FieldSpec]) -> FieldSpec | None:
    """The manifest entry an uploaded field name belongs to, or None (an undeclared field)."""
    for spec in manifest:
        if spec.pattern.match(name):
            return spec
    return None


def field_rows(method_name: str, upload, manifest: list[FieldSpec]) -> list[dict]:
    masked = bool(upload.meta.get("secure_aggregation"))  # the protocol's vector, not a field of the manifest
    rows = []
    for name, tensor in upload.tensors.items():
        spec = classify_field(name, manifest)
        rows.append({"method": method_name, "round": upload.round, "client": upload.client_id, "field": name,
                     # under secure aggregation only the protocol's vector is masked (Flower leaves metrics clear)
                     "kind": "masked" if masked and name == "masked" else spec.kind if spec else "other",
                     "shape": "x".join(map(str, tensor.shape)) or "scalar",
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


def _measured(summary: dict) -> str:
    """The measurement behind a finding: mean PSNR with its interval (or why there is none), n, prior."""
    ci = summary.get("mean_psnr_ci") or (None, None)
    return (f"measured mean PSNR {summary['mean_psnr']:.1f} dB{interval_text(*ci, digits=1)} over "
            f"{summary.get('n_images', '?')} images vs prior {summary['mean_prior_psnr']:.1f} dB")


def _leak_severity(summary: dict | None, base: str) -> tuple[str, str]:
    """Downgrade a finding whose measured leakage is at chance level (``at_chance``)."""
    if (summary or {}).get("not_applicable"):
        return base, f"not applicable ({summary['not_applicable']})"
    gap = psnr_gap(summary)
    if gap is None:
        return base, "not measured"
    n, unknown = len(summary.get("per_target") or []), model_unknown_targets(summary)
    verdict = forward_check_verdict(summary.get("mis_specified_targets"), summary.get("not_converged_targets"), n,
                                    unknown)
    if unknown and not summary.get("mis_specified"):  # the method gives the server no model: an estimate
        return base, f"{_measured(summary)} ({gap:+.1f} dB), an estimate; {no_model_words(unknown, n)}"
    if summary.get("mis_specified") or (verdict and gap < LEAK_GAP_DB):
        return base, f"{_measured(summary)}; {verdict}: no evidence either way"
    if at_chance(summary):
        return "low", f"{_measured(summary)}: within {LEAK_GAP_DB:.0f} dB of the prior"
    return base, f"{_measured(summary)} (+{gap:.1f} dB){'; ' + verdict if verdict else ''}"


# the attack kinds whose results are the findings' evidence: what an honest-but-curious server rebuilds
# (a malicious server's crafted downloads are `fedsec attack trap|binning|fish`, not an audit of uploads)
EVIDENCE_KINDS = ("gradient", "image", "labels")


def evidence_attacks(method_name: str, kinds: set[str]) -> dict[str, str]:
    """{attack kind: attack name}: the first registered attack of each of ``EVIDENCE_KINDS`` that applies
    to uploads of ``kinds`` (the audit's evidence)."""
    chosen: dict[str, str] = {}
    for name, spec in attacks.ATTACKS.items():
        if spec.kind in EVIDENCE_KINDS and spec.kind not in chosen and spec.not_applicable(method_name, kinds) is None:
            chosen[spec.kind] = name
    return chosen


def gather_evidence(method_name: str, kinds: set[str], run_one: Callable[[str], dict]) -> dict[str, dict]:
    """{attack kind: the summary ``run_one(attack name)`` returns}, for each evidence attack; an attack
    that turns out not to apply (a ``UserError`` before it ran, or nothing it could score) is kept as
    ``{"attack", "not_applicable"}``: the audit reports it as a line."""
    measured = {}
    for kind, name in evidence_attacks(method_name, kinds).items():
        try:
            measured[kind] = run_one(name)
        except UserError as exc:
            measured[kind] = {"attack": name, "not_applicable": for_cli(exc).strip().rstrip(".")}
    return measured


def _measure_evidence(config: RunConfig, kinds: set[str], out: Path, iterations: int) -> dict[str, dict]:
    """{attack kind: the summary of the evidence attack run on the same config}."""
    from .attack import AttackSettings, run_attack

    return gather_evidence(config.method, kinds, lambda name: run_attack(
        config, AttackSettings(attack=name, iterations=iterations),
        out=None if out is None else out / "evidence" / name, progress=False))


# ----------------------------------------------------------------------------------------------
# training, then auditing the recorded run
# ----------------------------------------------------------------------------------------------
def run_audit(config: RunConfig, out: str | Path | None, evidence: bool = True, evidence_iterations: int = 300,
              progress: bool = True, recorded: RecordedRun | None = None) -> dict:
    """Train ``config`` with a recorder on every round, audit what was recorded, write the outputs.
    ``recorded``: that training, already done and recorded on every round (a report's train stage)."""
    start = time.perf_counter()
    run = recorded if recorded is not None else _train_recording_everything(config, progress)
    uploaded = next(run.recorder.uploads(), None) is not None
    secure = run.recorder.secure is not None  # the server held sums: per-client evidence attacks do not apply
    measured = _measure_evidence(config, run.upload_kinds(), None if out is None else Path(out), evidence_iterations) \
        if evidence and uploaded and not secure else {}
    context = {"dataset": config.data.dataset, "clients": config.data.clients, "partition": config.data.partition,
               "seed": config.federation.seed, "config": config.to_dict()}
    return audit_recorded(run, out, config.federation.rounds, measured, context, start,
                          inversion_iterations=evidence_iterations if evidence else 0,
                          sum_evidence=evidence and secure and uploaded)


def _train_recording_everything(config: RunConfig, progress: bool) -> RecordedRun:
    from tqdm import tqdm

    prep = prepare(config)
    recorder, ground_truth = Recorder(), GroundTruth()
    fed = build_federation(prep, channel=ServerChannel(recorder=recorder), ground_truth=ground_truth)
    initial_model = copy.deepcopy(fed.model).cpu()  # the audit's own inversions run on the CPU
    bar = tqdm(total=config.federation.rounds, desc=f"audit {config.method}", unit="round", disable=not progress)
    try:
        fed.run(config.federation.rounds, on_round=lambda r, rows: bar.update(1))
    finally:
        fed.close()  # e.g. shut down the Ray this run started
        bar.close()
    return RecordedRun(recorder, ground_truth, prep.dataset, prep.method, lambda: copy.deepcopy(initial_model),
                       config.federation.train, config.method)


def audit_recorded(run: RecordedRun, out: str | Path | None, rounds: int, evidence: dict[str, dict] | None = None,
                   context: dict | None = None, start: float | None = None, inversion_iterations: int = 0,
                   sum_evidence: bool = False) -> dict:
    """Audit every upload of a recorded run: fields, bytes, findings (with ``evidence``: {attack kind:
    attack summary} measured elsewhere; ``inversion_iterations`` > 0 also measures what inverting
    rows that point like private anchors gives; ``sum_evidence``, under secure aggregation, measures
    ``sum-labels`` on every decoded round: ``sum_label_evidence``). Writes audit.csv, findings.json, audit.md,
    summary.json into ``out`` (None: nothing written); returns the summary, findings and rows."""
    start = time.perf_counter() if start is None else start
    manifest = run.method.manifest(run.make_model())
    uploads = list(run.recorder.uploads())
    frame = pd.DataFrame([r for up in uploads for r in field_rows(run.method.name, up, manifest)], columns=AUDIT_COLUMNS)
    kinds = set(frame["kind"]) if len(frame) else set()
    evidence = evidence or {}
    findings = (_protocol_findings(run, frame, kinds) + _label_findings(run, manifest, uploads, frame, kinds, evidence)
                + _reconstruction_findings(kinds, evidence)
                + _private_value_findings(run, uploads, kinds, inversion_iterations)
                + _kept_parameter_findings(run, uploads) + _secure_findings(run, kinds))
    sum_brief = None
    if sum_evidence:
        decoded = [r for r, record in sorted(run.recorder.aggregates.items()) if not record.aborted]
        label, sum_brief = sum_label_evidence(run, decoded, progress=False)
        findings += [label] if label else []
    traffic = _traffic(run, rounds)
    findings.append(_communication_finding(traffic, run.dataset.num_classes))
    findings.sort(key=lambda f: SEVERITIES.index(f["severity"]))
    summary = {"method": run.method.name, "run": run.label, "rounds": rounds, **traffic,
               "secure_aggregation": secure_aggregation_status(run.method, run.recorder),
               "findings_by_severity": {s: sum(f["severity"] == s for f in findings) for s in SEVERITIES},
               "evidence": {kind: _brief(ev) for kind, ev in evidence.items()} | ({"labels": sum_brief} if sum_brief
                                                                                   else {}),
               **(context or {}), "seconds": round(time.perf_counter() - start, 2), **provenance()}
    if out is not None:  # None: a Python caller keeps the audit in memory
        write_audit(Path(out), frame, findings, summary)
    return {"summary": summary, "findings": findings, "rows": frame}


def write_audit(out: Path, rows, findings: list[dict], summary: dict) -> None:
    """An audit's files: audit.csv (one row per uploaded field), findings.json, audit.md, summary.json."""
    io.write_csv(out / "audit.csv", rows)
    io.write_json(out / "findings.json", findings)
    io.write_text(out / "audit.md", audit_markdown(summary, findings))
    io.write_json(out / "summary.json", summary)


def secure_aggregation_status(method, recorder=None) -> str:
    """How the method meets secure aggregation, from its declaration (``SecureSummation`` and its
    ``secure_variant_note``, or ``PerClientFields``): "runs on the sum", "secure variant: <how it differs>",
    "refuses: <the fields its server reads one client at a time>", or "sends nothing". For a run
    recorded under secure aggregation (``recorder.secure`` set), followed by the fields its masked
    uploads carried in the clear ("; in the clear: sample_count"), or "; nothing in the clear"."""
    if not method.communicates:
        return "sends nothing"
    if not isinstance(method, SecureSummation):
        declared = facet(method, PerClientFields)
        return "refuses: " + (", ".join(declared.per_client_fields if declared else ()) or "every upload field")
    status = f"secure variant: {method.secure_variant_note}" if method.secure_variant_note else "runs on the sum"
    if recorder is None or getattr(recorder, "secure", None) is None:
        return status
    clear = sorted({name for up in recorder.uploads() if up.meta.get("secure_aggregation")
                    for name in up.tensors if name != "masked"})
    mode = recorder.secure.clear_fields
    return status + (f"; in the clear: {', '.join(clear)}" if clear else f"; nothing in the clear ({mode})")


def _protocol_findings(run: RecordedRun, frame: pd.DataFrame, kinds: set[str]) -> list[dict]:
    findings = []
    if "other" in kinds:
        extra = sorted(set(frame.loc[frame["kind"] == "other", "field"]))
        findings.append(_finding("high", "UNDECLARED_FIELDS",
                                 f"{run.method.name} uploads fields its manifest does not declare: "
                                 f"{', '.join(extra[:10])}", fields=extra))
    if not run.method.communicates or len(frame) == 0:
        findings.append(_finding("info", "NOTHING_UPLOADED", f"{run.method.name} sent nothing to the server."))
    return findings


def sum_label_evidence(recorded, rounds: list[int], progress: bool) -> tuple[dict | None, dict]:
    """The ``ROUND_LABELS_FROM_SUM`` finding (None: nothing scored) and the evidence brief of
    ``sum-labels`` on every round of ``recorded``: the round's label histogram from its sum."""
    import attacks
    from attacks.base import Budget, NotApplicable
    from attacks.recorded import ThreatModel

    if "sum-labels" not in attacks.names("aggregate"):
        return None, {"attack": "sum-labels", "not_applicable": "no round-level label attack is registered"}
    from attacks.harness import attack_rounds

    try:
        outcome = attack_rounds(recorded, "sum-labels", rounds, ThreatModel(), Budget(iterations=1), seed=0,
                                progress=progress)
    except NotApplicable as exc:
        return None, {"attack": "sum-labels", "not_applicable": str(exc)}
    hist = outcome.summary.statistics.get("histogram")
    if not hist:
        return None, {"attack": "sum-labels", "not_applicable": "; ".join(outcome.summary.notes) or "nothing scored"}
    images = sum(row["true_count"] for row in outcome.rows) / max(hist["rounds"], 1)
    brief = {"attack": "sum-labels", "class_presence_accuracy": outcome.summary.class_presence_accuracy,
             "images_per_round": images, **{k: hist[k] for k in ("rounds", "exact_rounds", "mean_count_error",
                                                                  "mean_count_error_ci", "count_errors")}}
    measured = (f"exact in {hist['exact_rounds']} of {hist['rounds']} round(s), mean count error "
                f"{hist['mean_count_error']:.1f} of {images:.0f} images per round (sum-labels)")
    sentence = (f"The sum still gives away each round's label histogram over all surviving clients: {measured}."
                if hist["exact_rounds"] else
                f"Reading each round's label histogram from the sum did not succeed here: {measured}; the summed "
                f"classifier-bias rule is exact for one local step, and these clients took more.")
    finding = {"severity": "medium" if hist["exact_rounds"] else "low", "code": "ROUND_LABELS_FROM_SUM",
               "finding": sentence, "evidence": brief}
    return finding, brief


def _secure_findings(run: RecordedRun, kinds: set[str]) -> list[dict]:
    """Under secure aggregation: what the server held instead of uploads (each round's decoded sum)."""
    if "masked" not in kinds:
        return []
    records = [run.recorder.aggregates[r] for r in sorted(run.recorder.aggregates)]
    aborted = [r.round for r in records if r.aborted]
    return [_finding("info", "SECURE_AGGREGATION",
                     f"Every upload's parameters reached the server as one masked integer vector, uniform over the "
                     f"modulus: no parameter of one client is readable. The server decoded the sum of each round's arrived uploads "
                     f"in {len(records) - len(aborted)} of {len(records)} round(s)"
                     + (f" (round(s) {', '.join(map(str, aborted))} aborted)" if aborted else "")
                     + ". " + _later_pass_sentence(run.recorder)
                     + "What a round's sum still gives away is for the round-level attacks (fedsec attack sum-*; "
                     "ROUND_LABELS_FROM_SUM when the audit measures evidence).",
                     rounds=[r.round for r in records], aborted_rounds=aborted,
                     second_passes=sorted(getattr(run.recorder, "later_passes", {})),
                     survivors=[len(r.survivors) for r in records], dropped=[len(r.dropped) for r in records],
                     clipped=[r.clipped for r in records])]


def _later_pass_sentence(recorder) -> str:
    """What a two-pass method's later sums gave the server beyond the first (FedeCouple's eq. 16), or ""."""
    later = getattr(recorder, "later_passes", {})
    if not later:
        return ""
    return (f"In {len(later)} round(s) the server also sent the first sum's average back and decoded a second "
            f"masked sum (FedeCouple: Σ c_i·ω_i and Σ c_i over that pass's survivors, c_i each client's cosine to "
            f"the average): one more linear combination of the same uploads, never one client's. ")


def _true_classes(run: RecordedRun, round: int, client: int) -> torch.Tensor:
    return run.dataset.labels[torch.from_numpy(run.ground_truth.training_set(round, client))]


def _label_findings(run: RecordedRun, manifest: list[FieldSpec], uploads: list, frame: pd.DataFrame,
                    kinds: set[str], evidence: dict) -> list[dict]:
    findings = []
    label_ev = evidence.get("labels") or {}
    presence = label_ev.get("class_presence_accuracy")
    if kinds & {"class_counts", "statistic"}:  # the label distribution disclosed outright
        fields = sorted(set(frame.loc[frame["kind"].isin(["class_counts", "statistic"]), "field"]))
        findings.append(_finding("high", "LABEL_DISTRIBUTION_DISCLOSED",
                                 "Uploads carry per-class counts or statistics from which the server reads the client's "
                                 "exact label distribution.", fields=fields, class_presence_accuracy=presence,
                                 label_inference_notes=label_ev.get("notes") or label_ev.get("not_applicable")))
    per_class = [s for s in manifest if s.per_class]
    if per_class and "masked" not in kinds:  # class presence through per-class keys (masked uploads have none)
        agree = 0
        for up in uploads:
            keys = {int(m.group(1)) for s in per_class for n in up.tensors if (m := s.pattern.match(n))}
            agree += int(keys == set(torch.unique(_true_classes(run, up.round, up.client_id)).tolist()))
        findings.append(_finding("medium", "CLASS_PRESENCE_DISCLOSED",
                                 "Per-class fields are sent only for the classes a client holds, so their keys tell the "
                                 "server which classes each client has.", fields=[s.name for s in per_class],
                                 uploads_where_keys_equal_true_classes=f"{agree}/{len(uploads)}"))
    if "classifier" in kinds and not kinds & {"class_counts", "statistic"}:
        findings.append(_finding("low" if presence_is_low(presence) else "medium",
                                 "LABELS_INFERABLE_FROM_UPDATE",
                                 "The uploaded classifier's update reveals which classes the client trained on"
                                 + (f" (measured class-presence accuracy {presence:.2f})." if presence is not None else "."),
                                 labels_attack=_brief(label_ev)))
    return findings


def _reconstruction_findings(kinds: set[str], evidence: dict) -> list[dict]:
    findings = []
    if "prototype" in kinds:
        sev, why = _leak_severity(evidence.get("image"), "high")
        findings.append(_finding(sev, "PROTOTYPES_DISCLOSED",
                                 f"Uploads carry per-class feature means (prototypes); prototype inversion: {why}.",
                                 proto_attack=_brief(evidence.get("image"))))
    if kinds & {"extractor", "classifier"}:
        full = {"extractor", "classifier"} <= kinds
        sev, why = _leak_severity(evidence.get("gradient"), "high" if full else "medium")
        what = ("the full model (extractor and classifier)" if full
                else "the " + ", ".join(sorted(kinds & {"extractor", "classifier"})))
        findings.append(_finding(sev, "MODEL_DISCLOSED",
                                 f"Uploads carry {what}: a gradient-inversion surface; gradient inversion in the textbook "
                                 f"setting: {why}.", gradient_attack=_brief(evidence.get("gradient"))))
    return findings


def _private_value_findings(run: RecordedRun, uploads: list, kinds: set[str], inversion_iterations: int) -> list[dict]:
    """Verify claims about private values: anchors are never uploaded, nor per-class counts."""
    findings = []
    checked = [(key, priv["anchors"]) for key, priv in sorted(run.ground_truth.private.items()) if "anchors" in priv]
    if checked:
        findings.append(_anchor_finding(run, checked, inversion_iterations))
    if run.method.name == "fedecouple" or checked:
        findings.append(_count_finding(run, uploads, kinds))
    return findings


def _kept_parameter_findings(run: RecordedRun, uploads: list) -> list[dict]:
    """Verify which model parameters never left the clients: none of the recorded uploads carried them
    (e.g. FedPer's head). Checked against the model, not the method's manifest."""
    uploads = [up for up in uploads if not up.meta.get("secure_aggregation")]  # masked: every value left, hidden
    if not uploads:
        return []
    names = [name for name, _ in run.make_model().named_parameters()]
    sent = {name for up in uploads for name in up.tensors}
    kept = [name for name in names if name not in sent]
    if not kept:
        return []
    groups = {}
    for name in names:
        groups.setdefault(group_of(name), []).append(name)
    parts = [f"the {group}" if all(n in kept for n in members) else ", ".join(n for n in members if n in kept)
             for group, members in groups.items() if any(n in kept for n in members)]
    rounds = sorted({up.round for up in uploads})
    return [_finding("info", "PARAMETERS_NEVER_UPLOADED",
                     f"Verified: {' and '.join(parts)} never left the clients: none of the {len(uploads)} recorded "
                     f"uploads ({len(rounds)} round(s)) carried {', '.join(kept)}.",
                     parameters=kept, uploads_checked=len(uploads), rounds=rounds)]



ANCHOR_APPROXIMATE = 0.5  # a cosine this high between an uploaded row and an anchor: its direction leaks


def anchor_alignment(run: RecordedRun, checked: list) -> list[dict]:
    """Per checked (round, client, class held): the cosine between the uploaded classifier row of
    that class and the client's anchor of it (FedeCouple's personal classifier is trained to
    separate features pulled towards those anchors, so its rows can point like them)."""
    rows = []
    for (rnd, cid), anchors in checked:
        exchange = run.recorder.get(rnd, cid)
        weight = None if exchange is None or exchange.upload is None else exchange.upload.tensors.get("classifier.weight")
        if weight is None or weight.shape[1] != anchors.shape[1]:
            continue
        held = torch.unique(_true_classes(run, rnd, cid)).tolist()
        for k, anchor in zip(held, anchors):
            rows.append({"round": rnd, "client": cid, "class": int(k),
                         "cosine": float(F.cosine_similarity(weight[k].double(), anchor.double(), dim=0))})
    return rows


def anchor_inversion(run: RecordedRun, alignment: list[dict], iterations: int, limit: int = 4) -> dict | None:
    """What an attacker gains from the rows' directions: each of the best-aligned rows (at most
    ``limit``) inverted as a feature direction through the extractor the server sent that round
    (the one the anchors came from), scored against the client's images of that class, beside the
    data-set mean image and the class-mean image of the other clients' data."""
    from attacks.metrics import psnr
    from attacks.inversion.proto import invert_prototype

    if not alignment or iterations < 1:
        return None
    scores = []
    for row in sorted(alignment, key=lambda r: -r["cosine"])[:limit]:
        exchange = run.recorder.get(row["round"], row["client"])
        model = run.make_model()
        set_params(model, {n: v for n, v in exchange.download.tensors.items() if n.startswith("extractor.")})
        direction = exchange.upload.tensors["classifier.weight"][row["class"]]
        image, _, _ = invert_prototype(model, direction, tuple(run.dataset.images.shape[1:]), iterations,
                                       seed=row["round"] * 1009 + row["client"], match_norm=False)
        own = run.ground_truth.training_set(row["round"], row["client"])
        labels = run.dataset.labels
        pool = torch.from_numpy(own)[labels[torch.from_numpy(own)] == row["class"]]
        others = torch.ones(len(labels), dtype=torch.bool)
        others[torch.from_numpy(own)] = False
        class_mean = run.dataset.images[others & (labels == row["class"])].mean(0)
        scores.append({**row, "psnr": max(psnr(image, run.dataset.images[i]) for i in pool.tolist()),
                       "class_prior_psnr": max(psnr(class_mean, run.dataset.images[i]) for i in pool.tolist()),
                       "prior_psnr": max(psnr(run.dataset.images.mean(0), run.dataset.images[i]) for i in pool.tolist())})
    mean = lambda key: float(np.mean([s[key] for s in scores]))  # noqa: E731
    return {"inverted_rows": len(scores), "mean_psnr": mean("psnr"), "mean_class_prior_psnr": mean("class_prior_psnr"),
            "mean_prior_psnr": mean("prior_psnr"), "per_row": scores}


def _anchor_finding(run: RecordedRun, checked: list, inversion_iterations: int = 0) -> dict:
    """Graded: exact (an uploaded tensor or row equals an anchor, or points exactly its way), approximate
    (a classifier row points like an anchor: cosine ≥ ANCHOR_APPROXIMATE; with evidence, what inverting
    those rows gives), or none."""
    worst = {"max_cosine": -1.0, "field": None, "exact_matches": 0, "rows_compared": 0}
    for (rnd, cid), anchors in checked:
        exchange = run.recorder.get(rnd, cid)
        if exchange is None or exchange.upload is None:
            continue
        res = anchor_check(dict(exchange.upload.tensors), anchors)
        worst["exact_matches"] += res["exact_matches"]
        worst["rows_compared"] += res["rows_compared"]
        if res["max_cosine"] > worst["max_cosine"]:
            worst.update(max_cosine=res["max_cosine"], field=res["field"], where=f"round {rnd} client {cid}")
    alignment = anchor_alignment(run, checked)
    grade = ("exact" if worst["exact_matches"] > 0 or worst["max_cosine"] > 0.999 else
             "approximate" if worst["max_cosine"] >= ANCHOR_APPROXIMATE else "none")
    evidence = {"anchor_sets_checked": len(checked), "disclosure": grade,
                **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in worst.items()},
                "same_class_row_cosine_mean": float(np.mean([a["cosine"] for a in alignment])) if alignment else None}
    if grade == "exact":
        return _finding("high", "ANCHORS_UPLOADED", "An uploaded field matches the anchors the client computed: the "
                        "client's per-class feature means leave it.", **evidence)
    if grade == "none":
        return _finding("info", "ANCHORS_NOT_UPLOADED", "Verified: no uploaded tensor, nor any row of one, equals or "
                        "points the same way as an anchor the client computed (the paper's claim holds in this run).",
                        **evidence)
    inversion = anchor_inversion(run, alignment, inversion_iterations)
    gain = ("" if inversion is None else
            f" Inverting the {inversion['inverted_rows']} best-aligned rows as feature directions through the "
            f"downloaded extractor gives {inversion['mean_psnr']:.1f} dB against the client's images of that class "
            f"(class-mean image of other data: {inversion['mean_class_prior_psnr']:.1f} dB; data-set mean: "
            f"{inversion['mean_prior_psnr']:.1f} dB).")
    return _finding("medium" if inversion is None or inversion["mean_psnr"] > inversion["mean_class_prior_psnr"]
                    else "low", "ANCHORS_APPROXIMATELY_DISCLOSED",
                    f"No uploaded tensor equals an anchor, but classifier rows point like them (max cosine "
                    f"{worst['max_cosine']:.2f}, in {worst['field']}): the paper's claim that anchors never leave the "
                    f"client holds exactly, not approximately.{gain}", **evidence, anchor_inversion=inversion)


def _count_finding(run: RecordedRun, uploads: list, kinds: set[str]) -> dict:
    count_like = 0
    for up in uploads:
        truth = torch.bincount(_true_classes(run, up.round, up.client_id), minlength=run.dataset.num_classes)
        for t in up.tensors.values():
            if t.numel() == run.dataset.num_classes and torch.equal(t.reshape(-1).round().to(torch.int64), truth):
                count_like += 1
    has_counts = "class_counts" in kinds
    return _finding(
        "high" if has_counts or count_like else "info",
        "PER_CLASS_COUNTS_UPLOADED" if has_counts or count_like else "NO_PER_CLASS_COUNTS",
        ("Per-class sample counts are uploaded." if has_counts or count_like else
         "Verified: no upload declares per-class counts and no uploaded tensor equals the client's true class counts "
         "(only the total sample count is sent, for eq. 16's weights)."),
        tensors_equal_to_true_counts=count_like)


def _traffic(run: RecordedRun, rounds: int) -> dict:
    """Bytes up and down per round and in total, from the recorded messages (downloads as sent,
    uploads as received)."""
    per_round = []
    for r in range(rounds):
        exchanges = [ex for (rnd, _), ex in run.recorder.exchanges.items() if rnd == r]
        up = sum(ex.upload.nbytes for ex in exchanges if ex.upload is not None)
        down = sum(ex.download.nbytes for ex in exchanges)
        per_round.append({"round": r, "upload_bytes": up, "download_bytes": down, "clients": len(exchanges),
                          "upload_mb": up / 1e6, "download_mb": down / 1e6})
    rounds_n = max(rounds, 1)
    exchanges_n = max(sum(r["clients"] for r in per_round), 1)
    total_up = int(sum(r["upload_bytes"] for r in per_round))
    total_down = int(sum(r["download_bytes"] for r in per_round))
    return {"per_round": per_round, "total_upload_bytes": total_up, "total_download_bytes": total_down,
            "total_upload_mb": total_up / 1e6, "total_download_mb": total_down / 1e6,
            "upload_mb_per_round": total_up / 1e6 / rounds_n,
            "upload_kib_per_client_round": total_up / exchanges_n / KIB,
            "download_kib_per_client_round": total_down / exchanges_n / KIB,
            "paper_formula_kb_per_client_round": paper_communication_kib(run.dataset.num_classes)}


def _communication_finding(traffic: dict, num_classes: int) -> dict:
    up, down = traffic["upload_kib_per_client_round"], traffic["download_kib_per_client_round"]
    paper = traffic["paper_formula_kb_per_client_round"]
    return _finding(
        "info", "COMMUNICATION",
        f"Measured per client and round: {up:.1f} KiB up + {down:.1f} KiB down = {up + down:.1f} KiB; the paper's "
        f"formula 2 × (415.6 + 0.504·C + 2.25·C) KB gives {paper:.1f} KB for C = {num_classes} (for its 32×32 model).",
        measured_kib_per_client_round=up + down, paper_formula_kb=paper)


def _brief(summary: dict | None) -> dict | None:
    if not summary:
        return None
    keys = ("attack", "mean_psnr", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_ssim", "label_accuracy",
            "class_presence_accuracy", "not_applicable")
    brief = {k: summary[k] for k in keys if k in summary}
    unknown = model_unknown_targets(summary)
    return {**brief, "model_unknown_targets": unknown} if unknown else brief  # NO MODEL: an estimate
