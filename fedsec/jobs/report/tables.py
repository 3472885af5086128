"""``fedsec report``'s tables, assembled from the stage folders: the summary (one row per method),
every attack.csv concatenated (``results``), the findings regraded by this report's measurements, the
per-round leakage and the paired method comparisons. ``reports.comparison`` renders them."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

import attacks
from attacks.metrics import PSNR_CAP_DB
from attacks.verdicts import at_chance, forward_check_verdict, model_unknown_targets, presence_is_low, psnr_gap
from reports.audit import SEVERITIES
from reports.exposure import UNDETERMINED_LOWER_BOUND, paired_verdict
from reports.formatting import finite_or_none, interval_text, is_true

from ... import io
from ..attack import IMAGE_COLUMNS, LABEL_COLUMNS
from .settings import EXACT_BATCH_ATTACK, attack_of, cell_setting
from .stages import Stage

RESULT_COLUMNS = list(dict.fromkeys(IMAGE_COLUMNS + LABEL_COLUMNS))


def _read_json(path: Path, default=None):
    try:
        return io.read_json(path)
    except (OSError, ValueError):
        return default


def _measured(code: str, measured: dict[str, dict]) -> tuple[str, str | None]:
    """This report's measurement for an audit finding, and the severity it implies (None: keep).
    ``measured`` maps attack names to their summaries."""
    def psnr_evidence(kind: str) -> tuple[str, str | None]:
        for name in attacks.names(kind):
            s = measured.get(name) or {}
            gap = psnr_gap(s)
            if gap is not None:
                verdict = forward_check_verdict(s.get("mis_specified_targets"), s.get("not_converged_targets"),
                                                len(s.get("per_target") or []), model_unknown_targets(s))
                text = (f"{name}: mean PSNR {s['mean_psnr']:.1f} dB{interval_text(*(s.get('mean_psnr_ci') or (None, None)), digits=1)} "
                        f"vs prior {s['mean_prior_psnr']:.1f} dB ({gap:+.1f} dB), max {s['max_psnr']:.1f} dB"
                        + (f" — {verdict}" if verdict else ""))
                return text, ("low" if at_chance(s) else None)
        return "", None

    if code == "PROTOTYPES_DISCLOSED":
        return psnr_evidence("image")
    if code == "MODEL_DISCLOSED":
        return psnr_evidence("gradient")
    if code in ("LABEL_DISTRIBUTION_DISCLOSED", "LABELS_INFERABLE_FROM_UPDATE"):
        for name in attacks.names("labels"):
            acc = (measured.get(name) or {}).get("class_presence_accuracy")
            if acc is not None:
                return (f"{name}: class-presence accuracy {acc:.2f}",
                        "low" if code == "LABELS_INFERABLE_FROM_UPDATE" and presence_is_low(acc) else None)
    return "", None


def _brief_evidence(evidence) -> str:
    if isinstance(evidence, dict):  # drop what the audit left unmeasured (its evidence attacks are off)
        evidence = {k: v for k, v in evidence.items() if v is not None}
    if not evidence:
        return ""
    text = json.dumps(evidence, sort_keys=True, default=str)
    return text if len(text) <= 400 else text[:397] + "..."


ATTACK_COLUMNS = {"mean_psnr": "mean_psnr", "median_psnr": "median_psnr", "max_psnr": "max_psnr",
                  "prior_psnr": "mean_prior_psnr", "ssim": "mean_ssim", "label_accuracy": "label_accuracy",
                  "class_presence_accuracy": "class_presence_accuracy", "images": "images_scored",
                  "mis_specified": "mis_specified", "not_converged_targets": "not_converged_targets",
                  "n_targets": "n_targets", "n_images": "n_images", "success_rate": "success_rate"}


def _attack_cells(stage: Stage, out: Path) -> tuple[dict, dict | None, pd.DataFrame | None, dict | None]:
    """(summary-row cells, measured summary, attack.csv, reconstruction grid) of one attack stage."""
    a = stage.attack
    done = stage.resumable.record() or {}
    status = done.get("status")
    s = _read_json(stage.path / "summary.json", {}) if status == "done" else {}
    row = {f"{a}_status": {"done": "done", "not_applicable": f"not applicable: {done.get('reason')}"}.get(
        status, f"unavailable: {done.get('reason') or 'not run'}")}
    row.update({f"{a}_{col}": s.get(key) for col, key in ATTACK_COLUMNS.items()})
    row[f"{a}_model_unknown_targets"] = model_unknown_targets(s)  # NO MODEL: the cell's figure is an estimate
    for key in ("mean_psnr_ci", "success_rate_ci"):  # intervals as two columns
        low, high = s.get(key) or (None, None)
        row[f"{a}_{key}_low"], row[f"{a}_{key}_high"] = low, high
    histogram = s.get("histogram")  # an attack on a secure-aggregation round's sum: its label histogram
    if histogram and histogram.get("rounds"):
        row[f"{a}_histogram"] = (f"exact in {histogram['exact_rounds']} of {histogram['rounds']} rounds, mean count "
                                 f"error {histogram['mean_count_error']:.1f}")
    if status != "done":
        return row, None, None, None
    try:
        frame = pd.read_csv(stage.path / "attack.csv").assign(attack=a)  # the cell: ig, or ig@real
        frame = _with_model_unknown(frame, s)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        frame = None
    png = stage.path / "reconstructions.png"
    grid = {"png": png.read_bytes(), "path": png.relative_to(out).as_posix()} \
        if attacks.get(attack_of(a)).rebuilds_images and png.is_file() else None
    return row, s, frame, grid


def _with_model_unknown(frame: pd.DataFrame, summary: dict) -> pd.DataFrame:
    """attack.csv's rows with each target's NO MODEL flag (``model_unknown``) from the summary's
    per-target checks, where the rows do not carry it already."""
    flags = {(int(t["round"]), int(t["client"])): t["model_unknown"] for t in summary.get("per_target") or []
             if isinstance(t, dict) and t.get("model_unknown") is not None}
    if "model_unknown" in frame.columns or not flags or not {"round", "client"} <= set(frame.columns):
        return frame
    return frame.assign(model_unknown=[flags.get((int(r), int(c))) for r, c in zip(frame["round"], frame["client"])])


def _finding_rows(method: str, findings: list[dict], measured: dict[str, dict]) -> list[dict]:
    rows = []
    for f in findings:
        text, regraded = _measured(str(f.get("code", "")), measured)
        rows.append({"method": method, "severity": regraded or str(f.get("severity", "info")),
                     "audit_severity": f.get("severity"), "code": f.get("code", ""), "finding": f.get("finding", ""),
                     "measured": text, "evidence": _brief_evidence(f.get("evidence"))})
    return rows


def _method_row(method: str, by: dict, attack_names: list[str], out: Path, collected: dict) -> dict:
    """One method's summary row; its results, findings and grids go into ``collected``."""
    train = _read_json(by[(method, "train")].path / "summary.json", {})
    audit = _read_json(by[(method, "audit")].path / "summary.json", {})
    row = {"method": method, "accuracy_mean": train.get("mean_accuracy"), "accuracy_std": train.get("std_accuracy"),
           "upload_mb_per_round": audit.get("upload_mb_per_round"),
           "upload_kib_per_client_round": audit.get("upload_kib_per_client_round"),
           "secure_aggregation": audit.get("secure_aggregation")}
    measured: dict[str, dict] = {}
    for a in attack_names:
        cells, summary, frame, grid = _attack_cells(by[(method, f"attack-{a}")], out)
        row.update(cells)
        if summary is not None:
            measured[a] = summary
            measured.setdefault(attack_of(a), summary)  # the audit's findings name attacks, not cells
        if frame is not None:
            collected["results"].append(frame)
        if grid is not None:
            collected["grids"][(method, a)] = grid
    findings = _finding_rows(method, _read_json(by[(method, "audit")].path / "findings.json", []) or [], measured)
    collected["findings"] += findings
    for sev in SEVERITIES:
        row[f"findings_{sev}"] = sum(f["severity"] == sev for f in findings)
    cfg = _read_json(by[(method, "train")].path / "config.json", {})
    collected["details"][method] = {
        "hyperparameters": cfg.get("method_hyperparameters", {}),
        "targets": {a: measured[a].get("targets") for a in measured},
        "versions": [(st.resumable.record() or {}).get("versions") for st in by.values() if st.method == method]}
    return row


