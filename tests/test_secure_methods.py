"""FedeCouple and FedPAC under secure aggregation: FedeCouple's two passes give the plain eq. 16 aggregate
to within the protocol's quantisation (over the second pass's survivors when a client drops between the
passes, and the first pass's average when fewer than three are left), FedPAC's partial variant gives the
count-weighted global prototypes and keeps every head on its client, and the command line runs both and
says how."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fedecouple.channel import Recorder, ServerChannel
from fedecouple.data import make_partition
from fedecouple.engine import Federation, FederationConfig
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.base import TrainConfig
from fedecouple.methods.facets import secure_refusal
from fedecouple.secure_aggregation import SecureAggregation
from helpers import TEST_THREADS, run_cli

SMALL = ["--dataset", "digits", "--clients", "3", "--threads", str(TEST_THREADS)]
FLOAT32 = 2 ** -23


def _federation(digits, method, secure=None, clients=3, dropout=0.0, seed=0):
    part = make_partition(digits.labels.numpy(), clients, "pathological", seed=seed)
    config = FederationConfig(rounds=1, seed=seed, dropout=dropout,
                              train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    return Federation(make_method(method), digits, part, config, channel=ServerChannel(recorder=Recorder(),
                                                                                        secure=secure))


def _vectors(uploads, names):
    return torch.stack([torch.cat([u.tensors[n].double().flatten() for n in names]) for u in uploads])


def _eq16_and_bound(plain_uploads, first, later, quantum: float):
    """(eq. 16 over the second pass's survivors with the cosines to the first pass's exact average, the
    bound on how far the secure aggregate may be from it), from the clients' uploads in the clear. The
    bound: the second sum's values are each off by at most survivors · quantum; each client's weight is
    ĉ_i = its cosine to the decoded average, rounded to Flower's factor (its shift δ_i from the exact c_i is
    measured here), which moves Σĉ_iω_i/Σĉ_i by at most (Σ|δ_i|·max|ω_i| + |Σδ_i|·max|ω*|)/Σĉ_i; and a
    float32 cast."""
    uploads = {u.client_id: u for u in plain_uploads}
    names = [k for k in uploads[first.survivors[0]].tensors if k != "sample_count"]
    first_ids, second_ids = list(first.survivors), list(later.record.survivors)
    vectors = _vectors([uploads[c] for c in first_ids], names)
    counts = torch.tensor([float(uploads[c].tensors["sample_count"]) for c in first_ids], dtype=torch.float64)
    average = (counts / counts.sum()) @ vectors
    own = _vectors([uploads[c] for c in second_ids], names)
    exact_c = F.cosine_similarity(own, average.unsqueeze(0), dim=1).clamp_min(0.0)
    decoded = torch.cat([later.broadcast[n].flatten() for n in names])
    q_range = SecureAggregation().quantization_range
    sent_c = (F.cosine_similarity(own, decoded.unsqueeze(0), dim=1).clamp_min(0.0) * q_range).round() / q_range
    expected = (exact_c @ own) / exact_c.sum()
    weight = float(later.record.total["sample_count"])
    assert abs(weight - float(sent_c.sum())) < 1e-12  # the weights are summed exactly
    delta = sent_c - exact_c
    bound = (len(second_ids) * quantum + float(delta.abs().sum()) * float(own.abs().max())
             + abs(float(delta.sum())) * float(expected.abs().max())) / weight
    return expected, bound + 4 * FLOAT32 * float(expected.abs().max()), names


def _flat(server, names):
    return torch.cat([server["global." + n].double().flatten() for n in names])


def test_two_pass_fedecouple_gives_the_plain_eq16_aggregate_within_the_quantisation(digits):
    plain, secure = _federation(digits, "fedecouple"), _federation(digits, "fedecouple", SecureAggregation())
    plain.run_round()
    secure.run_round()
    recorder = secure.channel.recorder
    first, (later,) = recorder.aggregates[0], recorder.later_passes[0]
    assert later.pass_index == 1 and first.survivors == later.record.survivors == (0, 1, 2)
    expected, bound, names = _eq16_and_bound(plain.channel.recorder.uploads(), first, later, first.quantum)
    # the plain method's own aggregate is eq. 16 (in float32): both sides agree with the float64 value
    assert float((_flat(plain.server, names) - expected).abs().max()) <= 4 * FLOAT32 * float(expected.abs().max())
    error = float((_flat(secure.server, names) - expected).abs().max())
    assert error <= bound < 1e-5, (error, bound)
    # the bound can fail: the first pass's sample-weighted average alone (FedAvg's model) lies far outside it
    weight = first.total["sample_count"]
    average = torch.cat([(first.total[n] / weight).flatten() for n in names])
    assert float((average - expected).abs().max()) > 100 * bound
    assert secure.round_log == [{"round": 0, "participants": 3, "survivors": 3, "clipped": 0, "aborted": "",
                                 "second_pass": ""}]
    # the second pass is a new key agreement: its masked uploads are not the first pass's, nothing is in the clear
    masked = {u.client_id: u.tensors["masked"] for u in recorder.uploads()}
    assert all(set(u.tensors) == {"masked"} and not torch.equal(u.tensors["masked"], masked[c])
               for c, u in later.uploads.items())
    recorder.relabel({0: 10})  # a recording renamed after the run renames the second pass too
    (renamed,) = recorder.later_passes[0]
    assert renamed.record.survivors == (1, 2, 10) and set(renamed.uploads) == {1, 2, 10}
    assert renamed.uploads[10].client_id == 10


def test_a_client_that_drops_between_the_passes_is_in_the_average_but_not_in_the_second_sums(digits):
    clients, dropout, seed = 4, 0.3, 4
    secure = _federation(digits, "fedecouple", SecureAggregation(), clients=clients, dropout=dropout, seed=seed)
    everyone = list(range(clients))
    assert secure.dropouts(0, everyone) == set()  # this seed: all upload in the first pass ...
    leaving = secure.dropouts(0, everyone, pass_index=1)
    assert len(leaving) == 1  # ... and one of the four drops before the second
    plain = _federation(digits, "fedecouple", clients=clients, seed=seed)
    plain.run_round()
    secure.run_round()
    recorder = secure.channel.recorder
    first, (later,) = recorder.aggregates[0], recorder.later_passes[0]
    assert first.survivors == tuple(everyone)
    assert later.record.participants == tuple(everyone) and later.record.dropped == tuple(leaving)
    expected, bound, names = _eq16_and_bound(plain.channel.recorder.uploads(), first, later, first.quantum)
    assert float((_flat(secure.server, names) - expected).abs().max()) <= bound
    assert secure.round_log[0]["survivors"] == 3 and secure.round_log[0]["second_pass"] == ""


def test_with_fewer_than_three_left_for_the_second_pass_the_round_keeps_the_first_pass_average(digits):
    secure = _federation(digits, "fedecouple", SecureAggregation(), dropout=0.3, seed=4)
    assert secure.dropouts(0, [0, 1, 2]) == set() and len(secure.dropouts(0, [0, 1, 2], pass_index=1)) == 1
    secure.run_round()
    first = secure.channel.recorder.aggregates[0]
    assert 0 not in secure.channel.recorder.later_passes  # no second sum of two clients was ever formed
    log = secure.round_log[0]
    assert log["second_pass"].startswith("skipped: 2 of 3 stayed, fewer than 3") and log["survivors"] == 3
    weight = first.total["sample_count"]
    for name, value in first.total.items():
        if name != "sample_count":
            assert torch.equal(secure.server["global." + name], (value / weight).to(torch.float32)), name


def test_fedpac_secure_partial_gives_the_count_weighted_prototypes_and_keeps_the_heads_local(digits):
    plain, secure = _federation(digits, "fedpac"), _federation(digits, "fedpac", SecureAggregation())
    plain.run_round()
    secure.run_round()
    protocol, record = secure.channel.secure, secure.channel.recorder.aggregates[0]
    uploads = list(plain.channel.recorder.uploads())
    # the count-weighted mean of the clients' prototypes, from their uploads in the clear
    prototypes = sorted(k for k in plain.server if ".prototype." in k)
    assert prototypes and prototypes == sorted(k for k in secure.server if ".prototype." in k)
    # Flower's weight factor rounds each client's n_i / max_weight and rescales its summands by that rounding
    rounding = 1 / (2 * protocol.quantization_range * min(float(u.tensors["sample_count"]) for u in uploads)
                    / protocol.max_weight)
    survivors = len(record.survivors)
    for name in prototypes:
        k = int(name.rsplit(".", 1)[1])
        held = [(float(u.tensors["class_counts"][k]), u.tensors[f"prototype.{k}"].double()) for u in uploads
                if f"prototype.{k}" in u.tensors]
        total = sum(n for n, _ in held)
        expected = sum(n * p for n, p in held) / total
        decoded = total / protocol.max_weight
        # numerator and denominator each off by at most survivors · quantum, per-client rescaling, float32 cast
        bound = (survivors * record.quantum * (1 + expected.abs()) / (decoded - survivors * record.quantum)
                 + 2 * rounding * max(float(p.abs().max()) for _, p in held) + 4 * FLOAT32 * (1 + expected.abs()))
        assert bool(((secure.server[name].double() - expected).abs() <= bound).all()), name
    # no combined head on the server: each client is evaluated with the head it trained and kept
    assert not any(k.startswith("head.") for k in secure.server)
    assert any(k.startswith("head.") for k in plain.server)
    ctx = secure.context(0, 0)
    params = secure.method.personalized(ctx, secure.server, secure.client_state(0))
    assert all(torch.equal(params[k], v) for k, v in secure.client_state(0).items())
    # the clients' heads, h and V never left them: only masked vectors and the sample count reached the server
    assert all(set(u.tensors) == {"masked", "sample_count"} for u in secure.channel.recorder.uploads())


def test_the_command_line_trains_two_pass_fedecouple_and_the_audit_says_two_passes(tmp_path, capsys):
    code, printed, err = run_cli(["train", "--method", "fedecouple", "--secure-aggregation", *SMALL, "--rounds", "1",
                                  "--out", tmp_path / "train"], capsys)
    assert code == 0, err[-2000:]
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["round_log"]["survivors"] == 3 and summary["round_log"]["aborted_rounds"] == []
    assert 0.0 < summary["mean_accuracy"] <= 1.0
    code, printed, err = run_cli(["audit", "--method", "fedecouple", "--secure-aggregation", *SMALL, "--rounds", "1",
                                  "--no-evidence", "--out", tmp_path / "audit"], capsys)
    assert code == 0, err[-2000:]
    status = json.loads((tmp_path / "audit" / "summary.json").read_text())["secure_aggregation"]
    assert status.startswith("secure variant: two passes:") and "Σ c_i·ω_i and Σ c_i" in status
    assert status.endswith("; in the clear: sample_count")
    findings = json.loads((tmp_path / "audit" / "findings.json").read_text())
    (secure,) = [f for f in findings if f["code"] == "SECURE_AGGREGATION"]
    assert secure["evidence"]["second_passes"] == [0] and "Σ c_i·ω_i and Σ c_i" in secure["finding"]
    assert any("secure aggregation: secure variant: two passes" in line for line in printed.splitlines())


@pytest.mark.parametrize("method, words", [("fedecouple", "secure variant: two passes"),
                                           ("fedpac", "secure variant: partial (heads local, no head combination)")])
def test_the_audit_status_declares_each_variant(method, words):
    from fedsec.jobs.audit import secure_aggregation_status

    assert secure_refusal(METHODS[method]()) is None
    assert secure_aggregation_status(METHODS[method]()).startswith(words)
