"""Secure aggregation: the protocol decodes the round's sum to within its quantisation, a masked upload
is indistinguishable from uniform noise, each round is aborted or decoded exactly where Flower's own
SecAggPlusWorkflow halts or unmasks it, a client's weight travels as Flower's exact factor, the fields
Flower leaves in the clear reach the server (unless hidden), the methods that run on a sum give the
plain method's model, a method whose server reads each upload refuses, and the commands say what the server held (and never hide
clipping, an aborted round or a field in the clear)."""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import chisquare

from fedecouple.channel import Recorder, ServerChannel
from fedecouple.data import make_partition
from fedecouple.engine import Federation, FederationConfig
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.averaging import weighted_summands
from fedecouple.methods.base import TrainConfig
from fedecouple.secure_aggregation import (CLEAR_FIELDS, SecureAggregation, halted, neighbourhoods, neighbours,
                                           quantize, ring_order, secure_round, weight_factor)
from helpers import TEST_THREADS, run_cli

SMALL = ["--dataset", "digits", "--clients", "3", "--threads", str(TEST_THREADS)]
SA_KEYS = ("secure_aggregation", "sa_clipping_range", "sa_quantization_range", "sa_modulus", "sa_num_shares",
           "sa_threshold", "sa_max_weight", "sa_clear_fields", "dropout")


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


@pytest.mark.parametrize("shares", [1.0, 3])
def test_the_sum_decodes_within_survivors_times_quantum(shares):
    protocol = SecureAggregation(num_shares=shares, seed=3)
    clients = list(range(7))
    if shares == 3:  # SecAgg+: a sparse graph, so the unmasking of absent pairs is really exercised
        assert all(len(others) == 2 for others in neighbours(protocol, 0, clients).values())
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


@pytest.mark.parametrize("shares", [1.0, 3])
def test_a_round_with_dropouts_decodes_the_survivors_sum(shares):
    protocol = SecureAggregation(num_shares=shares, seed=5)
    participants = list(range(6))
    # two dropouts that leave every neighbourhood its threshold (under SecAgg+: no neighbourhood holds both)
    dropped = next(pair for pair in itertools.combinations(participants, 2)
                   if halted(protocol, 4, participants, set(participants) - set(pair)) is None)
    survivors = [c for c in participants if c not in dropped]
    summands = _summands(participants, seed=1)
    record, masked = secure_round(protocol, 4, participants, {c: summands[c] for c in survivors})
    assert record.aborted is None and record.survivors == tuple(survivors) and record.dropped == dropped
    assert set(masked) == set(survivors)
    assert _max_error(record, _true_sum(summands, survivors)) <= len(survivors) * protocol.quantum


def test_values_beyond_the_clipping_range_are_counted_and_decode_clipped():
    protocol = SecureAggregation(clipping_range=1.0)
    summands = {0: {"a": torch.tensor([2.0, -3.0, 0.5, 1.0], dtype=torch.float64)},
                1: {"a": torch.tensor([0.25, 1.5, -1.25, -0.5], dtype=torch.float64)}}
    record, _ = secure_round(protocol, 0, [0, 1], summands)
    assert record.clipped == 4  # 2.0, -3.0, 1.5, -1.25; exactly 1.0 is inside
    clipped_sum = torch.tensor([1.25, 0.0, -0.5, 0.5], dtype=torch.float64)
    assert float((record.total["a"] - clipped_sum).abs().max()) <= 2 * protocol.quantum


# -- the abort rule, against Flower's own SecAggPlusWorkflow -----------------------------------------------------
#
# Flower's decision is computed by Flower's code (flwr/server/workflow/secure_aggregation/secaggplus_workflow.py,
# Flower 1.42): ``SecAggPlusWorkflow.setup_stage`` derives num_shares and the threshold and builds the
# neighbourhoods on a stand-in grid and context (every node answers), its shuffle replaced by the engine's ring
# (``ring_order``: the server's draw, seeded); then ``SecAggPlusWorkflow._check_threshold``, run after the masked
# vectors are collected, decides with the survivors as the active nodes. ``unmask_stage`` then needs t shares of
# every node's secret, one from each surviving neighbour: the same count, so the same decision.

