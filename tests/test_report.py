"""``fedsec report``: outputs, HTML escaping and self-containment, resume after a crash, reuse, bad input.

Everything runs on the 8×8 ``digits`` data set with 4 clients, 1 round and 3-step attacks; the
methods are FedPer (DLG applies) and FedProto (proto and labels apply), so every kind of stage —
done, not applicable — appears.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from fedsec import runner
from fedsec.cli import main
from fedsec.jobs import report as rep
from fedsec.jobs.report import stages as report_stages
from fedsec.runner import RunConfig
from helpers import TEST_THREADS

METHODS = ["fedper", "fedproto"]
ATTACKS = ["dlg", "proto", "labels"]
HEADLINE = ["method", "accuracy_mean", "accuracy_std", "upload_mb_per_round", "dlg_mean_psnr", "dlg_median_psnr",
            "dlg_max_psnr", "dlg_prior_psnr", "dlg_ssim", "proto_mean_psnr", "proto_prior_psnr",
            "labels_class_presence_accuracy", "findings_high", "findings_medium", "findings_low", "findings_info"]


def base_config(**kw) -> RunConfig:
    return RunConfig.of(**{"dataset": "digits", "clients": 4, "rounds": 1, "threads": 1, **kw})


def settings() -> rep.ReportSettings:
    return rep.ReportSettings(targets=1, iterations={a: 3 for a in ATTACKS})


def build(out, **kw):
    return rep.build_report(base_config(), METHODS, out, attacks=ATTACKS, settings=settings(), progress=False, **kw)


class Calls:
    """Counts the stage functions fedsec.jobs.report's stages call; ``crash`` maps (kind, method) to an exception."""

    def __init__(self, monkeypatch, crash: dict | None = None):
        self.count = {"train": [], "audit": [], "attack": []}
        self.crash = crash or {}
        real_train, real_audit, real_attack = runner.train, report_stages.run_audit, report_stages.run_attack

        def train(config, out, *a, **k):
            return self._call("train", config.method, lambda: real_train(config, out, *a, **k), out)

        real_train_federation = runner.train_federation

        def train_federation(fed, prep, out):  # the train stage that records rounds for the attacks
            return self._call("train", prep.config.method, lambda: real_train_federation(fed, prep, out), out)

        def audit(config, out, *a, **k):
            return self._call("audit", config.method, lambda: real_audit(config, out, *a, **k), out)

        def attack(config, settings, *a, **k):
            return self._call("attack", f"{config.method}/{settings.attack}",
                              lambda: real_attack(config, settings, *a, **k), k.get("out"))

        monkeypatch.setattr(runner, "train", train)
        monkeypatch.setattr(runner, "train_federation", train_federation)
        monkeypatch.setattr(report_stages, "run_audit", audit)
        monkeypatch.setattr(report_stages, "run_attack", attack)

    # the first file each kind of stage writes, half-written, as a crash in the middle leaves it
    PARTIAL = {"train": ("config.json", '{"config": {"meth'), "audit": ("audit.csv", "method,round,cli"),
               "attack": ("attack.csv", "method,attack,mo")}

    def _call(self, kind, who, real, out):
        self.count[kind].append(who)
        exc = self.crash.get((kind, who))
        if exc is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            name, text = self.PARTIAL[kind]
            (Path(out) / name).write_text(text)
            raise exc
        return real()

    def total(self) -> int:
        return sum(len(v) for v in self.count.values())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    result = build(out)
    return out, result


def test_report_writes_every_output(built):
    out, result = built
    assert result["failed"] == {}
    for name in ("report.md", "report.html", "results.csv", "summary.csv", "findings.csv", "psnr_by_method.png",
                 "accuracy_vs_leakage.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in ("psnr_by_method.png", "accuracy_vs_leakage.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["method"]) == METHODS
    assert set(HEADLINE) <= set(summary.columns)
    row = summary.set_index("method")
    assert 0 <= row.loc["fedper", "accuracy_mean"] <= 1 and row.loc["fedper", "upload_mb_per_round"] > 0
    assert row.loc["fedper", "dlg_status"] == "done" and pd.notna(row.loc["fedper", "dlg_mean_psnr"])
    assert row.loc["fedproto", "dlg_status"].startswith("not applicable: fedproto uploads no model weights")
    assert row.loc["fedproto", "proto_status"] == "done" and pd.notna(row.loc["fedproto", "proto_prior_psnr"])
    assert row.loc["fedper", "proto_status"].startswith("not applicable")
    assert row.loc["fedproto", "findings_high"] + row.loc["fedproto", "findings_medium"] >= 1

    results = pd.read_csv(out / "results.csv")
    images = results[results["attack"].isin(["dlg", "proto"])]
    assert set(zip(images["method"], images["attack"])) == {("fedper", "dlg"), ("fedproto", "proto")}
    assert images[["round", "client", "image", "psnr", "prior_psnr"]].notna().all().all()
    # results.csv is the attack.csv files concatenated
    parts = sum(len(pd.read_csv(p)) for p in out.glob("*/attack-*/attack.csv"))
    assert len(results) == parts

    md = (out / "report.md").read_text(encoding="utf-8")
    assert md.index("## Exposure matrix") < md.index("## Headline")  # the exposure matrix comes first
    for text in ("## Headline", "PSNR definition", "data_range=1", "psnr_by_method.png",
                 "fedper/attack-dlg/reconstructions.png", "Package versions", '"seed": 0', "## Audit findings"):
        assert text in md, text
    # every stage marked complete with its identity, and nothing half-written
    assert len(list(out.glob("*/*/done.json"))) == len(METHODS) * (2 + len(ATTACKS))
    assert not list(out.rglob("*.tmp")) and not list(out.rglob(".*.partial"))