def assemble(stages: list[Stage], methods: list[str], attack_names: list[str], out: Path):
    """(summary frame, results frame, findings frame, grids, per-method details) from the stage folders."""
    by = {(s.method, s.name): s for s in stages}
    collected = {"results": [], "findings": [], "grids": {}, "details": {}}
    summary = pd.DataFrame([_method_row(m, by, attack_names, out, collected) for m in methods])
    collected["details"]["mia"] = [s for m in methods if (m, "mia") in by
                                   for s in [_read_json(by[(m, "mia")].path / "summary.json", None)] if s]
    frames = [f for f in collected["results"] if len(f)]
    results = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RESULT_COLUMNS)
    results = results.reindex(columns=RESULT_COLUMNS + [c for c in results.columns if c not in RESULT_COLUMNS])
    findings = pd.DataFrame(collected["findings"], columns=["method", "severity", "audit_severity", "code", "finding",
                                                            "measured", "evidence"])
    if len(findings):
        order = {**{m: i for i, m in enumerate(methods)}, **{s: i for i, s in enumerate(SEVERITIES)}}
        findings = findings.sort_values(["method", "severity"], key=lambda c: c.map(order),
                                        kind="stable").reset_index(drop=True)
    return summary, results, findings, collected["grids"], collected["details"]