ROUND = 4


class _Grid:
    """Flower's ``Grid`` as the setup stage uses it: every node answers with its public keys; the configs
    sent are kept."""

    def __init__(self):
        self.sent = []

    def send_and_receive(self, messages, timeout=None):
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

        self.sent += [dict(m.content.config_records[RECORD_KEY_CONFIGS]) for m in messages]
        return [SimpleNamespace(has_error=lambda: False, metadata=SimpleNamespace(src_node_id=m.metadata.dst_node_id),
                                content=SimpleNamespace(config_records={RECORD_KEY_CONFIGS: {
                                    Key.PUBLIC_KEY_1: b"pk1-%d" % m.metadata.dst_node_id,
                                    Key.PUBLIC_KEY_2: b"pk2-%d" % m.metadata.dst_node_id}})) for m in messages]


@pytest.fixture
def flower_setup(monkeypatch):
    """``flower_setup(protocol, participants) -> (workflow, state, grid)``: Flower's setup stage run for
    the round ``ROUND``, with the engine's ring."""
    pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict
    from flwr.common import FitIns, ndarrays_to_parameters
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey
    from flwr.server.workflow.secure_aggregation import secaggplus_workflow as flower
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):  # what a ServerApp's run sets
        monkeypatch.setattr(TaskIdentity, name, value)

    def run(protocol, participants):
        ring = ring_order(protocol, ROUND, participants)
        monkeypatch.setattr(flower.random, "shuffle", lambda ids: ids.__setitem__(slice(None), ring))
        context = SimpleNamespace(
            state=RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: ROUND + 1}),
                              MAIN_PARAMS_RECORD: ArrayRecord()}),
            strategy=SimpleNamespace(configure_fit=lambda rnd, parameters, manager: [
                (SimpleNamespace(node_id=n), FitIns(ndarrays_to_parameters([]), {})) for n in participants]),
            client_manager=SimpleNamespace(num_available=lambda: len(participants)))
        workflow = flower.SecAggPlusWorkflow(num_shares=protocol.num_shares,
                                             reconstruction_threshold=protocol.reconstruction_threshold)
        state, grid = flower.WorkflowState(), _Grid()
        state.setup_passed = workflow.setup_stage(grid, context, state)
        return workflow, state, grid
    return run


def flower_unmasks(workflow, state, survivors) -> bool:
    """Flower's decision once the masked vectors of ``survivors`` arrived (``_check_threshold``)."""
    if not state.setup_passed:
        return False
    state.active_node_ids = set(survivors)
    return workflow._check_threshold(state)


def _decides_as_flower(protocol, participants, survivors, flower_setup) -> bool:
    """The engine's decision on a round of ``participants`` in which ``survivors`` sent their masked
    vectors, after checking it against Flower's; returns whether the round decoded."""
    workflow, state, _ = flower_setup(protocol, participants)
    assert (state.num_shares, state.threshold) == protocol.shares(len(participants))
    assert state.nid_to_neighbours == neighbourhoods(protocol, ROUND, participants)
    summands = _summands(participants, size=8)
    record, _ = secure_round(protocol, ROUND, participants, {c: summands[c] for c in survivors})
    assert (record.aborted is None) == flower_unmasks(workflow, state, survivors), (record.aborted, survivors)
    assert (record.aborted is None) == (halted(protocol, ROUND, participants, survivors) is None)
    return record.aborted is None


