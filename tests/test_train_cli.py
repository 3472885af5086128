"""fedsec train: outputs, determinism, resume, and one-line errors."""
import json
from types import SimpleNamespace

import pandas as pd
import pytest

from fedsec.runner import RunConfig, train
from helpers import TEST_THREADS, run_cli

FAST = dict(method="fedecouple", dataset="digits", partition="pathological", clients=3, local_epochs=1, seed=0,
            threads=TEST_THREADS)  # bit-identical floats need the same torch thread count


@pytest.fixture
def fedsec(capsys):
    """``fedsec ARGS`` run in this process (``helpers.run_cli``: anything raised but the CLI's own exit
    fails the test), as a finished process: returncode, stdout, stderr."""
    def run(*args):
        code, out, err = run_cli(list(args), capsys)
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return run


def test_outputs_and_determinism(tmp_path):
    a = train(RunConfig.of(**FAST, rounds=2), tmp_path / "a")
    train(RunConfig.of(**FAST, rounds=2), tmp_path / "b")
    for name in ("config.json", "metrics.csv", "summary.json", "partition.csv", "checkpoint.pt"):
        assert (tmp_path / "a" / name).exists()
    assert (tmp_path / "a" / "metrics.csv").read_text() == (tmp_path / "b" / "metrics.csv").read_text()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert {"method", "dataset", "rounds", "mean_accuracy", "std_accuracy"} <= set(summary)
    assert 0 <= summary["mean_accuracy"] <= 1 and summary["rounds"] == 2 and a == summary
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["config"]["seed"] == 0 and config["versions"]["torch"]
    assert config["method_hyperparameters"]["lam"] == 0.8
    metrics = pd.read_csv(tmp_path / "a" / "metrics.csv")
    assert list(metrics.columns) == ["round", "client", "accuracy", "loss"] and len(metrics) == 6


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path, fedsec):
    train(RunConfig.of(**FAST, rounds=3), tmp_path / "full")
    train(RunConfig.of(**FAST, rounds=1), tmp_path / "part")  # "interrupted" after round 1
    config = json.loads((tmp_path / "part" / "config.json").read_text())
    config["config"]["rounds"] = 3
    (tmp_path / "part" / "config.json").write_text(json.dumps(config))
    result = fedsec("train", "--resume", str(tmp_path / "part"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "full" / "metrics.csv").read_text() == (tmp_path / "part" / "metrics.csv").read_text()


@pytest.mark.parametrize("args, fragment", [
    (["--method", "fedfoo"], "unknown method"),
    (["--dataset", "imagenet"], "unknown data set"),
    (["--classes-per-client", "11"], "--classes-per-client"),
    (["--partition", "weak", "--s", "150"], "--s"),
    (["--partition", "dirichlet", "--beta", "0"], "--beta"),
    (["--clients", "0"], "--clients"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "/nonexistent/cifar"),
    (["--lr", "-1"], "--lr"),
    (["--hp", "bogus=1"], "no hyperparameter bogus"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, args, fragment, fedsec):
    out = tmp_path / "run"
    result = fedsec("train", "--dataset", "digits", *args, "--out", str(out)) if "--dataset" not in args else \
        fedsec("train", *args, "--out", str(out))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.stderr
    assert not out.exists()


def test_resume_of_missing_run_is_a_clear_error(tmp_path, fedsec):
    result = fedsec("train", "--resume", str(tmp_path / "nothing"))
    assert result.returncode == 2 and "config.json not found" in result.stderr


def test_nan_training_is_reported_not_crashed(tmp_path, fedsec):
    result = fedsec("train", "--dataset", "digits", "--clients", "2", "--rounds", "1", "--lr", "1e6",
                    "--out", str(tmp_path / "r"))
    assert result.returncode == 2 and "diverged" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(900)
def test_fedecouple_reaches_80_percent_on_mnist5k_pathological_in_3_rounds(tmp_path, fedsec):
    """FedeCouple on mnist5k, pathological split, 10 clients, 3 rounds, 1 local epoch: mean accuracy >= 0.80."""
    result = fedsec("train", "--method", "fedecouple", "--dataset", "mnist5k", "--partition", "pathological",
                    "--classes-per-client", "3", "--clients", "10", "--rounds", "3", "--local-epochs", "1",
                    "--seed", "0", "--threads", str(TEST_THREADS), "--out", str(tmp_path / "acc"))
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "acc" / "summary.json").read_text())
    assert summary["mean_accuracy"] >= 0.80


def test_runs_inside_shared_datasets_read_one_loaded_data_set():
    """``runner.shared_datasets`` (compare, report, attack): every ``prepare`` in the block gets the same
    tensors, loaded once; outside the block each ``prepare`` loads its own."""
    from fedsec import runner

    fedper = RunConfig.of(method="fedper", dataset="digits", clients=2, rounds=1)
    fedavg = fedper.updated(method="fedavg")
    with runner.shared_datasets() as cache:
        first, second = runner.prepare(fedper).dataset, runner.prepare(fedavg).dataset
        with runner.shared_datasets() as inner:  # a nested block shares the outer cache
            assert inner is cache and runner.prepare(fedper).dataset is first
    assert first is second and first is cache.load("digits")
    assert runner.prepare(fedper).dataset is not first
