"""The round-level attacks on a server under secure aggregation (``attacks.secure``): what the sum gives
away, through ``fedsec attack ... --secure-aggregation``, and the refusals on either side of the switch."""
import json

import numpy as np
import pandas as pd

from attacks.secure.disaggregation import resolved, solve
from helpers import run_cli

SECURE = ["--method", "fedavg", "--secure-aggregation", "--threads", "1"]


def test_the_round_histogram_of_ten_one_image_clients_is_exact_at_round_0(tmp_path, capsys):
    out = tmp_path / "labels"
    code, _, err = run_cli(["attack", "sum-labels", *SECURE, "--clients", "10", "--train-images", "1", "--out", out],
                           capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["histogram"]["exact_rounds"] == summary["histogram"]["rounds"] == 1
    rows = pd.read_csv(out / "attack.csv")
    assert rows["true_count"].sum() == 10 and (rows["predicted_count"] == rows["true_count"]).all()
    # by default the clients' sample counts travel in the clear, as in Flower's SecAgg+: the reading says so
    assert "sample count and training metrics" in summary["threat_model"]["server_sees"]
    assert any("sample counts travel in the clear" in note for note in summary["notes"])
    hidden = tmp_path / "hidden"
    code, _, err = run_cli(["attack", "sum-labels", *SECURE, "--clients", "10", "--train-images", "1",
                            "--sa-clear-fields", "hidden", "--out", hidden], capsys)
    assert code == 0, err[-2000:]
    kept = json.loads((hidden / "summary.json").read_text())
    assert "nothing in the clear" in kept["threat_model"]["server_sees"]
    assert not any("in the clear" in note for note in kept["notes"])
    assert pd.read_csv(hidden / "attack.csv")["predicted_count"].tolist() == rows["predicted_count"].tolist()


def test_binning_through_the_sum_writes_each_images_input_error_as_its_per_client_twin(tmp_path, capsys):
    """sum-binning's attack.csv holds one row per image of the round, each with the relative error of its
    recovered first-linear-layer input (``input_error``, as binning's per-client rows), and summary.json the
    share recovered exactly (relative error <= 1e-3): the figure bench/secure_malicious.py measures."""
    out = tmp_path / "binning"
    code, _, err = run_cli(["attack", "sum-binning", *SECURE, "--dataset", "digits", "--partition", "iid",
                            "--clients", "4", "--train-images", "5", "--victim-batch", "0", "--iterations", "2",
                            "--out", out], capsys)
    assert code == 0, err[-2000:]
    rows = pd.read_csv(out / "attack.csv")
    assert len(rows) == 20 and sorted(rows["client"].value_counts().to_dict().items()) == [(c, 5) for c in range(4)]
    assert rows["input_error"].notna().all() and (rows["input_error"] >= 0).all()
    summary = json.loads((out / "summary.json").read_text())
    exact = float((rows["input_error"] <= 1e-3).mean())
    assert summary["inputs_exact_share"] == exact > 0
    assert summary["inputs_median_error"] == float(rows["input_error"].median())


def test_disaggregation_recovers_every_clients_label_counts(tmp_path, capsys):
    out = tmp_path / "disaggregation"
    code, _, err = run_cli(["attack", "sum-disaggregation", *SECURE, "--dataset", "digits", "--clients", "6",
                            "--train-images", "2", "--join-ratio", "0.5", "--rounds", "12", "--attack-rounds", "11",
                            "--out", out], capsys)
    assert code == 0, err[-2000:]
    counts = json.loads((out / "summary.json").read_text())["client_counts"]
    assert counts["clients"] == counts["exact"] == 6 and counts["unresolved"] == 0
    rows = pd.read_csv(out / "labels.csv")
    assert set(rows["client"]) == set(range(6)) and (rows["predicted_count"] == rows["true_count"]).all()


def test_clients_that_always_take_part_together_are_left_unresolved():
    # rounds' sums {0, 1}, {0, 1}, {2}: clients 0 and 1 are never apart, so only client 2 is determined
    participation = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    ok, rank = resolved(participation)
    assert rank == 2 and ok.tolist() == [False, False, True]
    values, residual = solve(participation, np.array([[3.0], [3.0], [5.0]]))
    assert abs(values[2, 0] - 5.0) < 1e-9 and residual < 1e-12


def test_the_sum_inversion_scores_one_image_per_survivor(tmp_path, capsys):
    out = tmp_path / "inversion"
    code, _, err = run_cli(["attack", "sum-inversion", *SECURE, "--dataset", "digits", "--clients", "4",
                            "--train-images", "1", "--iterations", "2", "--out", out], capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images_scored"] == 4 and sorted(pd.read_csv(out / "attack.csv")["client"]) == [0, 1, 2, 3]
    assert (out / "labels.csv").exists() and (out / "reconstructions.png").exists()
    # the forward-model check: the true union batch explains the sum (one step on it, up to the
    # quantisation) better than two iterations' reconstruction: the figure is the optimiser's lower bound
    target = summary["per_target"][0]
    assert target["truth_data_term"] < target["data_term"]
    assert summary["not_converged_targets"] == 1 and summary["mis_specified"] is False


def test_a_round_level_attack_without_secure_aggregation_refuses(tmp_path, capsys):
    code, _, err = run_cli(["attack", "sum-labels", "--method", "fedavg", "--out", tmp_path / "x"], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "add --secure-aggregation" in errors[0], err[-2000:]
    assert not (tmp_path / "x").exists()


def test_a_per_client_attack_under_secure_aggregation_refuses(tmp_path, capsys):
    code, _, err = run_cli(["attack", "dlg", *SECURE, "--out", tmp_path / "x"], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert "holds only the sum" in errors[0] and "sum-labels" in errors[0] and "sum-disaggregation" in errors[0]
    assert not (tmp_path / "x").exists()