def test_five_clients_with_every_pair_need_two_survivors_as_flower_rounds(flower_setup):
    """n = 5, every pair: Flower's threshold is round(0.5 · 5) = 2 (Python rounds halves to even), not
    ⌈0.5 · 5⌉ = 3: two survivors of five decode, one does not."""
    protocol = SecureAggregation(num_shares=1.0, reconstruction_threshold=0.5, seed=2)
    _, state, _ = flower_setup(protocol, list(range(5)))
    assert (state.num_shares, state.threshold) == (5, 2) == protocol.shares(5)
    assert _decides_as_flower(protocol, list(range(5)), [1, 3], flower_setup)
    assert not _decides_as_flower(protocol, list(range(5)), [3], flower_setup)


def test_clustered_dropouts_abort_where_flower_halts_and_spread_ones_decode(flower_setup):
    """SecAgg+ on 12 clients, 5 share-holders a neighbourhood (num_shares 0.4 of 12, made odd), threshold
    round(0.6 · 5) = 3. Three dropouts inside one neighbourhood abort the round though 9 of 12 survive
    (at least ⌈0.6 · 12⌉ = 8 of the participants: the rule this replaces would decode it); at threshold
    0.5 (2 of 5) five well-spread survivors of 12 decode (fewer than ⌈0.5 · 12⌉ = 6)."""
    participants = list(range(12))
    protocol = SecureAggregation(num_shares=0.4, reconstruction_threshold=0.6, seed=1)
    assert protocol.shares(12) == (5, 3)
    hood = sorted(neighbourhoods(protocol, ROUND, participants)[7])
    cluster = [7] + [c for c in hood if c != 7][:2]
    assert not _decides_as_flower(protocol, participants, [c for c in participants if c not in cluster], flower_setup)
    spread = [c for c in participants if c not in (ring_order(protocol, ROUND, participants)[k] for k in (0, 4, 8))]
    assert _decides_as_flower(protocol, participants, spread, flower_setup)  # 3 of every neighbourhood's 5 left

    sparse = SecureAggregation(num_shares=5, reconstruction_threshold=0.5, seed=1)
    ring = ring_order(sparse, ROUND, participants)
    few = [ring[k] for k in (0, 2, 5, 7, 10)]  # every window of 5 on the ring holds 2 of them
    assert _decides_as_flower(sparse, participants, few, flower_setup)


@pytest.mark.parametrize("shares, threshold", [(1.0, 0.5), (0.4, 0.6), (5, 2), (3, 0.5), (1.0, 4)])
def test_every_survivor_set_is_decided_as_flower_decides(flower_setup, shares, threshold):
    """Forty seeded survivor sets of a 10-client round, of every size from 1 to 10, per setting: the
    engine aborts exactly where Flower's workflow halts."""
    participants = list(range(10))
    protocol = SecureAggregation(num_shares=shares, reconstruction_threshold=threshold, seed=7)
    workflow, state, _ = flower_setup(protocol, participants)
    assert (state.num_shares, state.threshold) == protocol.shares(10)
    assert state.nid_to_neighbours == neighbourhoods(protocol, ROUND, participants)
    rng = np.random.default_rng(0)
    decided = []
    for k in range(40):
        survivors = sorted(rng.choice(participants, size=1 + k % 10, replace=False).tolist())
        engine = halted(protocol, ROUND, participants, survivors) is None
        assert engine == flower_unmasks(workflow, state, survivors), survivors
        decided.append(engine)
    assert any(decided) and not all(decided)  # both outcomes occur: the comparison can fail


def test_the_recorded_setup_of_a_flower_run_gives_the_same_rule(flower_setup):
    """``fedsec.flower.secagg.protocol_of`` reads the setup stage's config into the engine's settings:
    the same share count, threshold and neighbourhoods as the workflow used."""
    from fedsec.flower.secagg import protocol_of

    participants = list(range(10))
    for protocol in (SecureAggregation(num_shares=0.4, reconstruction_threshold=0.6),
                     SecureAggregation(num_shares=4, reconstruction_threshold=2), SecureAggregation()):
        _, state, grid = flower_setup(protocol, participants)
        recorded = protocol_of(grid.sent[0])
        assert recorded.shares(10) == (state.num_shares, state.threshold)
        assert neighbourhoods(recorded, ROUND, participants) == state.nid_to_neighbours


