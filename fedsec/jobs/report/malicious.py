"""``fedsec report``'s malicious-server section, assembled from its stage folders: per method, attack,
client size N and download check, the share of the attacked clients' images rebuilt (PSNR ≥ 30 dB,
and ≥ prior + 6 dB) with 95 % intervals, the mean PSNR with its interval, the share of inputs
recovered exactly (where the attack reports it) and the check's decisions. ``reports.malicious``
renders the rows.

The share is over the attacked clients' images (N each, ``--train-images N``), not over the rows an
attack scored: a client whose crafted download was refused uploads nothing that round, so none of its
images is rebuilt; an attack that rebuilds one image per client counts one of its N. Intervals:
``attacks.metrics.rate_interval`` (Clopper–Pearson hulled with a bootstrap over the attacked clients)
and ``leakage_statistics`` (mean PSNR), as everywhere else in the report.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from attacks.metrics import PSNR_CAP_DB, leakage_statistics, rate_interval
from attacks.verdicts import SUCCESS_MARGIN_DB

from ... import io

REBUILT_DB = 30.0  # "rebuilt": the image at PSNR >= this
SECTION_COLUMNS = ["method", "attack", "craft", "train_images", "download_check", "status", "reason", "n_targets",
                   "n_images", "rebuilt_30db", "rebuilt_30db_share", "rebuilt_30db_ci_low", "rebuilt_30db_ci_high",
                   "recovered", "recovered_share", "recovered_ci_low", "recovered_ci_high", "n_scored", "mean_psnr",
                   "mean_psnr_ci_low", "mean_psnr_ci_high", "prior_psnr", "inputs_exact_share",
                   "inputs_exact_ci_low", "inputs_exact_ci_high", "crafted_downloads", "crafted_refused",
                   "honest_downloads", "honest_refused", "seconds"]


def _read(path, default):
    try:
        return io.read_json(path)
    except (OSError, ValueError):
        return default


def client_shares(frame: pd.DataFrame, targets: list[tuple[int, int]], size: int, seed: int) -> dict:
    """Of the ``targets``' images (``size`` each): how many were rebuilt at ≥ ``REBUILT_DB`` and at ≥
    prior + ``SUCCESS_MARGIN_DB``, each share with its 95 % interval over the targets. A target without
    rows (nothing uploaded, or nothing scored) counts ``size`` images not rebuilt; an image counts once."""
    out = {}
    psnr = frame["psnr"].astype(float).clip(upper=PSNR_CAP_DB) if len(frame) else pd.Series(dtype=float)
    rules = {"rebuilt_30db": psnr >= REBUILT_DB,
             "recovered": psnr - frame["prior_psnr"].astype(float) >= SUCCESS_MARGIN_DB if len(frame) else psnr}
    for name, hit in rules.items():
        per_target = frame[hit.astype(bool)].groupby(["round", "client"])["image"].nunique() if len(frame) else {}
        counts = [min(int(per_target.get((r, c), 0)), size) for r, c in targets]
        hits = np.concatenate([np.r_[np.ones(k), np.zeros(size - k)] for k in counts]) if counts else np.zeros(0)
        clusters = np.repeat(np.arange(len(counts)), size)
        low, high = rate_interval(hits, clusters, seed) if len(hits) else (None, None)
        out.update({name: int(sum(counts)), f"{name}_share": float(hits.mean()) if len(hits) else None,
                    f"{name}_ci_low": low, f"{name}_ci_high": high})
    return out


def section_row(stage, size: int, check: bool, seed: int = 0) -> dict:
    """One row of the section from a malicious-server attack stage's folder (``stage``: a
    ``fedsec.jobs.report.stages.Stage``)."""
    done = stage.resumable.record() or {}
    settings = stage.attack_settings
    crafts = getattr(settings.spec, "crafts", ()) or (None,)
    row = {"method": stage.method, "attack": settings.attack, "craft": settings.craft or crafts[0], "train_images": size,
           "download_check": "on" if check else "off", "status": done.get("status") or "failed",
           "reason": done.get("reason") or (None if done else "did not finish (rerun with the same --out to retry)"),
           "seconds": done.get("seconds")}
    if row["status"] == "not_applicable":
        row["status"] = "refused"  # the attack cannot reach this method (known before training)
    if row["status"] != "done":
        return row
    summary = _read(stage.path / "summary.json", {})
    try:
        frame = pd.read_csv(stage.path / "attack.csv")
    except (OSError, ValueError, pd.errors.EmptyDataError):
        frame = pd.DataFrame(columns=["round", "client", "image", "psnr", "prior_psnr"])
    targets = [(int(r), int(c)) for r, cs in (summary.get("targets") or {}).items() for c in cs]
    row["craft"] = (summary.get("settings") or {}).get("craft", row["craft"])
    row.update({"n_targets": len(targets), "n_images": size * len(targets), "n_scored": len(frame),
                **client_shares(frame, targets, size, seed)})
    if len(frame):
        stats = leakage_statistics(frame.to_dict("records"), seed=seed)
        low, high = stats["mean_psnr_ci"] or (None, None)
        row.update({"mean_psnr": float(frame["psnr"].astype(float).clip(upper=PSNR_CAP_DB).mean()),
                    "mean_psnr_ci_low": low, "mean_psnr_ci_high": high,
                    "prior_psnr": float(frame["prior_psnr"].astype(float).mean())})
    if summary.get("inputs_exact_share") is not None:
        low, high = summary.get("inputs_exact_share_ci") or (None, None)
        row.update({"inputs_exact_share": summary["inputs_exact_share"], "inputs_exact_ci_low": low,
                    "inputs_exact_ci_high": high})
    check_summary = summary.get("download_check") or {}
    if check_summary:
        row.update({"crafted_downloads": check_summary.get("attacked_downloads"),
                    "crafted_refused": check_summary.get("detected"),
                    "honest_downloads": check_summary.get("honest_downloads"),
                    "honest_refused": check_summary.get("false_alarms")})
    return row


def section_table(stages: list, cells: list, methods: list[str], seed: int = 0) -> pd.DataFrame:
    """The section's rows (``SECTION_COLUMNS``), method by method, in the cells' order (``cells``:
    ``fedsec.jobs.report.settings.MaliciousCell``)."""
    by = {(s.method, s.attack): s for s in stages if s.kind == "attack"}
    rows = [section_row(by[(m, cell.key)], cell.size, cell.check, seed)
            for m in methods for cell in cells if (m, cell.key) in by]
    counts = ["train_images", "n_targets", "n_images", "rebuilt_30db", "recovered", "n_scored", "crafted_downloads",
              "crafted_refused", "honest_downloads", "honest_refused"]
    return pd.DataFrame(rows, columns=SECTION_COLUMNS).astype({c: "Int64" for c in counts})


def malicious_meta(section: pd.DataFrame, cells: list) -> dict:
    """What ``reports.malicious`` renders: the rows (NaN as None), the rules, the attacked rounds per
    attack (fishing attacks a round later than trap) and the targets (``cells``: the section's
    ``MaliciousCell`` s, which share them)."""
    rows = [{k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in r.items()}
            for r in section.astype(object).where(section.notna(), None).to_dict("records")]
    rounds = {cell.attack: list(cell.settings.rounds) for cell in cells}
    return {"rows": rows, "rebuilt_db": REBUILT_DB, "margin_db": SUCCESS_MARGIN_DB,
            "rounds": rounds, "targets": cells[0].settings.targets}