def method_comparisons(summary: pd.DataFrame, results: pd.DataFrame, methods: list[str],
                       attack_names: list[str]) -> list[str]:
    """One sentence per image attack (cell) and pair of methods, over all attacked rounds and, with
    several, per round: which leaks more, paired over the same images
    (``attacks.metrics.paired_difference``), or that the intervals cannot tell them apart; never a
    comparison with a mis-specified attack, and "undetermined (lower bound)" where the side that leaks
    less stopped short of the truth on some target (``reports.exposure.paired_verdict``, the exposure
    matrix's rule)."""
    from attacks.metrics import paired_difference

    sentences = []
    rows = summary.set_index("method")
    rounds = sorted(int(r) for r in results["round"].dropna().unique()) if len(results) else []
    for a in [a for a in attack_names if attacks.get(attack_of(a)).rebuilds_images]:
        done = [m for m in methods if rows.loc[m].get(f"{a}_status") == "done"]
        for i, m1 in enumerate(done):
            for m2 in done[i + 1:]:
                for rnd in [None] + (rounds if len(rounds) > 1 else []):
                    sentence = _paired_sentence(results, a, m1, m2, rnd, paired_difference)
                    if sentence:
                        sentences.append(sentence)
    return sentences


def _paired_sentence(results: pd.DataFrame, a: str, m1: str, m2: str, rnd: int | None, paired_difference) -> str | None:
    def pick(m):
        sel = (results["method"] == m) & (results["attack"] == a)
        if rnd is not None:
            sel &= results["round"] == rnd
        return results[sel].to_dict("records")

    where = a if rnd is None else f"{a}, round {rnd}"
    picked = {m: pick(m) for m in (m1, m2)}
    wrong = [m for m, rs in picked.items() if any(is_true(r.get("mis_specified")) for r in rs)]
    if wrong:
        return f"{where}: {m1} vs {m2}: not comparable: the attack on {', '.join(wrong)} was mis-specified"
    estimated = [m for m, rs in picked.items() if any(is_true(r.get("model_unknown")) for r in rs)]
    d = paired_difference(picked[m1], picked[m2])
    if not d["n_pairs"]:
        return None
    verdict = {"A leaks more": f"{m1} leaks more", "B leaks more": f"{m2} leaks more"}.get(d["verdict"], d["verdict"])
    low, high = d["ci"] or (None, None)
    word, why = paired_verdict(low, high, m1, m2, _stopped_short(picked[m1]), _stopped_short(picked[m2]))
    if word == UNDETERMINED_LOWER_BOUND:  # the side that leaks less may leak more: no order
        verdict = f"{word}: {why}"
    interval = "" if d["ci"] is None else f" [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]"
    estimate = (f"; {', '.join(estimated)}: NO MODEL, a surrogate-model estimate (the server holds no model of "
                f"its clients)") if estimated else ""
    return (f"{where}: {m1} vs {m2}: {verdict} (PSNR above the prior, {m1} minus {m2}: "
            f"{d['mean_difference']:+.1f} dB{interval}, {d['n_pairs']} images over {d['n_targets']} targets{estimate})")


def _stopped_short(rows: list[dict]) -> int:
    """The targets (round, client) of per-image rows whose optimiser stopped short of the truth."""
    return len({(r.get("round"), r.get("client")) for r in rows if is_true(r.get("not_converged"))})