def test_html_is_self_contained(built):
    out, _ = built
    page = (out / "report.html").read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//|file:)""", page, re.I)
    assert "<link" not in page and "<script" not in page
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) >= 4  # two plots, two reconstruction grids
    assert all(s.startswith("data:image/png;base64,") for s in sources)


def test_html_escapes_strings_from_the_data(built, tmp_path, monkeypatch):
    out = tmp_path / "copy"
    shutil.copytree(built[0], out)
    evil = "<script>alert(1)</script>"
    findings_file = out / "fedproto" / "audit" / "findings.json"
    findings = json.loads(findings_file.read_text())
    findings.append({"severity": "high", "code": "EVIL", "finding": f"leaks {evil}", "evidence": {"x": evil}})
    findings_file.write_text(json.dumps(findings))
    calls = Calls(monkeypatch)
    build(out)
    assert calls.total() == 0  # every stage was complete: only the report was re-rendered
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script" not in page


def test_renderer_escapes_method_names():
    from reports.comparison import render

    evil = '<script>alert("x")</script>'
    summary = pd.DataFrame([{"method": evil, "accuracy_mean": 0.5, "accuracy_std": 0.1, "upload_mb_per_round": 1.0,
                             "dlg_status": "done", "dlg_mean_psnr": 20.0, "dlg_median_psnr": 20.0, "dlg_max_psnr": 22.0,
                             "dlg_prior_psnr": 10.0, "dlg_ssim": 0.5}])
    results = pd.DataFrame([{"method": evil, "attack": "dlg", "psnr": 20.0, "prior_psnr": 10.0}])
    findings = pd.DataFrame([{"method": evil, "severity": "high", "code": evil, "finding": evil, "measured": evil,
                              "evidence": evil}])
    files = render(summary, results, findings, {}, {"methods": [evil], "attacks": ["dlg"], "image_attacks": ["dlg"],
                                                    "label_attacks": [], "psnr_cap_db": 100.0, "leak_gap_db": 3.0,
                                                    "title": evil, "command": evil, "notes": [evil],
                                                    "config": {"x": evil}})
    page = files["report.html"]
    assert "<script" not in page and page.count("&lt;script&gt;") >= 6
    assert files["psnr_by_method.png"][:4] == b"\x89PNG"


def test_resume_after_a_crash_recomputes_nothing_that_was_complete(tmp_path, monkeypatch):
    out = tmp_path / "r"
    # crash in the second method's audit, after it left a half-written file behind
    with monkeypatch.context() as m:
        calls = Calls(m, crash={("audit", "fedproto"): KeyboardInterrupt()})
        with pytest.raises(KeyboardInterrupt):
            build(out)
        assert calls.count["train"] == ["fedper", "fedproto"]
    complete = {p.parent.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.glob("*/*/done.json")}
    assert set(complete) == {"fedper/train", "fedper/audit", "fedper/attack-dlg", "fedper/attack-proto",
                             "fedper/attack-labels", "fedproto/train"}
    assert not (out / "fedproto" / "audit" / "done.json").exists() and not (out / "report.html").exists()

    # an attack that fails is reported, not fatal; the report is written and marks it
    with monkeypatch.context() as m:
        calls = Calls(m, crash={("attack", "fedproto/proto"): RuntimeError("simulated failure")})
        result = build(out)
        assert calls.count["train"] == [] and calls.count["audit"] == ["fedproto"]
        assert calls.count["attack"] == ["fedproto/proto", "fedproto/labels"]  # dlg: not applicable, known up front
    assert list(result["failed"]) == [("fedproto", "attack-proto")]
    assert "failed: RuntimeError: simulated failure" in (out / "report.html").read_text(encoding="utf-8")

    # the rerun does only the failed stage
    calls = Calls(monkeypatch)
    result = build(out)
    assert calls.count == {"train": [], "audit": [], "attack": ["fedproto/proto"]}
    assert result["failed"] == {}
    for rel, mtime in complete.items():
        assert (out / rel / "done.json").stat().st_mtime_ns == mtime, rel
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["method"]) == METHODS and summary.loc[1, "proto_status"] == "done"
    assert not list(out.rglob("*.tmp")) and not list(out.rglob(".*.partial"))
    assert pd.read_csv(out / "fedproto" / "audit" / "audit.csv").shape[1] == 8  # the half-written file was redone