def test_a_threshold_beyond_the_neighbourhood_halts_at_setup(flower_setup):
    protocol = SecureAggregation(num_shares=1.0, reconstruction_threshold=4)
    _, state, _ = flower_setup(protocol, [0, 1, 2])
    assert state.setup_passed is False
    reason = halted(protocol, ROUND, [0, 1, 2], [0, 1, 2])
    assert "3 share-holders" in reason and "threshold of 4" in reason
    assert "at least 2" in halted(protocol, ROUND, [5], [5])  # Flower needs two participants


# -- Flower's weight encoding ---------------------------------------------------------------------------------


def test_a_weight_travels_as_flowers_exact_factor_and_the_weighted_sum_decodes_within_the_bound():
    """secaggplus_mod sends round(n / W · Q) unclipped at the head of the vector and weights the
    parameters by that rounded weight: the decoded weight is Σ factor / Q exactly, and each decoded
    weighted value lies within the quantisation bound of Σ nᵢ·xᵢ / W (the survivors' quanta, plus the
    weight's own rounding, |round(w·Q)/Q − w| ≤ 1/(2Q), times |xᵢ|)."""
    from fedsec.flower.secagg import flower_weight

    protocol = SecureAggregation(max_weight=1000.0, seed=9)
    rng = np.random.default_rng(4)
    counts = {0: 7, 1: 333, 2: 1000, 3: 61}
    values = {c: torch.from_numpy(rng.uniform(-6, 6, 400)) for c in counts}
    uploads = {c: SimpleNamespace(tensors={"x": values[c], "sample_count": torch.tensor(n)}) for c, n in counts.items()}
    summands = {c: weighted_summands(u, ["x"], protocol.max_weight) for c, u in uploads.items()}
    record, masked = secure_round(protocol, 0, list(counts), summands)
    assert record.layout.fields[0] == ("sample_count", ())  # the factor leads the vector, as in Flower
    factors = sum(flower_weight(n, protocol) for n in counts.values())
    assert factors == sum(weight_factor(protocol, n / protocol.max_weight) for n in counts.values())
    assert float(record.total["sample_count"]) == factors / protocol.quantization_range  # exact, not quantised
    truth = sum(n * values[c] for c, n in counts.items()) / protocol.max_weight
    bound = len(counts) * protocol.quantum + sum(float(values[c].abs().max()) for c in counts) / (
        2 * protocol.quantization_range)
    assert float((record.total["x"] - truth).abs().max()) <= bound
    # the weighted mean is Flower's: Σ ŵᵢxᵢ / Σ ŵᵢ with ŵᵢ = factorᵢ / Q
    hat = {c: flower_weight(n, protocol) / protocol.quantization_range for c, n in counts.items()}
    flower_mean = sum(hat[c] * values[c] for c in counts) / sum(hat.values())
    decoded_mean = record.total["x"] / record.total["sample_count"]
    assert float((decoded_mean - flower_mean).abs().max()) <= len(counts) * protocol.quantum / sum(hat.values())


def test_a_weight_above_the_clipping_range_is_not_clipped():
    """n = 2·W gives a weight of 2 (a factor of 2Q): Flower warns but sends it whole; the old encoding
    clipped it to the range like a parameter."""
    protocol = SecureAggregation(clipping_range=1.0, max_weight=10.0)
    uploads = {c: SimpleNamespace(tensors={"x": torch.full((3,), 0.1, dtype=torch.float64),
                                           "sample_count": torch.tensor(20)}) for c in (0, 1)}
    summands = {c: weighted_summands(u, ["x"], protocol.max_weight) for c, u in uploads.items()}
    record, _ = secure_round(protocol, 0, [0, 1], summands)
    assert float(record.total["sample_count"]) == 4.0 and record.clipped == 0


# -- the engine -----------------------------------------------------------------------------------------------