def leakage_by_round(results: pd.DataFrame, methods: list[str], cells: list[str], seed: int = 0) -> pd.DataFrame:
    """One row per method, image cell and attacked round: images, targets, mean PSNR with its 95 %
    interval, the prior, the share recovered with its interval, and the forward-model check's counts
    (targets mis-specified, targets where the optimiser stopped short of the truth, targets whose server
    holds no model of the client: NO MODEL)."""
    from attacks.metrics import leakage_statistics

    columns = ["method", "attack", "round", "n_images", "n_targets", "mean_psnr", "mean_psnr_ci_low",
               "mean_psnr_ci_high", "prior_psnr", "success_rate", "success_rate_ci_low", "success_rate_ci_high",
               "mis_specified_targets", "not_converged_targets", "model_unknown_targets",
               "inputs_exact_share", "inputs_exact_ci_low", "inputs_exact_ci_high"]
    out = []
    image_cells = [a for a in cells if attacks.get(attack_of(a)).rebuilds_images]
    if not len(results) or "psnr" not in results.columns:
        return pd.DataFrame(columns=columns)
    for m in methods:
        for a in image_cells:
            sel = results[(results["method"] == m) & (results["attack"] == a)]
            for rnd, group in sel.groupby("round", sort=True):
                records = group.to_dict("records")
                stats = leakage_statistics(records, seed=seed)
                targets = group.drop_duplicates(["round", "client"])
                flag = lambda c: int(targets[c].map(is_true).sum()) if c in targets else 0  # noqa: E731
                out.append({"method": m, "attack": a, "round": int(rnd), "n_images": stats["n_images"],
                            "n_targets": stats["n_targets"], "mean_psnr": float(group["psnr"].clip(upper=PSNR_CAP_DB).mean()),
                            **dict(zip(("mean_psnr_ci_low", "mean_psnr_ci_high"), stats["mean_psnr_ci"] or (None, None))),
                            "prior_psnr": float(group["prior_psnr"].mean()), "success_rate": stats["success_rate"],
                            "success_rate_ci_low": stats["success_rate_ci"][0],
                            "success_rate_ci_high": stats["success_rate_ci"][1],
                            "mis_specified_targets": flag("mis_specified"), "not_converged_targets": flag("not_converged"),
                            "model_unknown_targets": flag("model_unknown"), **_inputs_exact(a, records, seed)})
    return pd.DataFrame(out, columns=columns)


def _inputs_exact(cell: str, records: list[dict], seed: int) -> dict:
    """The share of images whose layer input an exact attack recovered (its ``statistics``'
    ``inputs_exact_share``) with its interval; empty for the other attacks."""
    statistics = attacks.get(attack_of(cell)).statistics
    found = statistics(records, seed) if statistics is not None and records and "input_error" in records[0] else {}
    if found.get("inputs_exact_share") is None:
        return {}
    low, high = found["inputs_exact_share_ci"]
    return {"inputs_exact_share": found["inputs_exact_share"], "inputs_exact_ci_low": low, "inputs_exact_ci_high": high}


def client_size_rows(by_round: pd.DataFrame, summary: pd.DataFrame, cells: dict) -> list[dict]:
    """The real-training cells of the report's client sizes (``<attack>@real-n<N>``) as
    ``reports.client_size`` rows, one per method, attacked round and N: the method label names the
    round ("fedavg, round 0"), so the largest exposed N is per method and round. A cell that gave no
    images (not applicable, failed) is one row with its status as the note. ``cells`` maps a cell key
    to its ``AttackSettings`` (the iterations it ran with; None: the attack's default)."""
    rows = []
    for r in summary.to_dict("records"):
        for key in cells:
            setting, size = cell_setting(key)
            status = r.get(f"{key}_status")
            if setting == "real" and size is not None and isinstance(status, str) and status != "done":
                rows.append({"method": r["method"], "attack": attack_of(key), "train_images": size, "note": status})
    for r in by_round.to_dict("records"):
        setting, size = cell_setting(str(r["attack"]))
        if setting != "real" or size is None:
            continue
        settings = cells.get(r["attack"])
        rows.append({"method": f"{r['method']}, round {int(r['round'])}", "attack": attack_of(str(r["attack"])),
                     "train_images": size, "mean_psnr": r["mean_psnr"], "mean_psnr_low": r["mean_psnr_ci_low"],
                     "mean_psnr_high": r["mean_psnr_ci_high"], "prior_psnr": r["prior_psnr"],
                     "success_rate": r["success_rate"], "n_images": r["n_images"], "n_targets": r["n_targets"],
                     "mis_specified_targets": r["mis_specified_targets"],
                     "not_converged_targets": r["not_converged_targets"],
                     "model_unknown_targets": r.get("model_unknown_targets"),
                     "iterations": getattr(settings, "iterations", None)})
    return rows


