"""The current-results page is generated from the records under ``results/`` and held in step with them:
every record names its command, commit and machine; the main job's record is the README's first command;
a record measured before the code it depends on changed is shown as stale; ``bench/results.py`` refuses
an unknown cell in one line with exit status 2."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "results.py"


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("bench_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def need_git(results):
    if shutil.which("git") is None or not results.git_available():
        pytest.skip("git is not available: which cells are stale is read from the commits")


def test_the_committed_page_and_sample_lines_are_what_the_records_render(results):
    need_git(results)
    for path, text in results.rendered_files(results.load_records()).items():
        assert path.read_text(encoding="utf-8") == text, \
            f"{path.relative_to(ROOT)} is out of step with results/*.json: run 'python bench/results.py --render'"


def test_every_record_carries_its_command_commit_machine_and_a_headline(results):
    records = results.load_records()
    assert "main-job" in records
    for name, record in records.items():
        cell = results.CELLS[name]
        assert record["command"] == cell.command, f"{name}: the record's command is not the cell's"
        assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool), name
        assert record["machine"]["cpu"] and record["machine"]["cores"], name
        assert record["figures"]["headline"], name
        assert record["source"] in (results.MEASURED, results.CARRIED), name
        if cell.needs_gpu:
            assert record["machine"]["gpu"], f"{name} comes from a GPU machine and says which"


def test_the_main_jobs_cell_is_the_readmes_first_command(results):
    record = results.load_records()["main-job"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert record["source"] == results.MEASURED
    assert f".venv/bin/{record['command']}\n" in readme
    assert f"```text\n{record['figures']['line']}\n```" in readme, "README's sample line is the main job's record"
    assert record["figures"]["line"].startswith("dlg on fedecouple (method): mean PSNR ")
    assert "→ runs/attack-dlg-fedecouple" in record["figures"]["line"]


def test_a_record_measured_before_its_code_changed_is_shown_stale(results):
    need_git(results)
    cell = results.CELLS["main-job"]
    first = results.git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0]
    head = results.git("rev-parse", "HEAD").stdout.strip()
    old = {"commit": first, "dirty": False, "source": results.MEASURED}
    assert results.staleness(old, cell) and results.status_text(old, cell).startswith("**stale**")
    assert results.staleness({"commit": "0" * 40}, cell) == "commit 0000000 is not in this history"
    fresh = {"commit": head, "dirty": False, "source": results.MEASURED}
    assert results.staleness(fresh, cell) is None and results.status_text(fresh, cell) == "current"
    assert results.status_text({**fresh, "source": results.CARRIED}, cell) == "carried"


def test_rendering_escapes_what_it_reads(results):
    assert results.cell_text("a | b <script>") == "a \\| b &lt;script&gt;"


def test_an_unknown_cell_is_a_one_line_error_with_exit_status_2():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cell", "no-such-cell"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("error: unknown cell no-such-cell; known: all, main-job,")
    assert len(done.stderr.strip().splitlines()) == 1


def test_keep_without_a_cell_is_a_one_line_error_with_exit_status_2(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--render", "--keep", str(tmp_path / "kept")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: --keep keeps the folders")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "kept").exists()


def test_records_are_written_atomically(results, tmp_path):
    target = tmp_path / "cell.json"
    results.write_atomic(target, json.dumps({"cell": "x"}))
    assert json.loads(target.read_text(encoding="utf-8")) == {"cell": "x"}
    assert [p.name for p in tmp_path.iterdir()] == ["cell.json"]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_the_table_cells_read_the_files_their_commands_write(results, tmp_path):
    """Each extractor on files laid out as its command writes them (columns from the writers)."""
    _write(tmp_path / "runs/compare-weak/accuracy.csv", "method,seed,mean_accuracy,std_accuracy\n"
           "fedavg,0,0.80,0.05\nfedavg,1,0.90,0.07\nlocal,0,0.70,0.10\nlocal,1,0.72,0.12\n")
    compare = results.compare_figures(tmp_path, "")
    assert compare["table"]["rows"][0] == ["fedavg", "85.00 ± 7.07", "6.00", "2"]
    assert compare["headline"].startswith("best fedavg 85.00 ± 7.07 %")

    _write(tmp_path / "n_curve.csv", "method,attack,train_images,mean_psnr,mean_psnr_low,mean_psnr_high,prior_psnr,"
           "success_rate,label_count_error,n_images,n_targets,mis_specified_targets,not_converged_targets,iterations,"
           "restarts,seconds,note\nfedavg,fedavg-leak,4,22.9,19.3,26.5,11.0,1.0,0,16,4,0,4,,,332,\n"
           "fedavg,fedavg-leak,50,11.2,10.2,12.2,11.6,0.0,0,200,4,0,4,200,1,100,\n")
    assert results.n_curve_figures(tmp_path, "")["headline"] == "largest N whose interval clears the prior: 4"

    _write(tmp_path / "runs/audit/by_round.csv", "method,attack,round,n_images,n_targets,mean_psnr,mean_psnr_ci_low,"
           "mean_psnr_ci_high,prior_psnr,success_rate,success_rate_ci_low,success_rate_ci_high,mis_specified_targets,"
           "not_converged_targets\nfedper,ig@textbook,0,32,16,25.7,24.1,27.5,12.2,1.0,0.89,1.0,0,16\n")
    assert results.audit_figures(tmp_path, "")["headline"] == "1 of 1 cells above the prior by their interval"

    header = ",".join(["method", "attack", "craft", "train_images", "download_check", "status", "reason", "n_targets",
                       "n_images", "rebuilt_30db", "rebuilt_30db_share", "rebuilt_30db_ci_low", "rebuilt_30db_ci_high",
                       "recovered", "recovered_share", "recovered_ci_low", "recovered_ci_high", "n_scored",
                       "mean_psnr", "mean_psnr_ci_low", "mean_psnr_ci_high", "prior_psnr", "inputs_exact_share",
                       "inputs_exact_ci_low", "inputs_exact_ci_high", "crafted_downloads", "crafted_refused",
                       "honest_downloads", "honest_refused", "seconds"])
    _write(tmp_path / "runs/report-trap/malicious.csv", header + "\n"
           "fedavg,trap,binning,10,off,done,,4,40,6,0.15,0,0.3,23,0.57,0.41,0.73,40,21.05,18.4,23.6,11.88,0.95,0.8,1,,,,,10\n"
           "fedavg,trap,binning,10,on,done,,4,40,0,0,0,0.09,0,0,0,0.09,0,,,,,,,,4,4,6,0,3\n"
           "fedproto,trap,binning,10,off,refused,trains nothing the server sends,,,,,,,,,,,,,,,,,,,,,,,0\n")
    malicious = results.malicious_figures(tmp_path, "")
    assert malicious["headline"] == "check off, recovered at N = 10: fedavg 57 %; check on: at most 0 %"
    assert malicious["table"]["rows"][0][3] == "57 % [41, 73]"  # the interval the exposure matrix judges by
    assert malicious["table"]["rows"][1][-1] == "4/4 / 0/6"

    _write(tmp_path / "runs/mia-fedproto/summary.json", json.dumps({"target_accuracy": 0.9786, "targets": {
        "personal": {"available": True, "attacks": {"lira": {"auc": 0.638, "tpr_at_1pct_fpr": 0.112}}},
        "global": {"available": False, "note": "no global model"}}}))
    mia = results.mia_figures(tmp_path, "")
    assert mia["headline"] == "accuracy 0.9786; personal models LiRA AUC 0.638, TPR at 1 % FPR 0.112"

    start = results.start_figures(tmp_path, "command median s min s max s\nfedsec --help 0.10 0.09 0.12\n"
                                            "fedsec attack --help 0.13 0.11 0.20\n")
    assert start["headline"] == "fedsec --help 0.10 s; slowest: fedsec attack --help 0.13 s (medians of 5 processes)"
    with pytest.raises(results.CellError):
        results.start_figures(tmp_path, "Traceback ...\n")


def test_rendering_puts_the_main_jobs_line_where_the_docs_show_it(results):
    text = "intro\n```text\ndlg on fedecouple (method): mean PSNR 1.00 dB\n```\nafter\n"
    assert results.with_sample_line(text, "dlg on fedecouple (method): mean PSNR 2.00 dB") == \
        "intro\n```text\ndlg on fedecouple (method): mean PSNR 2.00 dB\n```\nafter\n"
    with pytest.raises(results.CellError):
        results.with_sample_line("no sample here", "x")


def test_a_cell_whose_server_holds_no_model_says_so_in_its_headline(results, tmp_path):
    """FedProto's prototype attack: the summary flags every target NO MODEL (the server holds no extractor
    of the client); the cell's figures count them and its headline says the figure is an estimate."""
    run = tmp_path / "runs" / "attack-proto-fedproto"
    run.mkdir(parents=True)
    summary = {"mean_psnr": 11.07, "mean_psnr_ci": [10.59, 11.35], "mean_prior_psnr": 13.27, "images_scored": 24,
               "n_targets": 8, "mis_specified_targets": 0,
               "per_target": [{"model_unknown": True}] * 7 + [{"model_unknown": False}]}
    (run / "summary.json").write_text(json.dumps(summary))
    figures = results.attack_figures(tmp_path, "proto on fedproto: mean PSNR 11.07 dB → runs/attack-proto-fedproto")
    assert figures["model_unknown_targets"] == 7
    assert figures["headline"].endswith("24 images, 8 targets (7 NO MODEL (estimate))")
    del summary["per_target"]
    (run / "summary.json").write_text(json.dumps(summary))
    assert "NO MODEL" not in results.attack_figures(tmp_path, "")["headline"]


def test_the_pages_pictures_show_the_records_figures(results):
    """The Fig. 10 bars and the client-size curve are drawn from the records' own table entries: the
    intervals parse, a MIS-SPECIFIED point is left out, and the page links every picture it draws."""
    from results_figures import _mis_specified, interval, pictures

    assert interval("18.94 [16.68, 20.87]") == (18.94, 16.68, 20.87)
    assert interval("+6.83 [+4.50, +10.05]") == (6.83, 4.5, 10.05) and interval("–") is None
    assert _mis_specified("4 / –") and not _mis_specified("0 / 4") and not _mis_specified("– / –")
    records = results.load_records()
    drawn = pictures(records, results.fig10_rows)
    assert {name for name, _, _ in drawn} == {"fig10.png", "n-curve.png"}
    assert all(data.startswith(b"\x89PNG") for _, _, data in drawn)
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert all(f"](img/results/{name})" in page and (ROOT / "docs" / "img" / "results" / name).exists()
               for name, _, _ in drawn)
