"""The Python API: one call per job, the CLI's flags as keywords (checked by the same parameters, so
the same one-line errors), typed results; ``out=None`` writes nothing, ``progress=False`` is silent."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import fedsec
from fedecouple.errors import UserError
from helpers import run_python

TINY = dict(dataset="digits", clients=4, rounds=1, threads=1, progress=False)


@pytest.fixture
def nothing_written(tmp_path, monkeypatch):
    """Run in an empty folder and check that it stays empty (out=None keeps everything in memory)."""
    monkeypatch.chdir(tmp_path)
    yield
    assert list(Path(tmp_path).iterdir()) == []


def test_import_fedsec_is_cheap_and_exports_the_functions():
    code = "import sys, fedsec; assert 'torch' not in sys.modules; print(sorted(fedsec.__all__))"
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    for name in ("train", "attack", "audit", "report", "defend", "mia"):
        assert name in result.stdout


def test_the_job_modules_leave_the_functions_in_place():
    """Importing the library behind a job (``fedsec.jobs.report``, ...) does not replace ``fedsec.report``,
    the function: a submodule of that name would."""
    code = ("import importlib, fedsec, fedsec.api\n"
            "for name in ('attack', 'audit', 'report', 'defend', 'mia', 'compare'):\n"
            "    importlib.import_module('fedsec.jobs.' + name)\n"
            "    assert getattr(fedsec, name) is getattr(fedsec.api, name), name\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_train(nothing_written, capsys):
    result = fedsec.train(method="fedavg", **TINY)
    assert isinstance(result, fedsec.TrainResult) and result.out is None
    assert 0 <= result.mean_accuracy <= 1 and result.rounds == 1
    assert isinstance(result.rows, pd.DataFrame) and list(result.rows.columns) == ["round", "client", "accuracy",
                                                                                   "loss"]
    assert capsys.readouterr().err == ""  # progress=False: silent


def test_attack(nothing_written):
    result = fedsec.attack("dlg", method="fedavg", targets=2, iterations=5, **TINY)
    assert isinstance(result, fedsec.AttackResult) and result.out is None
    assert result.mean_psnr == result.summary["mean_psnr"] and len(result.rows) == 2
    assert result.reconstructions.shape == result.ground_truth.shape == (2, 1, 8, 8)
    assert "dlg on fedavg" in str(result)


def test_attack_writes_the_same_files_as_the_command(tmp_path):
    result = fedsec.attack("labels", method="fedavg", targets=2, out=tmp_path / "a", **TINY)
    assert result.out == tmp_path / "a" and (tmp_path / "a" / "config.toml").is_file()
    assert result.rows.equals(pd.read_csv(tmp_path / "a" / "attack.csv"))


@pytest.mark.parametrize("keywords,message", [
    (dict(targets=0), "--targets must be at least 1, got 0"),
    (dict(partition="bogus"), "'bogus' is not one of"),
    (dict(targts=3), "fedsec.attack() has no keyword targts"),
    (dict(method="fedfoo"), "unknown method"),
])
def test_bad_keywords_are_the_clis_one_line_errors(nothing_written, keywords, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fedsec.attack("dlg", **{**TINY, **keywords})


def test_audit(nothing_written):
    result = fedsec.audit(method="fedavg", evidence=False, **TINY)
    assert isinstance(result, fedsec.AuditResult) and result.findings
    assert result.upload_kib_per_client_round > 0 and {"extractor", "classifier"} <= set(result.rows["kind"])


def test_report(nothing_written):
    result = fedsec.report(methods="fedavg", attacks="labels", targets=1, **TINY)
    assert isinstance(result, fedsec.ReportResult) and result.out is None and not result.failed
    assert list(result.table["method"]) == ["fedavg"] and len(result.rows) > 0


def test_defend(nothing_written):
    result = fedsec.defend(method="fedavg", defense="clip", values="1", attacks="labels", targets=1, **TINY)
    assert isinstance(result, fedsec.DefendResult) and len(result.rows) == 2 and list(result.rows["defense"]) == ["none", "clip"]


def test_mia(nothing_written):
    result = fedsec.mia(method="fedavg", attacks="loss", reference_runs=2, bootstrap=10, **TINY)
    assert isinstance(result, fedsec.MiaResult) and "targets" in result.summary and len(result.rows) > 0