def psnr_definition() -> str:
    import attacks.metrics

    doc = (attacks.metrics.__doc__ or "").strip()
    return doc or "PSNR = 10·log10(1 / MSE) on images in [0, 1]."


def lower_bound_flags(summary: pd.DataFrame, cells: list[str]) -> pd.DataFrame:
    """``summary`` with a ``<cell>_lower_bound`` column per image cell: the exposure matrix's LOWER BOUND
    (``reports.exposure.judge``: not above the prior by the interval while the optimiser stopped short on some
    target) from the cell's mean PSNR, interval, prior and checks. ``reports.comparison`` marks those cells
    (summary.csv holds no flags)."""
    from reports.exposure import LOWER_BOUND, Evidence, judge

    flagged = summary.copy()
    for a in cells:
        if f"{a}_mean_psnr" in flagged.columns and attacks.get(attack_of(a)).rebuilds_images:
            flagged[f"{a}_lower_bound"] = [judge(Evidence(
                method=str(r["method"]), threat="round0", source=a, value=finite_or_none(r.get(f"{a}_mean_psnr")),
                low=finite_or_none(r.get(f"{a}_mean_psnr_ci_low")),
                high=finite_or_none(r.get(f"{a}_mean_psnr_ci_high")),
                chance=finite_or_none(r.get(f"{a}_prior_psnr")),
                stopped_short=_count(r.get(f"{a}_not_converged_targets")),
                no_model=_count(r.get(f"{a}_model_unknown_targets")) or 0,
                mis_specified=int(is_true(r.get(f"{a}_mis_specified"))))).word == LOWER_BOUND
                for r in flagged.to_dict("records")]
    return flagged


def headline_markdown(summary: pd.DataFrame, attack_names: list[str], methods: list[str]) -> str:
    """The headline table alone (for the terminal and the docs)."""
    from reports.comparison import headline_rows, md_table

    return md_table(*headline_rows(lower_bound_flags(summary, attack_names), {
        "attacks": attack_names, "methods": methods,
        "image_attacks": [a for a in attack_names if attacks.get(attack_of(a)).rebuilds_images],
        "label_attacks": [a for a in attack_names if not attacks.get(attack_of(a)).rebuilds_images]}))


NO_WEIGHTS = "uploads no model weights"  # the weight attacks' not-applicable sentence: the NO MODEL case
SERVER_THREATS = ("round0", "trained", "real-small", "real-default", "exact-batch", "malicious", "secure")


