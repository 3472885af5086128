"""The resumable-stage helper (``fedsec.resumable``) behind report, defend, mia and compare: a stage
is complete only with its marker and its files, resumes after an interruption, is copied from an
earlier run, and reads the folders earlier versions wrote."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedsec import io
from fedsec.resumable import ResumableStage, TrainRun, marked_folders
from fedsec.runner import RunConfig

IDENTITY = {"stage": "attack", "config": {"method": "fedper", "seed": 0}}


def stage(path, identity=IDENTITY) -> ResumableStage:
    return ResumableStage(path, identity, required=("summary.json", "attack.csv"))


def test_a_stage_with_a_missing_required_file_is_not_complete(tmp_path):
    st = stage(tmp_path / "s")
    st.path.mkdir()
    (st.path / "attack.csv").write_text("psnr\n1.0\n")
    assert not st.complete()
    st.finish({"status": "done"})  # the marker alone does not make it complete
    assert not st.complete() and not st.holds_other()
    (st.path / "summary.json").write_text("{}")
    assert st.complete()
    assert json.loads((st.path / "done.json").read_text())["identity"] == IDENTITY


def test_a_stage_that_does_not_apply_needs_no_files(tmp_path):
    st = stage(tmp_path / "s")
    st.path.mkdir()
    st.finish({"status": "not_applicable", "reason": "no prototypes"})
    assert st.complete()


def test_another_identity_is_another_stage_never_complete(tmp_path):
    st = stage(tmp_path / "s")
    st.path.mkdir()
    st.finish({"status": "not_applicable"})
    other = stage(st.path, {**IDENTITY, "config": {"method": "fedper", "seed": 1}})
    assert other.holds_other() and not other.complete()


def test_resume_after_an_interruption_runs_only_what_was_not_finished(tmp_path):
    """A job of three stages interrupted in the second (files half written, no marker): the rerun
    runs the second and third only; the first keeps its marker untouched."""
    ran: list[str] = []

    def run(names: list[str], crash_in: str | None = None) -> None:
        for name in names:
            st = stage(tmp_path / name, {"stage": name})
            if st.complete():
                continue
            ran.append(name)
            st.path.mkdir(exist_ok=True)
            (st.path / "attack.csv").write_text("psnr\n")
            if name == crash_in:
                raise KeyboardInterrupt
            (st.path / "summary.json").write_text("{}")
            st.finish({"status": "done"})

    with pytest.raises(KeyboardInterrupt):
        run(["a", "b", "c"], crash_in="b")
    stamp = (tmp_path / "a" / "done.json").stat().st_mtime_ns
    assert ran == ["a", "b"] and not stage(tmp_path / "b", {"stage": "b"}).complete()
    ran.clear()
    run(["a", "b", "c"])
    assert ran == ["b", "c"] and (tmp_path / "a" / "done.json").stat().st_mtime_ns == stamp


def test_copy_from_an_earlier_run(tmp_path):
    earlier = stage(tmp_path / "earlier" / "fedper" / "attack-dlg")
    earlier.path.mkdir(parents=True)
    for name, text in (("attack.csv", "psnr\n3.5\n"), ("summary.json", "{}"), ("half.tmp", "x")):
        (earlier.path / name).write_text(text)
    earlier.finish({"status": "done", "seconds": 1.5})
    marked, _ = marked_folders([tmp_path / "earlier"])
    assert marked == [earlier.path]

    now = stage(tmp_path / "now" / "fedper" / "attack-dlg")
    now.path.parent.mkdir(parents=True)
    assert now.find_complete([now.path, earlier.path]) == earlier.path
    assert stage(now.path, {"other": 1}).find_complete([earlier.path]) is None
    now.copy_from(earlier.path, {"status": "done", "seconds": None}, reused_from=str(earlier.path))
    assert now.complete() and (now.path / "attack.csv").read_text() == "psnr\n3.5\n"
    record = now.record()
    assert record["seconds"] == 1.5 and record["reused_from"] == str(earlier.path)
    assert not (now.path / "half.tmp").exists() and not now.partial_copy().exists()


def test_an_interrupted_copy_leaves_the_stage_incomplete_and_is_cleared(tmp_path):
    st = stage(tmp_path / "s")
    st.partial_copy().mkdir(parents=True)
    (st.partial_copy() / "attack.csv").write_text("psnr\n")
    assert not st.complete()
    st.clear_partial_copy()
    assert not st.partial_copy().exists()


def test_folders_written_by_earlier_versions_still_resume(tmp_path):
    """defend's done.json ({"key", "row"}) and a mia run's ({"fingerprint", ...} beside signals.pt)."""
    from fedsec.jobs.defend import _stored_row, value_stage
    from fedsec.mia_runs import RunSpec, done_record

    key = {"config": {"method": "fedper"}, "settings": {"defense": "clip"}}
    (tmp_path / "value-1.0").mkdir()
    io.write_json(tmp_path / "value-1.0" / "done.json", {"key": key, "row": {"value": 1.0, "epsilon": "inf",
                                                                               "accuracy": None}})
    row = _stored_row(value_stage(tmp_path / "value-1.0", key))
    assert row["value"] == 1.0 and row["epsilon"] == math.inf and math.isnan(row["accuracy"])

    config = RunConfig.of(method="fedper", dataset="digits", clients=2, rounds=1)
    spec = RunSpec("target", config, None, 0, np.arange(3), np.zeros(3, int), np.ones(3, bool),
                   str(tmp_path / "target"))
    (tmp_path / "target").mkdir()
    io.write_json(tmp_path / "target" / "done.json", {"name": "target", "fingerprint": spec.fingerprint(), "rounds": 1})
    assert done_record(spec) is None  # signals.pt missing: not complete
    (tmp_path / "target" / "signals.pt").write_bytes(b"")
    assert done_record(spec)["rounds"] == 1


def test_a_train_run_folder_is_new_partial_done_or_other(tmp_path):
    config = RunConfig.of(method="fedper", dataset="digits", clients=2, rounds=3)
    run = TrainRun(tmp_path / "run", config)
    assert run.status() == "new"
    run.path.mkdir()
    io.write_json(run.path / "config.json", {"config": config.updated(threads=4).to_dict()})  # threads: result-neutral
    assert run.status() == "new"
    (run.path / "checkpoint.pt").write_bytes(b"")
    assert run.status() == "partial"
    io.write_json(run.path / "summary.json", {"rounds": 2})  # interrupted after round 2 of 3
    assert run.status() == "partial"
    io.write_json(run.path / "summary.json", {"rounds": 3})
    assert run.status() == "done"
    assert TrainRun(run.path, config.updated(seed=1)).status() == "other"
