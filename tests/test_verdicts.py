"""The verdict rules (``attacks.verdicts``): one home, read by the attacks' scoring, the audit's
severities, the report and the console; each rule decides at its stated boundary."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from attacks import verdicts
from attacks.metrics import leakage_statistics


def _rows(gains: list[float], prior: float = 10.0) -> list[dict]:
    return [{"psnr": prior + g, "prior_psnr": prior, "ssim": 0.1, "round": 0, "client": i, "image": 0}
            for i, g in enumerate(gains)]


def test_the_success_rule_counts_an_image_recovered_from_6_db_above_its_prior():
    stats = leakage_statistics(_rows([verdicts.SUCCESS_MARGIN_DB, verdicts.SUCCESS_MARGIN_DB - 0.01, 20.0, 0.0]))
    assert verdicts.SUCCESS_MARGIN_DB == 6.0
    assert stats["success_rate"] == pytest.approx(0.5)  # exactly +6 dB and +20 dB count; +5.99 and 0 do not
    assert stats["success_rule"] == verdicts.SUCCESS_RULE and "6 dB above the prior" in verdicts.SUCCESS_RULE


def test_the_leak_gap_makes_leakage_within_3_db_of_the_prior_chance_level():
    summary = {"mean_psnr": 12.99, "mean_prior_psnr": 10.0}
    assert verdicts.psnr_gap(summary) == pytest.approx(2.99) and verdicts.at_chance(summary) is True
    assert verdicts.at_chance({"mean_psnr": 13.0, "mean_prior_psnr": 10.0}) is False
    # no evidence either way: not measured, mis-specified, or stopped short of the truth
    assert verdicts.at_chance(None) is None and verdicts.psnr_gap({"mean_psnr": 12.0}) is None
    assert verdicts.at_chance({**summary, "mis_specified": True}) is None
    assert verdicts.at_chance({**summary, "not_converged_targets": 1}) is None


def test_the_presence_threshold_is_strict_at_0_8():
    assert verdicts.presence_is_low(0.79) and not verdicts.presence_is_low(0.8)
    assert not verdicts.presence_is_low(None) and not verdicts.presence_is_low(math.nan)


def test_the_forward_check_in_words():
    assert verdicts.forward_check_verdict(0, 0, 4) == ""
    assert verdicts.forward_check_verdict(None, "2", 4).endswith("on 2 of 4 targets: a lower bound")
    assert verdicts.forward_check_verdict(1, 2, 4).startswith("MIS-SPECIFIED on 1 of 4 targets")


def test_the_report_regrades_label_findings_with_the_presence_threshold():
    from fedsec.jobs.report.tables import _measured

    low = _measured("LABELS_INFERABLE_FROM_UPDATE", {"labels": {"class_presence_accuracy": 0.79}})
    kept = _measured("LABELS_INFERABLE_FROM_UPDATE", {"labels": {"class_presence_accuracy": 0.8}})
    assert low == ("labels: class-presence accuracy 0.79", "low") and kept[1] is None


def test_the_report_flags_lower_bound_cells_and_the_renderer_marks_them():
    from fedsec.jobs.report.tables import lower_bound_flags
    from reports.comparison import psnr_cell

    # the exposure matrix's rule: not above the prior by the interval while stopped short (a), above it (b)
    summary = pd.DataFrame([
        {"method": "a", "dlg_status": "done", "dlg_mean_psnr": 9.0, "dlg_mean_psnr_ci_low": 8.0,
         "dlg_mean_psnr_ci_high": 12.0, "dlg_prior_psnr": 11.0, "dlg_not_converged_targets": 1},
        {"method": "b", "dlg_status": "done", "dlg_mean_psnr": 15.0, "dlg_mean_psnr_ci_low": 14.0,
         "dlg_mean_psnr_ci_high": 16.0, "dlg_prior_psnr": 11.0, "dlg_not_converged_targets": 1},
    ])
    flagged = lower_bound_flags(summary, ["dlg"])
    assert list(flagged["dlg_lower_bound"]) == [True, False] and "dlg_lower_bound" not in summary.columns
    rows = flagged.to_dict("records")
    assert psnr_cell(rows[0], "dlg").endswith("LOWER BOUND") and "LOWER BOUND" not in psnr_cell(rows[1], "dlg")


def _no_model_summary(unknown: list[bool]) -> dict:
    """A FedProto-like proto summary: 0 mis-specified, each target's NO MODEL flag in its check."""
    return {"attack": "proto", "method": "fedproto", "mean_psnr": 14.0, "mean_prior_psnr": 13.0, "max_psnr": 15.0,
            "mean_psnr_ci": [13.5, 14.5], "n_images": 2 * len(unknown), "mis_specified": False,
            "mis_specified_targets": 0, "not_converged_targets": None,
            "per_target": [{"round": 0, "client": i, "model_unknown": u} for i, u in enumerate(unknown)]}


def test_no_model_is_its_own_verdict_never_mis_specified_nor_chance():
    """NO MODEL (the server holds no model of the client): counted from the per-target checks, said in
    words before a lower bound and after MIS-SPECIFIED, and never evidence of chance-level leakage."""
    summary = _no_model_summary([True, True])
    assert verdicts.model_unknown_targets(summary) == 2
    assert verdicts.model_unknown_targets({**summary, "model_unknown_targets": 1}) == 1  # a summary's own count wins
    assert verdicts.model_unknown_targets({"per_target": [{"round": 0, "client": 0}]}) is None  # not checked
    words = verdicts.forward_check_verdict(0, 1, 2, 2)
    assert words.startswith("NO MODEL on 2 of 2 targets: the server holds no model") and "estimate" in words
    assert verdicts.forward_check_verdict(1, 0, 2, 2).startswith("MIS-SPECIFIED on 1 of 2")
    assert verdicts.forward_check_verdict(0, 0, 2, 0) == ""
    assert verdicts.at_chance(summary) is None
    assert verdicts.at_chance(_no_model_summary([False, False])) is True  # 1 dB above the prior, model held


def test_the_audit_and_the_console_say_no_model_with_the_estimate():
    from fedsec.console import attack_headline
    from fedsec.jobs.audit import _brief, _leak_severity

    severity, why = _leak_severity(_no_model_summary([True, True]), "high")
    assert severity == "high" and why.startswith("measured mean PSNR 14.0 dB [13.5, 14.5]")
    assert "(+1.0 dB), an estimate; NO MODEL on 2 of 2 targets" in why and "MIS-SPECIFIED" not in why
    assert _brief(_no_model_summary([True, True]))["model_unknown_targets"] == 2
    line = attack_headline({**_no_model_summary([True, True]), "label_accuracy": float("nan"), "images_scored": 4,
                            "n_targets": 2, "threat_model": {"modes_used": ["surrogate-extractor"]}}, "out")
    assert line.endswith("→ out — " + verdicts.forward_check_verdict(0, None, 2, 2))
