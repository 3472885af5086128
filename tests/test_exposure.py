"""The exposure matrix and its one rule (``reports.exposure``): each verdict word from the evidence that
earns it, paired comparisons that never hold on a lower bound (the Fig. 10 section included), the records
under ``results/`` free of progress bars and long headlines, the results page that explains its words
before the matrix, and the report's Markdown and HTML that open with the same matrix."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from reports.exposure import (EXPOSED, LOWER_BOUND, NA, NO_MODEL, NOT_SHOWN, REFUSED, UNDETERMINED_LOWER_BOUND,
                              Evidence, cell_threat, exposure_matrix, judge, matrix_html, matrix_markdown,
                              paired_verdict)

ROOT = Path(__file__).resolve().parent.parent


def psnr(**kw) -> Evidence:
    base = dict(method="fedper", threat="round0", source="cell", value=20.0, low=16.0, high=24.0, chance=12.0,
                stopped_short=0, n_targets=8)
    return Evidence(**{**base, **kw})


@pytest.mark.parametrize("evidence, word", [
    (psnr(), EXPOSED),
    (psnr(stopped_short=8), EXPOSED),  # stopped short above the prior: at least this much
    (psnr(value=11.0, low=9.0, high=13.0, stopped_short=3), LOWER_BOUND),
    (psnr(value=11.0, low=9.0, high=13.0), NOT_SHOWN),
    (psnr(value=11.0, low=10.5, high=11.3, chance=13.0, no_model=8), NO_MODEL),
    (psnr(value=None, low=None, high=None, no_model=1, missing="fedproto uploads no model weights"), NO_MODEL),
    (psnr(refused="its server reads h, V of each client"), REFUSED),
    (psnr(low=None, high=None), NA),  # no interval
    (psnr(chance=None), NA),  # no prior
    (psnr(value=11.0, low=9.0, high=13.0, mis_specified=1, stopped_short=4), NA),  # says nothing about the method
    (psnr(value=11.0, low=9.0, high=13.0, stopped_short=None), NA),  # the record does not say
    (psnr(value=None, low=None, high=None), NA),  # not measured
    (Evidence("fedavg", "mia", "mia", metric="auc", value=0.551, low=0.53, high=0.57, stopped_short=0), EXPOSED),
    (Evidence("fedavg", "mia", "mia", metric="auc", value=0.519, low=0.49, high=0.54, stopped_short=0), NOT_SHOWN),
    (Evidence("fedavg", "mia", "mia", metric="auc", value=0.519), NA),
    (Evidence("fedavg", "malicious", "t", metric="recovered", value=0.05, low=0.01, high=0.2), EXPOSED),
    (Evidence("fedavg", "malicious", "t", metric="recovered", value=0.0, low=0.0, high=0.09), NA),
    (Evidence("fedavg", "round0", "labels", metric="class presence", value=1.0), NA),
])
def test_each_verdict_comes_from_the_one_rule(evidence, word):
    assert judge(evidence).word == word


def test_the_matrix_shows_the_worst_verdict_per_cell_and_per_method():
    evidence = [psnr(value=11.0, low=9.0, high=13.0, stopped_short=2, what="dlg"), psnr(what="ig"),
                Evidence("fedper", "round0", "labels", metric="class presence", value=1.0),
                psnr(method="fedecouple", threat="trained", value=11.0, low=9.0, high=13.0, stopped_short=8),
                Evidence("fedpac", "secure", "declaration", refused="its server reads h of each client"),
                Evidence("custom", "mia", "m", metric="auc", value=0.7, low=0.65, high=0.75, stopped_short=0),
                {"method": "fedavg", "threat": "malicious", "source": "t", "metric": "recovered", "value": 0.5,
                 "low": 0.4, "high": 0.6}]
    matrix = exposure_matrix(evidence)
    assert matrix.methods == ("fedavg", "fedper", "fedpac", "fedecouple", "custom")
    cell = matrix.cells[("fedper", "round0")]
    assert cell.word == EXPOSED and cell.verdict.evidence.what == "ig" and cell.others == (LOWER_BOUND, NA)
    assert matrix.cells[("fedecouple", "trained")].word == LOWER_BOUND
    assert matrix.cells[("fedecouple", "round0")].word == NA
    assert matrix.worst["fedper"] == (EXPOSED, ("round0",))
    assert matrix.worst["fedpac"] == (REFUSED, ("secure",))
    text = matrix_markdown(matrix)
    assert text.splitlines()[0].startswith("| method | curious server, round 0 |")
    assert "| fedper | EXPOSED 20.00 dB [16.00, 24.00] |" in text and "| LOWER BOUND ≥ 11.00 dB [9.00, 13.00] |" in text
    assert "EXPOSED: 20.00 dB [16.00, 24.00], prior 12.00 (ig, cell); 1 more n/a" in text
    assert "LOWER BOUND: 11.00 dB [9.00, 13.00], prior 12.00; 8/8 stopped short" in text
    with pytest.raises(ValueError, match="unknown threat"):
        exposure_matrix([psnr(threat="nowhere")])
    page = matrix_html(exposure_matrix([psnr(method="<script>x</script>")]))
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_a_comparison_whose_less_leaking_side_stopped_short_never_holds():
    assert paired_verdict(4.5, 10.0, "fedper", "fedecouple", 0, 16)[0] == UNDETERMINED_LOWER_BOUND
    assert paired_verdict(4.5, 10.0, "fedper", "fedecouple", 16, 0)[0] == "holds"  # the higher side: no matter
    assert paired_verdict(-5.0, -1.0, "fedper", "fedavg", 3, 0)[0] == UNDETERMINED_LOWER_BOUND
    assert paired_verdict(-5.0, -1.0, "fedper", "fedavg", 0, 3)[0] == "does not hold"
    assert paired_verdict(-1.0, 1.0, "a", "b", 0, 0)[0] == "undetermined"
    assert paired_verdict(1.0, 2.0, "a", "b", 0, None)[0] == "undetermined"  # not recorded is not 0


def _fig10_frames(fedecouple_stopped: int):
    import pandas as pd

    rows = []
    for c in range(4):
        for i in range(2):
            rows.append({"method": "fedecouple", "attack": "ig@textbook", "round": 0, "client": c, "image": i,
                         "psnr": 14.0 + c, "prior_psnr": 12.0})
            rows.append({"method": "fedper", "attack": "ig@textbook", "round": 0, "client": c, "image": i,
                         "psnr": 20.0 + c + 0.5 * i, "prior_psnr": 12.0})
    results = pd.DataFrame(rows)
    by_round = pd.DataFrame([{"method": m, "attack": "ig@textbook", "round": 0, "n_images": 8, "n_targets": 4,
                              "mean_psnr": g["psnr"].mean(), "mean_psnr_ci_low": g["psnr"].mean() - 1,
                              "mean_psnr_ci_high": g["psnr"].mean() + 1, "prior_psnr": 12.0,
                              "mis_specified_targets": 0,
                              "not_converged_targets": fedecouple_stopped if m == "fedecouple" else 4}
                             for m, g in results.groupby("method")])
    return by_round, results


def test_fig10_never_says_fedecouple_leaks_least_on_a_lower_bound():
    from reports.fig10 import claim_lines, fig10_frame

    by_round, results = _fig10_frames(fedecouple_stopped=3)
    frame = fig10_frame(by_round, results, ["fedecouple", "fedper"])
    paired = frame[frame["kind"] == "paired"].iloc[0]
    assert paired["ci_low"] > 0 and paired["verdict"].startswith(UNDETERMINED_LOWER_BOUND)
    assert claim_lines(frame) == ["Round 0: FedeCouple leaks least: undetermined (lower bound) (against fedper)"]
    method = frame[(frame["kind"] == "method") & (frame["method"] == "fedecouple")].iloc[0]
    assert method["verdict"] == EXPOSED and method["stopped_short_targets"] == 3
    # the optimiser reached the truth's objective on FedeCouple's clients: the same difference holds
    frame = fig10_frame(*_fig10_frames(fedecouple_stopped=0), ["fedecouple", "fedper"])
    assert frame[frame["kind"] == "paired"].iloc[0]["verdict"] == "holds"


@pytest.fixture(scope="module")
def results_page():
    spec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def test_no_record_holds_a_progress_bar_or_a_long_headline():
    records = sorted((ROOT / "results").glob("*.json"))
    assert records
    for path in records:
        text = path.read_text(encoding="utf-8")
        assert "it/s]" not in text and "%|" not in text and "round/s]" not in text, f"{path.name}: a progress bar"
        headline = json.loads(text)["figures"]["headline"]
        assert len(headline) <= 200, f"{path.name}: headline of {len(headline)} characters"


def test_progress_bars_are_stripped_where_records_are_written(results_page):
    printed = ("fedavg rounds:  45%|████▌     | 9/20 [00:01<00:02,  4.86round/s]\n"
               "ig:  10%|█         | 1/10 [00:00<00:03,  2.91it/s]\rig: 100%|██████████| 10/10 [00:03<00:00]\r"
               "ig on fedavg: mean PSNR 20.00 dB\nkept line\n")
    assert results_page.printout(printed) == "ig on fedavg: mean PSNR 20.00 dB\nkept line"


def test_the_page_explains_its_words_before_the_matrix(results_page):
    if shutil.which("git") is None or not results_page.git_available():
        pytest.skip("git is not available: which cells are stale is read from the commits")
    page = results_page.render(results_page.load_records())
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## How to read", "## Exposure matrix"]
    how = page.split("## How to read")[1].split("## Exposure matrix")[0]
    for word in ("EXPOSED", "LOWER BOUND", "NOT SHOWN", "NO MODEL", "REFUSED", "n/a", "PSNR", "prior",
                 "class-presence accuracy", "LiRA AUC", "TPR at 1 % FPR", "inputs exact", "fishing share",
                 "stopped short", "MIS-SPECIFIED", "carried", "stale"):
        assert word in how, word
    matrix = page.split("## Exposure matrix")[1].split("\n## ")[0]
    assert "| method | curious server, round 0 | curious server, trained (round 19) |" in matrix
    assert "| fedavg |" in matrix and "| fedecouple |" in matrix


def test_the_audit_records_fig10_holds_nothing_on_a_lower_bound(results_page):
    record = json.loads((ROOT / "results" / "audit-preset.json").read_text(encoding="utf-8"))
    rows, claims = results_page.fig10_rows(record["figures"])
    stopped = {(r[0], r[1], r[2]): results_page._checks(r[7])[1] for r in record["figures"]["table"]["rows"]}
    for r in rows:
        if " − " in r[1] and r[6] == "holds":
            a, b = r[1].split(" − ")
            assert stopped[(b, r[2], r[0])] == 0, r
    for claim in claims:  # "Round 0: FedeCouple leaks least: ..."
        if stopped[("fedecouple", "ig@textbook", claim.split()[1].rstrip(":"))]:
            assert "FedeCouple leaks least: holds" not in claim, claim


def test_the_reports_markdown_and_html_open_with_the_matrix():
    import pandas as pd

    from fedsec.jobs.report.tables import exposure_evidence
    from reports.comparison import render_html, render_markdown

    summary = pd.DataFrame([
        {"method": "fedper", "accuracy_mean": 0.9, "accuracy_std": 0.01, "upload_mb_per_round": 1.0,
         "dlg_status": "done", "dlg_mean_psnr": 20.0, "dlg_prior_psnr": 12.0, "labels_status": "done",
         "labels_class_presence_accuracy": 1.0, "secure_aggregation": "runs on the sum"},
        {"method": "fedproto", "accuracy_mean": 0.9, "accuracy_std": 0.01, "upload_mb_per_round": 0.1,
         "dlg_status": "not applicable: fedproto uploads no model weights (it sent: prototypes)",
         "labels_status": "done", "labels_class_presence_accuracy": 1.0, "secure_aggregation": "runs on the sum"},
        {"method": "<b>fedpac</b>", "accuracy_mean": 0.9, "accuracy_std": 0.01, "upload_mb_per_round": 1.0,
         "dlg_status": "done", "dlg_mean_psnr": 11.0, "dlg_prior_psnr": 12.0, "labels_status": "done",
         "labels_class_presence_accuracy": 1.0, "secure_aggregation": "refuses: h, V"}])
    by_round = pd.DataFrame([
        {"method": "fedper", "attack": "dlg", "round": 0, "n_images": 4, "n_targets": 4, "mean_psnr": 20.0,
         "mean_psnr_ci_low": 17.0, "mean_psnr_ci_high": 23.0, "prior_psnr": 12.0, "mis_specified_targets": 0,
         "not_converged_targets": 2, "model_unknown_targets": 0},
        {"method": "<b>fedpac</b>", "attack": "dlg", "round": 0, "n_images": 4, "n_targets": 4, "mean_psnr": 11.0,
         "mean_psnr_ci_low": 9.0, "mean_psnr_ci_high": 13.0, "prior_psnr": 12.0, "mis_specified_targets": 0,
         "not_converged_targets": 4, "model_unknown_targets": 0}])
    methods = list(summary["method"])
    meta = {"title": "t", "methods": methods, "attacks": ["dlg", "labels"], "image_attacks": ["dlg"],
            "label_attacks": ["labels"], "attack_settings": {"dlg": {"rounds": [0]}, "labels": {"rounds": [0]}},
            "mia": [{"method": "fedper", "targets": {"personal": {"available": True, "attacks": {
                "lira": {"auc": 0.62, "auc_ci": [0.58, 0.66]}}}}}]}
    meta["exposure"] = exposure_evidence(summary, by_round, meta)
    findings = pd.DataFrame(columns=["method", "severity", "code", "finding", "measured", "evidence"])
    md = render_markdown(summary, findings, {}, meta)
    assert md.index("## Exposure matrix") < md.index("## Headline")
    matrix = md.split("## Exposure matrix")[1].split("## Headline")[0]
    assert "| fedper | EXPOSED ≥ 20.00 dB [17.00, 23.00] |" in matrix  # at a glance: "≥", it stopped short
    assert ("**fedper**, curious server, round 0: EXPOSED (at least): 20.00 dB [17.00, 23.00], prior 12.00; "
            "2/4 stopped short (dlg, round 0)") in matrix
    assert "| fedproto | NO MODEL |" in matrix and "**fedproto**, curious server, round 0: NO MODEL: fedproto uploads no model weights" in matrix
    assert "LOWER BOUND: 11.00 dB [9.00, 13.00], prior 12.00; 4/4 stopped short" in matrix
    assert "REFUSED: its server reads h, V of each client" in matrix
    assert "EXPOSED: LiRA AUC 0.620 [0.580, 0.660]" in matrix
    page = render_html(summary, findings, {}, meta, {})
    assert page.index("<h2>Exposure matrix</h2>") < page.index("<h2>Headline</h2>")
    assert "<b>fedpac</b>" not in page and "&lt;b&gt;fedpac&lt;/b&gt;" in page


def test_a_cell_key_names_its_threat():
    assert cell_threat("ig@textbook", 0) == "round0" and cell_threat("ig@textbook", 19) == "trained"
    assert cell_threat("fedavg-leak@real-n4", 0) == "real-small"
    assert cell_threat("fedavg-leak@real-n50", 19) == "real-default"
    assert cell_threat("fedavg-leak", 0, real_by_default=True) == "real-default"
    assert cell_threat("proto", 19) == "trained"


def test_the_exact_batch_attack_fills_its_own_column_from_the_share_of_inputs_recovered():
    """SPEAR's per-image rows (``input_error``) become the "exact batch recovery" column: the share of inputs
    within its rule with the interval over clients, judged against 0; a method it does not apply to is REFUSED
    there too."""
    import pandas as pd

    from fedsec.jobs.report.tables import exposure_evidence, leakage_by_round

    rows = [{"method": "fedper", "attack": "spear@textbook", "round": 19, "client": c, "image": i, "psnr": 30.0,
             "ssim": 0.9, "prior_psnr": 12.0, "input_error": 1e-7 if (c, i) != (3, 0) else 0.2, "certified": 1,
             "not_converged": False, "mis_specified": False} for c in range(4) for i in range(8)]
    by_round = leakage_by_round(pd.DataFrame(rows), ["fedper"], ["spear@textbook"])
    (row,) = by_round.to_dict("records")
    assert row["inputs_exact_share"] == pytest.approx(31 / 32)
    assert row["inputs_exact_ci_low"] < 31 / 32 <= row["inputs_exact_ci_high"]
    summary = pd.DataFrame([{"method": "fedper", "spear@textbook_status": "done"},
                            {"method": "fedproto", "spear@textbook_status": "not applicable: fedproto uploads no "
                                                                             "extractor weights"}])
    meta = {"attacks": ["spear@textbook"], "attack_settings": {"spear@textbook": {"rounds": [19]}}}
    matrix = exposure_matrix(exposure_evidence(summary, by_round, meta))
    exact = matrix.cells[("fedper", "exact-batch")].verdict
    assert exact.word == EXPOSED and exact.evidence.metric == "inputs exact" and exact.evidence.stopped_short == 0
    assert matrix.cells[("fedproto", "exact-batch")].word == REFUSED