def test_reuse_copies_matching_stages(built, tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    out = tmp_path / "again"
    result = build(out, reuse=[built[0].parent])  # any folder above an earlier report works
    assert calls.total() == 0
    assert {r["source"] for r in result["stages"]} == {"reused"}
    done = json.loads((out / "fedper" / "train" / "done.json").read_text())
    assert done["reused_from"].endswith("fedper/train")
    assert pd.read_csv(out / "summary.csv").equals(pd.read_csv(built[0] / "summary.csv"))


def _cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "--dataset", "digits", "--threads", str(TEST_THREADS), *args])
    return exc.value.code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("args, message", [
    (["--methods", "fedper,nope"], "unknown method nope"),
    (["--attacks", "dlg,zap"], "unknown attack zap"),
    (["--method", "fedper"], "report takes --methods"),
    (["--iterations", "dlg=0"], "--iterations must be at least 1"),
    (["--attack-rounds", "x"], "--attack-rounds expects"),
    (["--reuse", "/nonexistent/fedsec-report"], "--reuse /nonexistent/fedsec-report: not a directory"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    code, err = _cli([*args, "--out", str(out)], capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_stage_folder_with_another_configuration_is_an_error(built, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(built[0], out)
    before = sorted(p.as_posix() for p in out.rglob("*"))
    code, err = _cli(["--methods", ",".join(METHODS), "--attacks", ",".join(ATTACKS), "--clients", "5",
                      "--rounds", "1", "--out", str(out)], capsys)
    assert code == 2 and "different configuration" in err
    assert sorted(p.as_posix() for p in out.rglob("*")) == before


def test_each_computed_stage_carries_the_estimate_it_was_given(built):
    """``fedsec.estimate``'s seconds for every stage computed in the run, beside its wall seconds in the
    report: training and the applicable attacks cost something, the attacks that do not apply nothing."""
    out, result = built
    estimated = {(r["method"], r["stage"]): r["estimated"] for r in result["stages"]}
    assert estimated[("fedper", "train")] > 0 and estimated[("fedper", "attack-dlg")] > 0
    assert estimated[("fedproto", "attack-dlg")] == 0.0
    text = (out / "report.md").read_text(encoding="utf-8")
    assert "| estimated seconds |" in text and "| all computed |" in text


def test_reuse_takes_a_plain_train_run(tmp_path, monkeypatch):
    from fedsec import runner

    cfg = base_config(method="fedproto")
    runner.train(cfg, tmp_path / "runs" / "fedproto-train")
    calls = Calls(monkeypatch)
    out = tmp_path / "r"
    result = rep.build_report(base_config(), ["fedproto"], out, attacks=["dlg"], settings=settings(), progress=False,
                              reuse=[tmp_path / "runs"])
    assert calls.count["train"] == [] and calls.count["audit"] == ["fedproto"]
    assert [r["source"] for r in result["stages"]] == ["reused", "computed", "computed"]
    assert (out / "fedproto" / "train" / "metrics.csv").is_file() and (out / "fedproto" / "train" / "done.json").is_file()
    # a stage computed now carries the estimate it was given before the run (DLG does not apply to
    # FedProto's uploads, known before anything runs: 0 s), a reused one none; the report's stage table
    # sets them beside the wall seconds, with the totals of the stages that have both
    estimated = {r["stage"]: r["estimated"] for r in result["stages"]}
    assert estimated["train"] is None and estimated["attack-dlg"] == 0.0
    from reports.comparison import stage_rows
    header, rows = stage_rows(result["stages"])
    assert header[3:5] == ["seconds", "estimated seconds"] and rows[-1][0] == "all computed"
    assert float(rows[-1][4]) == pytest.approx(sum(r["estimated"] for r in result["stages"] if r["estimated"]), abs=0.2)
    assert "| estimated seconds |" in (out / "report.md").read_text(encoding="utf-8")


def test_method_comparisons_call_a_difference_only_when_the_interval_says_so():
    """Paired over the same targets: a consistent 8 dB gap over 6 clients is a difference; a gap
    that flips sign from client to client is not; a mis-specified attack is never compared, and a
    missing (NaN) flag — proto has no forward-model check — is not taken for one; where the side that
    leaks less stopped short of the truth the order is undetermined (lower bound), where the side that
    leaks more did, the order stands."""
    import numpy as np
    import pandas as pd

    from fedsec.jobs.report import method_comparisons

    rng = np.random.default_rng(0)
    rows = []
    for client in range(6):
        base = 15 + rng.normal(0, 2)
        for method, shift in (("a", 8.0), ("b", 0.0), ("c", 3.0 if client % 2 else -3.0)):
            rows.append({"method": method, "attack": "ig", "round": 0, "client": client, "image": 0,
                         "psnr": base + shift, "prior_psnr": 10.0, "ssim": 0.5,
                         "mis_specified": float("nan") if method == "a" else False})
    results = pd.DataFrame(rows)
    summary = pd.DataFrame([{"method": m, "ig_status": "done", "ig_mis_specified": flag}
                            for m, flag in (("a", float("nan")), ("b", False), ("c", False))])
    sentences = method_comparisons(summary, results, ["a", "b", "c"], ["ig"])
    assert any(s.startswith("ig: a vs b: a leaks more (PSNR above the prior, a minus b: +8.0 dB") for s in sentences)
    assert any(s.startswith("ig: b vs c: not distinguishable at this sample size") for s in sentences), sentences
    assert "6 images over 6 targets" in sentences[0]
    flagged = results.assign(mis_specified=(results["method"] == "b").astype(object))
    assert "ig: a vs b: not comparable: the attack on b was mis-specified" in method_comparisons(
        summary, flagged, ["a", "b", "c"], ["ig"])
    # round 1: c, 2 dB below b on every image, stopped short of the truth on its 6 clients: a lower bound on
    # the side that leaks less, so no order; round 0 is still compared
    late = results[results["method"] != "a"].assign(round=1, not_converged=results["method"] == "c")
    late["psnr"] = 5.0 - 2.0 * (late["method"] == "c")
    sentences = method_comparisons(summary, pd.concat([results.assign(not_converged=False), late]), ["a", "b", "c"],
                                   ["ig"])
    assert any(s.startswith("ig, round 1: b vs c: undetermined (lower bound): c, the side that leaks less, stopped "
                            "short on 6 clients") for s in sentences), sentences
    assert any(s.startswith("ig, round 0: b vs c: not distinguishable at this sample size") for s in sentences)
    higher = late.assign(not_converged=late["method"] == "b")  # the side that leaks more stopped short
    sentences = method_comparisons(summary, pd.concat([results.assign(not_converged=False), higher]),
                                   ["a", "b", "c"], ["ig"])
    assert any(s.startswith("ig, round 1: b vs c: b leaks more") for s in sentences), sentences


def test_victim_settings_are_cells_and_share_one_recorded_training(tmp_path, monkeypatch):
    """With victim settings each gradient attack is two cells (textbook, real local training); the
    train stage records every round and the audit and the real-training attacks reuse that federation
    instead of retraining it, with the same numbers as an attack that trains on its own."""
    from fedecouple.engine import Federation
    from fedsec.jobs.attack import run_attack
    from fedsec.jobs.compare import method_config

    rounds = []
    real_round = Federation.run_round

    def counted(self, *a, **k):
        rounds.append(self.method.name)
        return real_round(self, *a, **k)

    monkeypatch.setattr(Federation, "run_round", counted)
    settings = rep.ReportSettings(rounds=(0, 1), targets=1, iterations={"dlg": 3}, victim_settings=rep.VICTIM_SETTINGS,
                                  textbook_batch=2, targets_by={"dlg@textbook": 2})
    base = base_config(rounds=2, train_images=20)  # real local training replays every image: keep it small
    result = rep.build_report(base, ["fedpac"], tmp_path / "r", attacks=["dlg", "labels"], settings=settings,
                              progress=False)
    assert result["failed"] == {} and result["cells"] == ["dlg@textbook", "dlg@real", "labels"]
    # train (2 rounds, recorded) + the textbook cell's own training (its targets train differently): the
    # audit, dlg@real and labels train nothing
    assert len(rounds) == 4
    summary = pd.read_csv(tmp_path / "r" / "summary.csv")
    assert summary.loc[0, "dlg@textbook_n_images"] == 2 * 2 * 2  # 2 rounds x 2 targets x 2 images
    assert summary.loc[0, "dlg@real_n_images"] >= 10 and summary.loc[0, "labels_status"] == "done"
    for col in ("dlg@real_mean_psnr_ci_low", "dlg@real_success_rate_ci_high", "dlg@real_not_converged_targets"):
        assert col in summary.columns
    results = pd.read_csv(tmp_path / "r" / "results.csv")
    assert set(results["attack"]) == {"dlg@textbook", "dlg@real", "labels"}
    alone = run_attack(method_config(base, "fedpac", base.federation.seed), settings.for_attack("dlg@real"),
                       out=tmp_path / "alone", progress=False)
    shared = json.loads((tmp_path / "r" / "fedpac" / "attack-dlg@real" / "summary.json").read_text())
    assert shared["training_shared"] and alone["mean_psnr"] == shared["mean_psnr"]
    assert pd.read_csv(tmp_path / "alone" / "attack.csv")["psnr"].tolist() == \
        pd.read_csv(tmp_path / "r" / "fedpac" / "attack-dlg@real" / "attack.csv")["psnr"].tolist()


def test_the_audit_preset_plans_at_least_32_images_per_image_cell():
    """``--preset audit`` on mnist5k: every image cell scores at least 32 images, at round 0 and at
    the last of 20 rounds (the textbook cell: targets x batch; real local training: the targets'
    training sets; prototypes: one per class a target holds)."""
    from fedsec.runner import AUDIT_FEDERATION, prepare

    settings = rep.audit_preset()
    cells = settings.keys(rep.AUDIT_ATTACKS)
    # IG in the textbook setting, the attack built for real local training in the real one
    real = [f"fedavg-leak@real-n{n}" for n in (4, 10, 50)]
    # and the round's label histogram from each method's secure sum (the "with secure aggregation" column)
    # and SPEAR on one step of a batch of 8 (the "exact batch recovery" column)
    assert cells == ["ig@textbook", *real, "spear@textbook", "proto", "labels", "sum-labels"]
    assert settings.rounds == (0, 19)
    prep = prepare(RunConfig.of(dataset="mnist5k", **AUDIT_FEDERATION))
    smallest = min(len(prep.partition.train[c]) for c in range(prep.config.data.clients))
    plan = {c: settings.for_attack(c) for c in cells + ["ig@real"]}
    assert plan["sum-labels"].rounds == (0, 19) and plan["sum-labels"].spec.round_level
    assert plan["ig@textbook"].targets * plan["ig@textbook"].victim_batch >= 32
    assert plan["ig@textbook"].victim_batch == 2 and plan["spear@textbook"].victim_batch == 8
    assert plan["spear@textbook"].targets * plan["spear@textbook"].victim_batch >= 32
    for cell in real:  # real local training of clients of N images
        assert plan[cell].victim_batch == 0 and plan[cell].targets * settings.cell_size(cell) >= 32
    assert [plan[c].iterations for c in real] == [500, 500, 100]  # n50: fedavg-leak@real's entry
    # `fedsec attack ig --preset audit` attacks the federation's own clients (no size)
    assert plan["ig@real"].victim_batch == 0 and plan["ig@real"].targets * smallest >= 32
    assert settings.cell_size("ig@real") is None
    # --iterations ig@real=300 covers every size; a cell's own entry only that cell
    assert {rep.audit_preset({"fedavg-leak@real": 300}).for_attack(c).iterations for c in real} == {300}
    assert rep.audit_preset({"fedavg-leak@real-n50": 7}).for_attack(real[1]).iterations == 500
    # `fedsec attack ig --preset audit --train-images 10` keeps IG's own plan for that size
    assert (rep.audit_preset().for_attack("ig@real-n10").targets, rep.audit_preset().for_attack("ig@real-n10").iterations) == (4, 500)
    assert plan["proto"].targets * prep.config.data.classes_per_client >= 32
    assert all(s.rounds_to_train == AUDIT_FEDERATION["rounds"] for s in plan.values())


def test_preset_audit_on_the_command_line_prints_an_estimate_and_writes_both_settings(tmp_path, capsys):
    """``fedsec report --preset audit`` with explicit flags scaling it down (they win over the preset)."""
    out = tmp_path / "audit"
    main(["report", "--preset", "audit", "--dataset", "digits", "--clients", "4", "--rounds", "2",
          "--attack-rounds", "0,1", "--targets", "1", "--iterations", "3", "--methods", "fedpac",
          "--threads", str(TEST_THREADS), "--out", str(out)])  # returns (exit 0); a failure exits non-zero
    captured = capsys.readouterr()
    assert re.search(r"\d+ of \d+ stages to compute: about \d+ (s|min)", captured.err)
    assert all(cell in captured.out for cell in ("ig@textbook", "fedavg-leak@real-n4", "fedavg-leak@real-n10",
                                                  "fedavg-leak@real-n50"))
    summary = pd.read_csv(out / "summary.csv")
    assert summary.loc[0, "ig@textbook_n_images"] == 2 * 1 * 2  # 2 rounds x 1 target x 2 images (the preset's batch)
    assert summary.loc[0, "proto_status"] == "done"
    for size in (4, 10, 50):  # real local training of 1 client of N images per round, on its own federation
        assert summary.loc[0, f"fedavg-leak@real-n{size}_status"] == "done"
        assert summary.loc[0, f"fedavg-leak@real-n{size}_n_images"] == 2 * size
        sized = json.loads((out / "fedpac" / f"attack-fedavg-leak@real-n{size}" / "summary.json").read_text())["config"]
        assert sized["train_images"] == size
    config = json.loads((out / "fedpac" / "train" / "config.json").read_text())["config"]
    assert (config["clients"], config["rounds"]) == (4, 2)
    assert (out / "leakage_by_round.png").is_file() and "## Leakage by round" in (out / "report.md").read_text()
    by_round = pd.read_csv(out / "by_round.csv")
    cells = by_round[by_round["attack"] == "ig@textbook"].set_index("round")
    assert list(cells.index) == [0, 1] and (cells["n_images"] == 2).all()
    # one target of two images per round: too few for an interval, and the report says so instead of printing one
    assert cells["mean_psnr_ci_low"].isna().all() and cells["mean_psnr_ci_high"].isna().all()
    assert "too few targets for an interval" in (out / "report.md").read_text()
    # the preset's malicious-server section: trap at 10 and 50 images, the check off and on
    section = pd.read_csv(out / "malicious.csv")
    assert list(zip(section["train_images"], section["download_check"])) == [(10, "off"), (10, "on"), (50, "off"),
                                                                             (50, "on")]
    assert "malicious.csv" in captured.out


def test_leakage_by_round_crosses_out_the_rounds_an_attack_was_mis_specified():
    from reports.figures import leakage_by_round

    rows = pd.DataFrame([{"method": "m", "attack": "ig@real", "round": r, "psnr": 20.0, "prior_psnr": 10.0,
                          "mis_specified": False} for r in (0, 19)])
    plain = leakage_by_round(rows, 100.0)
    assert plain[:4] == b"\x89PNG" and plain == leakage_by_round(rows, 100.0)  # the same figure, the same bytes
    assert leakage_by_round(rows.assign(mis_specified=[False, True]), 100.0) != plain


def test_iterations_name_sized_real_cells_and_an_unknown_setting_is_one_line_exit_2(tmp_path, capsys):
    assert rep.parse_iterations("ig@real-n10=300,ig@real=100") == {"ig@real-n10": 300, "ig@real": 100}
    for bad in ("ig@real-n0=5", "ig@real-10=5", "ig@fake=5"):
        with pytest.raises(SystemExit) as exc:
            main(["report", "--methods", "fedavg", "--attacks", "ig", "--dataset", "digits", "--iterations", bad,
                  "--out", str(tmp_path / "r")])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and "unknown setting" in line and "ATTACK@real-nN" in line, line
    assert not (tmp_path / "r").exists()


def test_jobs_run_the_methods_in_processes_and_the_numbers_do_not_change(tmp_path, capfd):
    """``--jobs 2``: the two methods' stages in two spawned processes give the files of ``--jobs 1``
    with the same ``--threads`` (each stage's seeds are its own); the threads are shared out."""
    from fedsec.jobs.report.stages import process_threads

    assert (process_threads(2, 2), process_threads(8, 2), process_threads(1, 2)) == (1, 4, 1)
    common = ["report", "--methods", "fedavg,fedpac", "--attacks", "ig,labels", "--dataset", "digits", "--clients",
              "3", "--rounds", "1", "--targets", "1", "--iterations", "4", "--threads", "1"]
    main([*common, "--out", str(tmp_path / "one")])
    main([*common, "--jobs", "2", "--out", str(tmp_path / "two")])
    err = capfd.readouterr().err  # the workers' stage lines reach the terminal's stderr
    assert "2 processes" in err and "[8/8] fedpac attack-labels: done" in err
    for name in ("results.csv", "summary.csv"):
        one = pd.read_csv(tmp_path / "one" / name).drop(columns=["seconds"], errors="ignore")
        two = pd.read_csv(tmp_path / "two" / name).drop(columns=["seconds"], errors="ignore")
        pd.testing.assert_frame_equal(one, two)
    assert pd.read_csv(tmp_path / "two" / "results.csv")["psnr"].notna().sum() > 0


def test_jobs_with_ray_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "--methods", "fedavg,fedpac", "--attacks", "labels", "--dataset", "digits", "--backend", "ray",
              "--jobs", "2", "--out", str(tmp_path / "r")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "--jobs" in line and "ray" in line.lower()
    assert not (tmp_path / "r").exists()


def test_fedsec_attack_preset_audit_with_train_images_takes_that_sized_cells_plan():
    from fedsec import presets

    given = {"attack_rounds": "0", "targets": 2, "iterations": None, "restarts": None, "victim_batch": 1}
    sized = presets.attack_plan("ig", given, lambda name: False, train_images=10)
    whole = presets.attack_plan("ig", given, lambda name: False)
    assert (sized["targets"], sized["iterations"], sized["victim_batch"]) == (4, 500, 0)
    assert (whole["targets"], whole["iterations"], whole["victim_batch"]) == (2, 100, 0)
    assert presets.attack_plan("ig", given, lambda name: name == "iterations", train_images=10)["iterations"] is None


def test_preset_audit_gives_ig_its_real_cells_back_when_fedavg_leak_is_not_requested():
    """The preset keeps IG to the textbook cell because ``fedavg-leak`` carries the real-training ones;
    ``--attacks ig --real-sizes 4`` without it must not leave IG with no real cell."""
    from fedsec import presets

    def cells(attack_text, explicit):
        attack_list, settings = presets.report_plan("audit", attack_text, "0", 2, None, lambda n: n in explicit,
                                                    real_sizes="4" if "real_sizes" in explicit else None)
        return settings.keys(attack_list)

    assert cells("ig,proto", {"attacks"}) == ["ig@textbook", "ig@real-n4", "ig@real-n10", "ig@real-n50", "proto"]
    assert cells("ig", {"attacks", "real_sizes"}) == ["ig@textbook", "ig@real-n4"]
    assert cells("ig,fedavg-leak", {"attacks", "real_sizes"}) == ["ig@textbook", "fedavg-leak@real-n4"]
    assert cells("", set()) == ["ig@textbook", "fedavg-leak@real-n4", "fedavg-leak@real-n10",
                                "fedavg-leak@real-n50", "spear@textbook", "proto", "labels", "sum-labels"]


def test_real_sizes_give_one_real_training_cell_per_client_size(tmp_path):
    """``--real-sizes 4,6`` without a preset: the gradient attack's cells are its real local training on
    federations of clients of 4 and of 6 training images (FedPAC's replay: every image rebuilt and scored)."""
    out = tmp_path / "r"
    main(["report", "--methods", "fedpac", "--attacks", "ig,labels", "--real-sizes", "6,4", "--dataset", "digits",
          "--clients", "3", "--rounds", "1", "--targets", "1", "--iterations", "2", "--threads", "1", "--out", str(out)])
    summary = pd.read_csv(out / "summary.csv")
    for size in (4, 6):
        assert summary.loc[0, f"ig@real-n{size}_status"] == "done"
        assert summary.loc[0, f"ig@real-n{size}_n_images"] == size
        config = json.loads((out / "fedpac" / f"attack-ig@real-n{size}" / "summary.json").read_text())["config"]
        assert config["train_images"] == size
    assert "ig_status" not in summary and summary.loc[0, "labels_status"] == "done"
    # the report's "Leakage vs client size" section: a line per N (the cut budget shown), the figure
    markdown, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "## Leakage vs client size" in markdown and "![Leakage vs client size](leakage_by_client_size.png)" in markdown
    for size in (4, 6):
        assert f"| fedpac, round 0 | ig | {size} | " in markdown
    assert "| 2 | – | " in markdown and "- fedpac, round 0: " in markdown
    assert "<h2>Leakage vs client size</h2>" in page and (out / "leakage_by_client_size.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags,needle", [(["--attacks", "labels", "--real-sizes", "10"], "applies to the gradient"),
                                          (["--attacks", "ig", "--real-sizes", "ten"], "expects comma-separated"),
                                          (["--attacks", "ig", "--real-sizes", "100000"], "the smallest client holds")])
def test_bad_real_sizes_are_one_line_exit_2_nothing_written(tmp_path, capsys, flags, needle):
    with pytest.raises(SystemExit) as exc:
        main(["report", "--methods", "fedavg", "--dataset", "digits", "--clients", "3", *flags, "--out",
              str(tmp_path / "r")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and "--real-sizes" in line and needle in line, line
    assert not (tmp_path / "r").exists()


def _fig10_inputs():
    """FedeCouple and FedPer, ig@textbook at rounds 0 and 19, 4 clients × 2 images each: FedPer's image
    (c, i) scores 3 + 0.5·c + i dB above FedeCouple's, so the clients' mean differences are 3.5, 4, 4.5,
    5 dB. FedPer's rows come in reverse order and FedPer has one more image (client 9, 40 dB) that
    FedeCouple's attack never saw: a pairing by position, or no pairing, gives other numbers."""
    rows = []
    for rnd in (0, 19):
        for c in range(4):
            for i in range(2):
                base = 12.0 + c + 0.5 * i
                rows.append({"method": "fedecouple", "attack": "ig@textbook", "round": rnd, "client": c, "image": i,
                             "psnr": base, "prior_psnr": 12.0})
                rows.append({"method": "fedper", "attack": "ig@textbook", "round": rnd, "client": c, "image": i,
                             "psnr": base + 3 + 0.5 * c + i, "prior_psnr": 12.0})
        rows.append({"method": "fedper", "attack": "ig@textbook", "round": rnd, "client": 9, "image": 0, "psnr": 40.0,
                     "prior_psnr": 12.0})
    results = pd.DataFrame(rows)
    results = pd.concat([results[results["method"] == "fedecouple"], results[results["method"] == "fedper"][::-1]])
    by_round = pd.DataFrame([{"method": m, "attack": "ig@textbook", "round": r, "n_images": len(g),
                              "n_targets": g["client"].nunique(), "mean_psnr": g["psnr"].mean(),
                              "mean_psnr_ci_low": None, "mean_psnr_ci_high": None, "prior_psnr": 12.0,
                              "mis_specified_targets": 0,
                              # round 19: FedeCouple, the side the interval puts lower, stopped short on every client
                              "not_converged_targets": 4 if m == "fedecouple" and r == 19 else 0}
                             for (m, r), g in results.groupby(["method", "round"])])
    return results, by_round


def test_fig10_pairs_the_same_clients_images_and_judges_the_papers_claims():
    from reports.fig10 import fig10_frame, section_markdown

    results, by_round = _fig10_inputs()
    frame = fig10_frame(by_round, results, ["fedecouple", "fedper"])
    paired = frame[frame["kind"] == "paired"].set_index("round")
    assert list(paired["method"] + "-" + paired["versus"]) == ["fedper-fedecouple"] * 2
    assert list(paired["n"]) == [8, 8] and list(paired["n_targets"]) == [4, 4]  # client 9 has no pair
    assert paired.loc[0, "mean"] == pytest.approx(4.25)
    # Student's t over the 4 clients' mean differences: 4.25 ± t(0.975, 3) · 0.6455 / 2
    assert (paired.loc[0, "ci_low"], paired.loc[0, "ci_high"]) == (pytest.approx(3.2229, abs=1e-4),
                                                                   pytest.approx(5.2771, abs=1e-4))
    assert paired.loc[0, "claim"] == "FedeCouple leaks least" and paired.loc[0, "verdict"] == "holds"
    assert paired.loc[19, "verdict"].startswith("undetermined (lower bound): fedecouple, the side that leaks less, "
                                                "stopped short on 4 clients")
    # stopped short on the side the interval puts higher changes nothing: its real figure is higher still
    higher = by_round.assign(not_converged_targets=(by_round["method"] == "fedper") * 4)
    assert set(fig10_frame(higher, results, ["fedecouple", "fedper"]).query("kind == 'paired'")["verdict"]) == {"holds"}
    # FedAvg beside them: the paper says FedPer leaks more than FedAvg; here FedAvg is FedPer 2 dB up, so it does not
    fedavg = results[results["method"] == "fedper"].assign(method="fedavg", psnr=lambda f: f["psnr"] + 2.0)
    rows = by_round[by_round["method"] == "fedper"].assign(method="fedavg", not_converged_targets=0)
    frame = fig10_frame(pd.concat([by_round, rows]), pd.concat([results, fedavg]), ["fedecouple", "fedper", "fedavg"])
    versus = frame[(frame["kind"] == "paired") & (frame["round"] == 0)].set_index(["method", "versus"])
    assert versus.loc[("fedper", "fedavg"), "claim"] == "FedPer > FedAvg"
    assert versus.loc[("fedper", "fedavg"), "n"] == 9 and versus.loc[("fedper", "fedavg"), "mean"] == pytest.approx(-2)
    assert versus.loc[("fedper", "fedavg"), "verdict"] == "does not hold"
    assert versus.loc[("fedavg", "fedecouple"), "claim"] == "FedeCouple leaks least"
    # a mis-specified side, or the server lacking the model, leaves the claim undetermined
    wrong = by_round.assign(mis_specified_targets=(by_round["method"] == "fedper") * 4)
    assert fig10_frame(wrong, results, ["fedecouple", "fedper"]).query("kind == 'paired'")["verdict"].str.startswith(
        "undetermined: MIS-SPECIFIED on fedper (4/5 clients)").all()
    unknown = by_round.assign(model_unknown_targets=(by_round["method"] == "fedecouple") * 4)
    assert "undetermined: NO MODEL on fedecouple" in fig10_frame(unknown, results, ["fedecouple", "fedper"])["verdict"].iloc[-1]
    text = "\n".join(section_markdown(frame))
    assert "## Fig. 10: leakage by method" in text and "| 0 | fedper − fedavg | ig@textbook | 9 (5) | -2.00" in text
    assert "- Round 0: FedeCouple leaks least: holds (all 2 pairs)" in text
    assert "- Round 19: FedeCouple leaks least: undetermined (lower bound) (against fedper, fedavg)" in text


def test_the_report_has_the_fig10_section_and_csv(built):
    """FedPer (DLG) and FedProto (proto only): each method's own image cell, and no pair without
    FedeCouple or FedAvg."""
    out, _ = built
    fig10 = pd.read_csv(out / "fig10.csv")
    assert list(zip(fig10["method"], fig10["cell"])) == [("fedper", "dlg"), ("fedproto", "proto")]
    by_round = pd.read_csv(out / "by_round.csv")
    assert (fig10["kind"] == "method").all() and list(fig10["n"]) == list(by_round["n_images"]) == [1, 3]
    assert list(fig10["mean"]) == pytest.approx(list(by_round["mean_psnr"]))
    md = (out / "report.md").read_text(encoding="utf-8")
    assert md.index("## Fig. 10: leakage by method") < md.index("## PSNR definition")
    assert "No pair to compare" in md and "<h2>Fig. 10: leakage by method</h2>" in (out / "report.html").read_text()


def test_preset_audit_reports_fedavg_beside_the_four_methods_unless_methods_are_given():
    from fedsec.presets import report_methods

    assert report_methods("audit", "fedecouple,fedper,fedpac,fedproto", lambda name: False).split(",") == [
        "fedecouple", "fedper", "fedpac", "fedproto", "fedavg"]
    assert report_methods("audit", "fedper", lambda name: name == "methods") == "fedper"
    assert report_methods(None, "fedper,fedpac", lambda name: False) == "fedper,fedpac"


def test_fedprotos_proto_cell_is_marked_no_model_not_mis_specified(built):
    """FedProto uploads no extractor, so its proto cell is a surrogate-model estimate: the summary row
    counts its targets NO MODEL, results.csv flags them, the headline shows "NO MODEL (estimate)" (never
    MIS-SPECIFIED), and the by-round table and its figure carry the same mark."""
    from reports.comparison import by_round_rows, psnr_cell
    from reports.figures import leakage_by_round

    out, _ = built
    row = pd.read_csv(out / "summary.csv").set_index("method").loc["fedproto"]
    assert row["proto_model_unknown_targets"] == 1 and not row["proto_mis_specified"]
    proto = pd.read_csv(out / "results.csv").query("attack == 'proto'")
    assert len(proto) and proto["model_unknown"].all() and not proto["mis_specified"].any()
    cell = psnr_cell(row.to_dict(), "proto")
    assert cell.endswith(") NO MODEL (estimate)") and "MIS-SPECIFIED" not in cell
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "NO MODEL (estimate)" in md and "MIS-SPECIFIED" not in md.split("## Headline")[1].split("\n\n")[1]
    assert psnr_cell({**row.to_dict(), "proto_model_unknown_targets": 0}, "proto").endswith(")")
    by_round = [{"method": "fedproto", "attack": "proto", "round": r, "n_images": 3, "n_targets": 1, "mean_psnr": 11.0,
                 "prior_psnr": 13.0, "success_rate": 0.0, "mis_specified_targets": 0, "not_converged_targets": 0,
                 "model_unknown_targets": 1} for r in (0, 19)]
    assert by_round_rows({"by_round": by_round})[1][0][-1] == "0 / 0 / NO MODEL (estimate) 1"
    rows = proto.assign(round=19, model_unknown=False)
    both = pd.concat([proto, rows], ignore_index=True)
    assert leakage_by_round(both, 100.0) != leakage_by_round(both.assign(model_unknown=False), 100.0)
