"""Secure aggregation: the protocol decodes the round's sum to within its quantisation, a masked upload
is indistinguishable from uniform noise, dropouts and aborts behave as the protocol says, the methods
that run on a sum give the plain method's model, the others refuse, and the commands say what the server
held (and never hide clipping or an aborted round)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import chisquare

from fedecouple.channel import Recorder, ServerChannel
from fedecouple.data import make_partition
from fedecouple.engine import Federation, FederationConfig
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.base import TrainConfig
from fedecouple.secure_aggregation import SecureAggregation, neighbours, quantize, secure_round
from helpers import TEST_THREADS, run_cli

SMALL = ["--dataset", "digits", "--clients", "3", "--threads", str(TEST_THREADS)]
SA_KEYS = ("secure_aggregation", "sa_clipping_range", "sa_quantization_range", "sa_modulus", "sa_neighbours",
           "sa_threshold", "sa_max_weight", "dropout")


def _summands(clients, seed=0, size=300, scale=3.0):
    """Per client: two named float64 tensors of values in [-scale, scale] (seeded)."""
    rng = np.random.default_rng(seed)
    return {c: {"a": torch.from_numpy(rng.uniform(-scale, scale, size)),
                "b": torch.from_numpy(rng.uniform(-scale, scale, (4, 5)))} for c in clients}


def _true_sum(summands, clients):
    return {name: sum(summands[c][name] for c in clients) for name in summands[clients[0]]}


def _max_error(record, truth) -> float:
    return max(float((record.total[name] - truth[name]).abs().max()) for name in truth)


# -- the protocol ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [None, 2])
def test_the_sum_decodes_within_survivors_times_quantum(k):
    protocol = SecureAggregation(neighbours=k, seed=3)
    clients = list(range(7))
    if k is not None:  # SecAgg+: a sparse graph, so the unmasking of absent pairs is really exercised
        assert all(len(others) < len(clients) - 1 for others in neighbours(protocol, 0, clients).values())
    summands = _summands(clients)
    record, masked = secure_round(protocol, 0, clients, summands)
    assert record.aborted is None and record.survivors == tuple(clients) and record.dropped == ()
    assert _max_error(record, _true_sum(summands, clients)) <= len(clients) * protocol.quantum
    assert set(masked) == set(clients) and all(v.dtype == np.uint64 for v in masked.values())


def test_a_masked_upload_is_uniform_over_the_modulus_and_uncorrelated_with_the_upload():
    protocol = SecureAggregation(seed=11)
    n = 20_000
    ramp = {"a": torch.linspace(-7.0, 7.0, n, dtype=torch.float64)}  # as structured as an upload can be
    summands = {0: ramp, 1: {"a": -ramp["a"]}, 2: {"a": torch.zeros(n, dtype=torch.float64)}}
    _, masked = secure_round(protocol, 0, [0, 1, 2], summands)
    sent = masked[0]
    bins = np.bincount((sent >> np.uint64(26)).astype(np.int64), minlength=64)  # 64 equal bins of 2**26
    assert len(bins) == 64 and chisquare(bins).pvalue > 1e-3
    quantised, _ = quantize(protocol, ramp["a"].numpy(), 0, 0)
    r = np.corrcoef(sent.astype(np.float64), quantised.astype(np.float64))[0, 1]
    assert abs(r) < 4 / np.sqrt(n)
    # the same test rejects the unmasked upload: it can fail
    plain = np.bincount((quantised >> np.uint64(26)).astype(np.int64), minlength=64)
    assert chisquare(plain).pvalue < 1e-3


@pytest.mark.parametrize("k", [None, 2])
def test_a_round_with_dropouts_decodes_the_survivors_sum(k):
    protocol = SecureAggregation(neighbours=k, seed=5)
    participants, survivors = list(range(6)), [0, 2, 3, 5]
    summands = _summands(participants, seed=1)
    record, masked = secure_round(protocol, 4, participants, {c: summands[c] for c in survivors})
    assert record.aborted is None and record.survivors == tuple(survivors) and record.dropped == (1, 4)
    assert set(masked) == set(survivors)
    assert _max_error(record, _true_sum(summands, survivors)) <= len(survivors) * protocol.quantum


def test_below_the_reconstruction_threshold_the_round_is_aborted():
    protocol = SecureAggregation(reconstruction_threshold=0.5)
    summands = _summands(range(6))
    record, masked = secure_round(protocol, 0, list(range(6)), {c: summands[c] for c in (0, 1)})
    assert record.total == {} and "2 of 6" in record.aborted and "threshold of 3" in record.aborted
    assert set(masked) == {0, 1}  # what was sent is sent; the server cannot unmask it


def test_values_beyond_the_clipping_range_are_counted_and_decode_clipped():
    protocol = SecureAggregation(clipping_range=1.0)
    summands = {0: {"a": torch.tensor([2.0, -3.0, 0.5, 1.0], dtype=torch.float64)},
                1: {"a": torch.tensor([0.25, 1.5, -1.25, -0.5], dtype=torch.float64)}}
    record, _ = secure_round(protocol, 0, [0, 1], summands)
    assert record.clipped == 4  # 2.0, -3.0, 1.5, -1.25; exactly 1.0 is inside
    clipped_sum = torch.tensor([1.25, 0.0, -0.5, 0.5], dtype=torch.float64)
    assert float((record.total["a"] - clipped_sum).abs().max()) <= 2 * protocol.quantum


# -- the engine -----------------------------------------------------------------------------------------------


def _federation(digits, method, secure=None, dropout=0.0, clients=3):
    part = make_partition(digits.labels.numpy(), clients, "pathological", seed=0)
    config = FederationConfig(rounds=1, seed=0, dropout=dropout, train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    return Federation(make_method(method), digits, part, config, channel=ServerChannel(recorder=Recorder(), secure=secure))


def test_fedavg_under_secure_aggregation_gives_the_plain_global_model(digits):
    plain, secure = _federation(digits, "fedavg"), _federation(digits, "fedavg", SecureAggregation())
    plain.run_round()
    secure.run_round()
    record = secure.channel.recorder.aggregates[0]
    n, weight = len(record.survivors), float(record.total["sample_count"])
    assert n == 3 and record.aborted is None and set(plain.server) == set(secure.server)
    for name, a in plain.server.items():
        a, b = a.double(), secure.server[name].double()
        # the ratio of two sums each off by at most n * quantum, then a float32 cast of either side
        bound = n * record.quantum * (1 + a.abs()) / (weight - n * record.quantum) + 4 * 2 ** -23 * (1 + a.abs())
        assert bool(((a - b).abs() <= bound).all()), name
    assert all(set(u.tensors) == {"masked"} for u in secure.channel.recorder.uploads())


def test_fedproto_under_secure_aggregation_gives_the_plain_global_prototypes(digits):
    plain, secure = _federation(digits, "fedproto"), _federation(digits, "fedproto", SecureAggregation())
    plain.run_round()
    secure.run_round()
    protocol, record = secure.channel.secure, secure.channel.recorder.aggregates[0]
    assert set(plain.server) == set(secure.server) and len(plain.server) > 0
    for name, a in plain.server.items():
        k = name.rsplit(".", 1)[1]
        count = round(float(record.total[f"class_count.{k}"]) * protocol.max_weight)
        a, b = a.double(), secure.server[name].double()
        bound = len(record.survivors) * record.quantum * protocol.max_weight / count + 4 * 2 ** -23 * (1 + a.abs())
        assert bool(((a - b).abs() <= bound).all()), name


def test_an_aborted_round_leaves_the_server_state_unchanged(digits):
    fed = _federation(digits, "fedavg", SecureAggregation(reconstruction_threshold=1.0), dropout=0.5)
    dropped = fed.dropouts(0, [0, 1, 2])
    assert 0 < len(dropped) < 3  # this seed drops some clients in round 0: the test is about that case
    before = {k: v.clone() for k, v in fed.server.items()}
    fed.run_round()
    assert fed.round_log[0]["aborted"] and fed.round_log[0]["survivors"] == 3 - len(dropped)
    assert fed.channel.recorder.aggregates[0].total == {}
    assert all(torch.equal(before[k], fed.server[k]) for k in before)


# -- the commands ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, fields", [("fedecouple", "extractor.*, classifier.*, sample_count"),
                                            ("fedpac", "h, V, classifier.*")])
def test_methods_whose_server_reads_each_upload_refuse(tmp_path, capsys, method, fields):
    code, _, err = run_cli(["train", "--method", method, "--secure-aggregation", *SMALL, "--out", tmp_path / "r"],
                           capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert method in errors[0] and fields in errors[0] and "--secure-aggregation" in errors[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("option", [["--sa-modulus", "4294967291"], ["--sa-clipping-range", "8"]],
                         ids=["another-value", "the-default-value"])
def test_a_protocol_option_without_secure_aggregation_is_refused(tmp_path, capsys, option):
    """Named at all, even at its default value: the user believes the protocol is on."""
    code, _, err = run_cli(["train", "--method", "fedavg", *option, *SMALL, "--out", tmp_path / "r"], capsys)
    assert code == 2 and err.startswith("error:") and "add --secure-aggregation" in err and "Traceback" not in err
    assert option[0] in err
    assert not (tmp_path / "r").exists()


def test_train_says_what_the_server_held_and_warns_of_clipping_and_aborts(tmp_path, capsys):
    out = tmp_path / "sa"
    # weights n / 40 exceed the clipping range 8 (about 480 images a client), and every dropout aborts
    args = ["train", "--method", "fedavg", *SMALL, "--rounds", "2", "--secure-aggregation", "--sa-max-weight", "40",
            "--sa-threshold", "1", "--dropout", "0.4", "--out", out]
    code, printed, err = run_cli(args, capsys)
    assert code == 0, err[-2000:]
    rounds = pd.read_csv(out / "rounds.csv")
    assert list(rounds.columns) == ["round", "participants", "survivors", "dropped", "clipped", "aborted"]
    assert list(rounds["round"]) == [0, 1] and (rounds["participants"] == 3).all()
    assert (rounds["dropped"] == rounds["participants"] - rounds["survivors"]).all()
    summary = json.loads((out / "summary.json").read_text())
    held = summary["secure_aggregation"]
    assert held["protocol"] == {"clipping_range": 8.0, "quantization_range": 2 ** 22, "modulus": 2 ** 32,
                                "neighbours": None, "reconstruction_threshold": 1.0, "max_weight": 40.0,
                                "quantum": 16 / 2 ** 22}
    log = summary["round_log"]
    assert log["clipped"] == int(rounds["clipped"].sum()) > 0 and log["dropped"] == int(rounds["dropped"].sum())
    assert log["aborted_rounds"] == [int(r) for r in rounds.loc[rounds["aborted"].notna(), "round"]]
    assert json.loads((out / "config.json").read_text())["config"]["sa_max_weight"] == 40.0
    assert "secure-aggregation = true" in (out / "config.toml").read_text()
    lines = printed.splitlines()
    assert any("the server held only each round's sum" in line for line in lines)
    assert any(line.startswith("warning:") and f"{log['clipped']} summed values" in line for line in lines)
    assert log["aborted_rounds"], "this seed drops a client in some round: the abort warning is under test"
    assert any(line.startswith("warning:") and "aborted" in line for line in lines)
    code, again, _ = run_cli(args, capsys)  # read back: the same lines
    assert code == 0 and "read back" in again and again.splitlines()[1:] == lines[1:]


def test_in_memory_training_under_secure_aggregation_writes_nothing(tmp_path, monkeypatch):
    import fedsec

    monkeypatch.chdir(tmp_path)
    r = fedsec.train(method="fedproto", dataset="digits", clients=3, rounds=1, threads=TEST_THREADS,
                     secure_aggregation=True, sa_neighbours=1, progress=False)
    assert r.out is None and not any(tmp_path.iterdir())
    assert r.secure_aggregation["protocol"]["neighbours"] == 1 and r.round_log["survivors"] == 3
    assert any("held only each round's sum" in line for line in r.lines)


def test_a_plain_run_keeps_its_identity_and_a_folder_written_before_the_options_resumes(tmp_path, capsys):
    from fedsec.api import command_of, federation, identity
    from fedsec.runner import RunConfig

    args = ["train", "--method", "fedavg", *SMALL, "--rounds", "1"]
    ctx = command_of("train").make_context("fedsec train", args[1:])
    config, resolved = federation(ctx, ctx.params)
    assert not set(SA_KEYS) & set(identity(resolved)) and not set(SA_KEYS) & set(config.result_key())
    out = tmp_path / "plain"
    args += ["--out", out]
    assert run_cli(args, capsys)[0] == 0
    assert not (out / "rounds.csv").exists() and "round_log" not in json.loads((out / "summary.json").read_text())
    assert not any(word in (out / "config.toml").read_text() for word in ("secure", "sa-", "dropout"))
    record = json.loads((out / "config.json").read_text())
    for key in SA_KEYS:  # as a folder written before these options existed
        del record["config"][key]
    (out / "config.json").write_text(json.dumps(record))
    assert RunConfig.from_dict(record["config"]).result_key() == config.result_key()
    code, printed, _ = run_cli(args, capsys)
    assert code == 0 and "read back" in printed
    record["config"]["rounds"] = 2
    (out / "config.json").write_text(json.dumps(record))
    code, printed, err = run_cli(["train", "--resume", out], capsys)
    assert code == 0, err[-2000:]
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2


# -- the audit's column ---------------------------------------------------------------------------------------


def test_the_audit_declares_how_each_method_meets_secure_aggregation():
    from fedsec.audit import secure_aggregation_status

    status = {name: secure_aggregation_status(cls()) for name, cls in METHODS.items()}
    assert status["fedavg"] == status["ft-fedavg"] == status["fedper"] == status["fedrep"] == "runs on the sum"
    assert status["fedproto"] == "secure variant: " + METHODS["fedproto"].secure_variant_note
    assert status["fedecouple"] == "refuses: extractor.*, classifier.*, sample_count"
    assert status["fedpac"] == "refuses: h, V, classifier.*"
    assert status["local"] == "sends nothing"


def test_the_report_shows_the_column_when_the_audit_recorded_it():
    from reports.comparison import headline_rows

    meta = {"image_attacks": [], "label_attacks": []}
    rows = pd.DataFrame([{"method": "fedavg", "secure_aggregation": "runs on the sum"},
                         {"method": "fedpac", "secure_aggregation": "refuses: h, V, classifier.*"}])
    header, cells = headline_rows(rows, meta)
    assert header[-1] == "secure aggregation" and [c[-1] for c in cells] == ["runs on the sum",
                                                                             "refuses: h, V, classifier.*"]
    assert "secure aggregation" not in headline_rows(rows.drop(columns="secure_aggregation"), meta)[0]


def test_an_audit_under_secure_aggregation_sees_masked_vectors_not_fields(tmp_path, capsys):
    out = tmp_path / "audit"
    code, printed, err = run_cli(["audit", "--method", "fedavg", *SMALL, "--rounds", "1", "--secure-aggregation",
                                  "--no-evidence", "--out", out], capsys)
    assert code == 0, err[-2000:]
    rows = pd.read_csv(out / "audit.csv")
    assert set(rows["field"]) == {"masked"} and set(rows["kind"]) == {"masked"} and len(rows) == 3
    codes = [f["code"] for f in json.loads((out / "findings.json").read_text())]
    assert "SECURE_AGGREGATION" in codes and "UNDECLARED_FIELDS" not in codes and "MODEL_DISCLOSED" not in codes
    assert json.loads((out / "summary.json").read_text())["secure_aggregation"] == "runs on the sum"
    assert "  secure aggregation: runs on the sum" in printed.splitlines()
    assert "* secure aggregation: runs on the sum" in (out / "audit.md").read_text()


def test_the_audit_under_secure_aggregation_measures_what_the_sum_gives_away(tmp_path):
    """FedProto's clients sum their class counts: the audit's evidence reads every round's histogram
    exactly, and no per-class key of a masked upload is taken for a disclosed class."""
    from fedsec.audit import run_audit
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedproto", dataset="digits", clients=3, rounds=2, threads=TEST_THREADS,
                          secure_aggregation=True)
    result = run_audit(config, tmp_path / "audit", progress=False)
    codes = {f["code"]: f for f in result["findings"]}
    assert "CLASS_PRESENCE_DISCLOSED" not in codes and "SECURE_AGGREGATION" in codes
    labels = result["summary"]["evidence"]["labels"]
    assert codes["ROUND_LABELS_FROM_SUM"]["severity"] == "medium"
    assert (labels["rounds"], labels["exact_rounds"], labels["mean_count_error"]) == (2, 2, 0.0)
    written = json.loads((tmp_path / "audit" / "summary.json").read_text())
    assert written["evidence"]["labels"]["exact_rounds"] == 2
