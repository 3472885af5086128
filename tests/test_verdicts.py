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


@pytest.mark.parametrize("mean, prior, short, expected", [
    (10.0, 12.0, 1, True),     # below the prior and stopped short: the budget set the number
    (12.0, 12.0, 2, True),     # at the prior counts
    (12.1, 12.0, 1, False),    # above the prior: leakage shown whatever the optimiser did
    (10.0, 12.0, 0, False),    # converged: a real measurement
    (float("nan"), 12.0, 1, False), ("n/a", 12.0, 1, False), (None, 12.0, 1, False),
])
def test_the_lower_bound_rule(mean, prior, short, expected):
    assert verdicts.is_lower_bound(mean, prior, short) is expected


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
    from fedsec.report.tables import _measured

    low = _measured("LABELS_INFERABLE_FROM_UPDATE", {"labels": {"class_presence_accuracy": 0.79}})
    kept = _measured("LABELS_INFERABLE_FROM_UPDATE", {"labels": {"class_presence_accuracy": 0.8}})
    assert low == ("labels: class-presence accuracy 0.79", "low") and kept[1] is None


def test_the_report_flags_lower_bound_cells_and_the_renderer_marks_them():
    from fedsec.report.tables import lower_bound_flags
    from reports.comparison import psnr_cell

    summary = pd.DataFrame([
        {"method": "a", "dlg_status": "done", "dlg_mean_psnr": 9.0, "dlg_prior_psnr": 11.0, "dlg_not_converged_targets": 1},
        {"method": "b", "dlg_status": "done", "dlg_mean_psnr": 15.0, "dlg_prior_psnr": 11.0, "dlg_not_converged_targets": 1},
    ])
    flagged = lower_bound_flags(summary, ["dlg"])
    assert list(flagged["dlg_lower_bound"]) == [True, False] and "dlg_lower_bound" not in summary.columns
    rows = flagged.to_dict("records")
    assert psnr_cell(rows[0], "dlg").endswith("LOWER BOUND") and "LOWER BOUND" not in psnr_cell(rows[1], "dlg")