def _federation(digits, method, secure=None, dropout=0.0, clients=3):
    part = make_partition(digits.labels.numpy(), clients, "pathological", seed=0)
    config = FederationConfig(rounds=1, seed=0, dropout=dropout, train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    return Federation(make_method(method), digits, part, config, channel=ServerChannel(recorder=Recorder(), secure=secure))


def test_by_default_the_server_holds_each_survivors_sample_count_in_the_clear_and_hidden_it_holds_none(digits):
    """Flower's secaggplus_mod clears only the FitRes' arrays: num_examples reaches the server beside the
    masked vector. ``clear_fields="flower"`` (the default) records it so; ``"hidden"`` sends only the
    masked vector."""
    shown = _federation(digits, "fedavg", SecureAggregation())
    shown.run_round()
    record = shown.channel.recorder.aggregates[0]
    sizes = {c: len(shown.partition.train[c]) for c in range(3)}
    assert record.clear == {c: {"sample_count": sizes[c]} for c in range(3)}
    uploads = list(shown.channel.recorder.uploads())
    assert all(set(u.tensors) == {"masked", "sample_count"} for u in uploads)
    assert {u.client_id: int(u.tensors["sample_count"]) for u in uploads} == sizes
    hidden = _federation(digits, "fedavg", SecureAggregation(clear_fields="hidden"))
    hidden.run_round()
    assert hidden.channel.recorder.aggregates[0].clear == {}
    assert all(set(u.tensors) == {"masked"} for u in hidden.channel.recorder.uploads())
    # the decoded sum is the same either way: the clear fields travel beside it
    assert all(torch.equal(record.total[k], hidden.channel.recorder.aggregates[0].total[k]) for k in record.total)


def test_fedavg_under_secure_aggregation_gives_the_plain_global_model(digits):
    plain, secure = _federation(digits, "fedavg"), _federation(digits, "fedavg", SecureAggregation())
    plain.run_round()
    secure.run_round()
    record = secure.channel.recorder.aggregates[0]
    n, weight = len(record.survivors), float(record.total["sample_count"])
    assert n == 3 and record.aborted is None and set(plain.server) == set(secure.server)
    protocol = secure.channel.secure
    # each client's weight is n / W rounded to Flower's factor: the weighted mean moves by at most that
    # relative rounding (1 / (2·Q·w) of the smallest weight) on top of the quantisation
    rounding = 1 / (2 * protocol.quantization_range * min(float(c["sample_count"]) for c in record.clear.values())
                    / protocol.max_weight)
    for name, a in plain.server.items():
        a, b = a.double(), secure.server[name].double()
        # the ratio of two sums each off by at most n * quantum, then a float32 cast of either side
        bound = n * record.quantum * (1 + a.abs()) / (weight - n * record.quantum) + 4 * 2 ** -23 * (1 + a.abs())
        bound = bound + 2 * rounding * a.abs().max()
        assert bool(((a - b).abs() <= bound).all()), name


def test_fedproto_under_secure_aggregation_gives_the_plain_global_prototypes(digits):
    plain, secure = _federation(digits, "fedproto"), _federation(digits, "fedproto", SecureAggregation())
    plain.run_round()
    secure.run_round()
    protocol, record = secure.channel.secure, secure.channel.recorder.aggregates[0]
    assert set(plain.server) == set(secure.server) and len(plain.server) > 0
    assert record.clear == {}  # FedProto sends no sample count (its class counts are summands)
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


def test_a_method_whose_server_reads_each_upload_refuses_in_one_line(digits):
    """No built-in method refuses any more (FedeCouple and FedPAC have secure variants); a method that
    declares per-client fields and no summands still does, before anything trains."""
    from fedecouple.errors import UserError
    from fedecouple.methods.base import Method
    from fedecouple.methods.facets import PerClientFields, secure_refusal

    class PerClient(Method, PerClientFields):  # no SecureSummation
        name = "per-client"
        per_client_fields = ("h", "classifier.*")
        per_client_reason = "it weights each head by its h"

    part = make_partition(digits.labels.numpy(), 3, "pathological", seed=0)
    with pytest.raises(UserError) as refused:
        Federation(PerClient(), digits, part, FederationConfig(rounds=1),
                   channel=ServerChannel(recorder=Recorder(), secure=SecureAggregation()))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("per-client cannot run under secure aggregation")
    assert "h, classifier.*" in message and "it weights each head by its h" in message
    assert not [name for name, cls in METHODS.items() if secure_refusal(cls()) is not None]


@pytest.mark.parametrize("option", [["--sa-modulus", "4294967291"], ["--sa-clipping-range", "8"],
                                    ["--sa-clear-fields", "hidden"], ["--sa-num-shares", "3"]],
                         ids=["another-value", "the-default-value", "clear-fields", "num-shares"])
def test_a_protocol_option_without_secure_aggregation_is_refused(tmp_path, capsys, option):
    """Named at all, even at its default value: the user believes the protocol is on."""
    code, _, err = run_cli(["train", "--method", "fedavg", *option, *SMALL, "--out", tmp_path / "r"], capsys)
    assert code == 2 and err.startswith("error:") and "add --secure-aggregation" in err and "Traceback" not in err
    assert option[0] in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("option, words", [
    (["--sa-clear-fields", "x"], "--sa-clear-fields"),
    (["--sa-num-shares", "2"], "--sa-num-shares must be an integer of at least 3 (a count) or a fraction in (0, 1]"),
    (["--sa-num-shares", "many"], "--sa-num-shares expects an integer"),
    (["--sa-threshold", "1.5"], "--sa-threshold must be an integer of at least 2 (a count) or a fraction in (0, 1]"),
    (["--sa-num-shares", "3", "--sa-threshold", "3"], "--sa-threshold (3) must be less than --sa-num-shares (3)"),
], ids=["clear-fields", "two-shares", "not-a-number", "threshold-fraction", "threshold-not-below-shares"])
def test_a_bad_protocol_value_is_one_line_with_exit_2_and_writes_nothing(tmp_path, capsys, option, words):
    code, _, err = run_cli(["train", "--method", "fedavg", "--secure-aggregation", *option, *SMALL, "--out",
                            tmp_path / "r"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], err[-2000:]
    assert not (tmp_path / "r").exists()


def test_an_engine_error_names_the_engines_own_fields():
    from fedecouple.errors import UserError

    with pytest.raises(UserError, match=r"^clipping_range must be positive"):
        SecureAggregation(clipping_range=0.0)
    with pytest.raises(UserError, match=r"^reconstruction_threshold \(3\) must be less than num_shares \(3\)"):
        SecureAggregation(num_shares=3, reconstruction_threshold=3)
    with pytest.raises(UserError, match=r"^clear_fields must be one of flower, hidden"):
        SecureAggregation(clear_fields="x")
    from fedsec import catalog

    assert CLEAR_FIELDS == catalog.SECURE_AGGREGATION_CLEAR_FIELDS


def test_train_says_what_the_server_held_and_warns_of_clipping_and_aborts(tmp_path, capsys):
    out = tmp_path / "sa"
    # weights n / 10 (about 48: some 480 images a client) push weighted parameters beyond the clipping range 8
    # (the weights themselves travel whole, as Flower's factor), and every dropout aborts
    args = ["train", "--method", "fedavg", *SMALL, "--rounds", "2", "--secure-aggregation", "--sa-max-weight", "10",
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
                                "num_shares": 1.0, "reconstruction_threshold": 1.0, "max_weight": 10.0,
                                "clear_fields": "flower", "quantum": 16 / 2 ** 22}
    assert held["in_the_clear"] == ["sample_count"] and "in the clear beside each masked upload" in held["server_held"]
    log = summary["round_log"]
    assert log["clipped"] == int(rounds["clipped"].sum()) > 0 and log["dropped"] == int(rounds["dropped"].sum())
    assert log["aborted_rounds"] == [int(r) for r in rounds.loc[rounds["aborted"].notna(), "round"]]
    assert json.loads((out / "config.json").read_text())["config"]["sa_max_weight"] == 10.0
    assert "secure-aggregation = true" in (out / "config.toml").read_text()
    lines = printed.splitlines()
    assert any("the server held only each round's sum" in line and "in the clear beside it: sample_count" in line
               for line in lines)
    assert any(line.startswith("warning:") and f"{log['clipped']} summed values" in line for line in lines)
    assert log["aborted_rounds"], "this seed drops a client in some round: the abort warning is under test"
    assert any(line.startswith("warning:") and "aborted" in line for line in lines)
    code, again, _ = run_cli(args, capsys)  # read back: the same lines
    assert code == 0 and "read back" in again and again.splitlines()[1:] == lines[1:]


def test_in_memory_training_under_secure_aggregation_writes_nothing(tmp_path, monkeypatch):
    import fedsec

    monkeypatch.chdir(tmp_path)
    r = fedsec.train(method="fedproto", dataset="digits", clients=3, rounds=1, threads=TEST_THREADS,
                     secure_aggregation=True, sa_num_shares=3, sa_threshold=2, sa_clear_fields="hidden",
                     progress=False)
    assert r.out is None and not any(tmp_path.iterdir())
    protocol = r.secure_aggregation["protocol"]
    assert (protocol["num_shares"], protocol["reconstruction_threshold"], protocol["clear_fields"]) == (3, 2, "hidden")
    assert r.round_log["survivors"] == 3 and r.secure_aggregation["in_the_clear"] == []
    assert any("held only each round's sum" in line and "nothing in the clear" in line for line in r.lines)


def test_a_plain_run_keeps_its_identity_and_a_folder_written_before_the_options_resumes(tmp_path, capsys):
    from fedsec.invocation import federation, identity
    from fedsec.keywords import request
    from fedsec.runner import RunConfig

    args = ["train", "--method", "fedavg", *SMALL, "--rounds", "1"]
    given = request("train", {k.lstrip("-").replace("-", "_"): v for k, v in zip(args[1::2], args[2::2])})
    config, resolved = federation(given, given.params)
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
    from fedsec.jobs.audit import secure_aggregation_status

    status = {name: secure_aggregation_status(cls()) for name, cls in METHODS.items()}
    assert status["fedavg"] == status["ft-fedavg"] == status["fedper"] == status["fedrep"] == "runs on the sum"
    assert status["fedproto"] == "secure variant: " + METHODS["fedproto"].secure_variant_note
    assert status["fedecouple"] == "secure variant: " + METHODS["fedecouple"].secure_variant_note
    assert status["fedecouple"].startswith("secure variant: two passes:")
    assert status["fedpac"].startswith("secure variant: partial (heads local, no head combination):")
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
    # each client's masked vector, and beside it its sample count in the clear, as Flower's SecAgg+ leaves it
    assert set(rows["field"]) == {"masked", "sample_count"} and len(rows) == 6
    assert set(rows.loc[rows["field"] == "masked", "kind"]) == {"masked"}
    codes = [f["code"] for f in json.loads((out / "findings.json").read_text())]
    assert "SECURE_AGGREGATION" in codes and "UNDECLARED_FIELDS" not in codes and "MODEL_DISCLOSED" not in codes
    status = "runs on the sum; in the clear: sample_count"
    assert json.loads((out / "summary.json").read_text())["secure_aggregation"] == status
    assert f"  secure aggregation: {status}" in printed.splitlines()
    assert f"* secure aggregation: {status}" in (out / "audit.md").read_text()


def test_the_audit_under_secure_aggregation_measures_what_the_sum_gives_away(tmp_path):
    """FedProto's clients sum their class counts: the audit's evidence reads every round's histogram
    exactly, and no per-class key of a masked upload is taken for a disclosed class."""
    from fedsec.jobs.audit import run_audit
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