def exposure_evidence(summary: pd.DataFrame, by_round: pd.DataFrame, meta: dict,
                      malicious: pd.DataFrame | None = None) -> list[dict]:
    """The report's figures as ``reports.exposure`` evidence (dicts), for the exposure matrix atop the report:
    each image cell per method and attacked round (its threat from its victim setting and round), the
    attacks that did not apply (NO MODEL for a weight attack on a method that uploads no weights, else
    REFUSED), the label attacks' class-presence accuracy, the malicious-server section's share recovered
    with the download check off, the exact batch attack's share of inputs recovered exactly (its own
    column), LiRA's AUC on the personal models and the audit's secure-aggregation
    declaration (a method that refuses it, or sends nothing)."""
    from reports.exposure import Evidence, as_dicts, cell_threat

    out: list[Evidence] = []
    settings = meta.get("attack_settings") or {}

    def threats(a: str, rounds) -> list[str]:
        spec = attacks.get(attack_of(a))
        real = spec.kind == "gradient" and spec.default_victim_batch == 0  # no setting: the real local training
        exact = ["exact-batch"] if attack_of(a) == EXACT_BATCH_ATTACK else []  # its own column too
        return list(dict.fromkeys([*(cell_threat(a, int(r), real) for r in rounds or (0,)), *exact]))

    for r in by_round.to_dict("records"):
        a = str(r["attack"])
        out.append(Evidence(method=str(r["method"]), threat=threats(a, [r["round"]])[0], source=f"round {r['round']}",
                            value=finite_or_none(r["mean_psnr"]), low=finite_or_none(r.get("mean_psnr_ci_low")),
                            high=finite_or_none(r.get("mean_psnr_ci_high")), chance=finite_or_none(r["prior_psnr"]),
                            stopped_short=_count(r.get("not_converged_targets")), n_targets=_count(r.get("n_targets")),
                            no_model=_count(r.get("model_unknown_targets")) or 0,
                            mis_specified=_count(r.get("mis_specified_targets")) or 0, what=a))
        if finite_or_none(r.get("inputs_exact_share")) is not None:
            out.append(Evidence(method=str(r["method"]), threat="exact-batch", source=f"round {r['round']}",
                                metric="inputs exact", value=finite_or_none(r["inputs_exact_share"]),
                                low=finite_or_none(r.get("inputs_exact_ci_low")),
                                high=finite_or_none(r.get("inputs_exact_ci_high")), stopped_short=0,
                                n_targets=_count(r.get("n_targets")), what=a))
    for row in summary.to_dict("records"):
        m = str(row["method"])
        for a in meta.get("attacks") or []:
            status = str(row.get(f"{a}_status", "not run"))
            rounds = (settings.get(a) or {}).get("rounds")
            spec = attacks.get(attack_of(a))
            if status.startswith("not applicable"):
                reason = status.split(": ", 1)[-1].split(";")[0]  # the sentence's first clause: what is missing
                for t in threats(a, rounds):
                    out.append(Evidence(method=m, threat=t, source="", what=a, missing=reason, no_model=1)
                               if NO_WEIGHTS in reason else
                               Evidence(method=m, threat=t, source="", what=a, refused=reason))
            elif status != "done":
                out += [Evidence(method=m, threat=t, source="", what=a, missing=status) for t in threats(a, rounds)]
            elif spec.kind == "labels":
                presence = finite_or_none(row.get(f"{a}_class_presence_accuracy"))
                out += [Evidence(method=m, threat=t, source="", what=a, metric="class presence", value=presence)
                        for t in threats(a, rounds)]
        declared = row.get("secure_aggregation")
        if isinstance(declared, str) and declared.startswith("refuses"):
            out.append(Evidence(method=m, threat="secure", source="the method's declaration",
                                refused=f"its server reads {declared.split(': ', 1)[-1]} of each client"))
        elif declared == "sends nothing":
            out += [Evidence(method=m, threat=t, source="", refused="sends nothing to the server")
                    for t in SERVER_THREATS]
    if malicious is not None and len(malicious):
        out += _malicious_evidence(malicious)
    for s in meta.get("mia") or []:
        lira = (((s.get("targets") or {}).get("personal") or {}).get("attacks") or {}).get("lira") or {}
        low, high = lira.get("auc_ci") or (None, None)
        out.append(Evidence(method=str(s.get("method", "")), threat="mia", source="personal models", what="LiRA",
                            metric="auc", value=finite_or_none(lira.get("auc")), low=finite_or_none(low),
                            high=finite_or_none(high), stopped_short=0,
                            missing=None if lira else "no personal model to attack"))
    return as_dicts(out)


def _malicious_evidence(malicious: pd.DataFrame) -> list:
    """The malicious-server section's evidence: each attack and client size with the download check off
    (the matrix shows the methods without a defence), refused, missing or its share recovered."""
    from reports.exposure import Evidence

    out = []
    for r in malicious.to_dict("records"):
        if r.get("download_check") != "off":
            continue
        common = {"method": str(r["method"]), "threat": "malicious", "source": "",
                  "what": f"{r['attack']}, N = {r['train_images']}"}
        if r.get("status") == "refused":
            out.append(Evidence(**common, refused=str(r.get("reason") or "refused")))
        elif r.get("status") != "done":
            out.append(Evidence(**common, missing=f"{r.get('status')}: {r.get('reason')}"))
        else:
            out.append(Evidence(**common, metric="recovered", value=finite_or_none(r.get("recovered_share")),
                                low=finite_or_none(r.get("recovered_ci_low")),
                                high=finite_or_none(r.get("recovered_ci_high")), n_targets=_count(r.get("n_targets"))))
    return out


def _count(x) -> int | None:
    number = finite_or_none(x)
    return None if number is None else int(number)
