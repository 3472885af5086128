"""fedsec.flower.secagg: Flower's own SecAgg+ (SecAggPlusWorkflow and secaggplus_mod) recorded in the form of
fedsec's engine under --secure-aggregation, checked against each node's true update, and attacked.

One simulation of the example app (examples/flower_secagg) with 4 nodes and 2 rounds: Flower round 1 in
the textbook setting (every node one SGD step on 4 images), round 2 real local training (one epoch on
751 or 1125 images: unequal weights). The protocol runs with a max weight above every node's sample
count and 2**26 quantisation steps (Flower's defaults otherwise). About 25 s on a shared 2-core machine,
mostly Ray's start-up; the audit through the command line reuses the same simulation, and fedsec's engine
runs the same federation (a few seconds) to compare what its server holds in the clear.
"""
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before Flower is first imported: no network calls
pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install -e '.[flower]'")
pytestmark = pytest.mark.usefixtures("shared_ray")  # simulations share one Ray instance and its actors
from scipy.stats import chisquare  # noqa: E402

from attacks.base import Budget  # noqa: E402
from attacks.recorded import ThreatModel  # noqa: E402
from fedecouple.channel import Recorder, ServerChannel  # noqa: E402
from fedecouple.engine import Federation, FederationConfig, VictimSetting  # noqa: E402
from fedecouple.methods.base import TrainConfig, make_upload  # noqa: E402
from fedecouple.methods.fedavg import FedAvg  # noqa: E402
from fedecouple.methods.training import cross_entropy_loss, train_supervised  # noqa: E402
from fedecouple.models import get_params, set_params  # noqa: E402
from fedecouple.secure_aggregation import AggregateRecord, SecureAggregation  # noqa: E402
from fedsec.cli import main  # noqa: E402
from fedsec.flower.harness import recorded_run  # noqa: E402
from fedsec.flower.simulation import reused_simulations, simulate  # noqa: E402
from helpers import TEST_THREADS  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_secagg"
NODES = 4
CONFIG = {"num-server-rounds": 2, "victim-batch": 4, "victim-steps": 1, "victim-rounds": "1", "max-weight": 1200.0,
          "quantization-range": 2 ** 26}
PROTOCOL = SecureAggregation(clipping_range=8.0, quantization_range=2 ** 26, modulus=2 ** 32, num_shares=3,
                             reconstruction_threshold=2, max_weight=1200.0)


@pytest.fixture(scope="module")
def run():
    torch.set_num_threads(TEST_THREADS)
    with reused_simulations():  # the command-line audit below asks for the same simulation
        yield simulate(EXAMPLE, nodes=NODES, run_config=CONFIG, threads=TEST_THREADS, ray_cpus=1)


@pytest.fixture(scope="module")
def task(run):
    """The example app's own task module (``simulate`` put the app directory on sys.path)."""
    assert str(EXAMPLE) in sys.path
    from secagg_mnist import task

    return task


@pytest.fixture(scope="module")
def true_updates(run, task):
    """Each (round, client)'s true update, replayed from the recorded download with the app's own code
    (client c is the node holding partition c): {(round, client): (weights, num_examples, loss)}."""
    torch.set_num_threads(TEST_THREADS)
    out = {}
    for (round, client), exchange in sorted(run.recorder.exchanges.items()):
        sent = [exchange.download.tensors[n].numpy() for n, _ in task.build_model(run.run_config).named_parameters()]
        out[round, client] = task.local_update(sent, client, NODES, round + 1, run.run_config)
    return out


def _flower_weight(n: int) -> float:
    """A node's weight as secaggplus_mod quantises it."""
    return round(n / PROTOCOL.max_weight * PROTOCOL.quantization_range) / PROTOCOL.quantization_range


def test_the_secagg_run_is_recorded_like_the_engine(run, task):
    recorder = run.recorder
    assert recorder.secure == PROTOCOL
    assert {c: info["partition_id"] for c, info in run.clients.items()} == {c: c for c in range(NODES)}
    assert sorted(recorder.exchanges) == [(r, c) for r in range(2) for c in range(NODES)]
    shapes = {n: tuple(p.shape) for n, p in task.build_model(run.run_config).named_parameters()}
    values = sum(math.prod(s) for s in shapes.values())
    for (round, client), exchange in recorder.exchanges.items():
        arrays = {n: tuple(t.shape) for n, t in exchange.download.tensors.items() if not n.startswith("config.")}
        assert arrays == shapes
        assert int(exchange.download.tensors["config.server-round"]) == round + 1
        upload = exchange.upload
        assert upload.meta["secure_aggregation"] is True and upload.meta["flower_round"] == round + 1
        assert set(upload.tensors) == {"masked", "sample_count", "metric.train_loss"}
        assert upload.tensors["masked"].dtype == torch.int64 and upload.tensors["masked"].shape == (values + 1,)
    assert sorted(recorder.aggregates) == [0, 1]
    for round, record in recorder.aggregates.items():
        assert isinstance(record, AggregateRecord) and record.aborted is None
        assert record.participants == record.survivors == tuple(range(NODES)) and record.dropped == ()
        # float32 parameters: Flower quantises them in float32, whose rounding adds 8 * 2**-22 at clipping range 8
        assert record.quantum == PROTOCOL.quantum + 8 * 2.0 ** -22 and record.layout.size == values + 1
        assert set(record.total) == set(shapes) | {"sample_count"}


def test_each_masked_upload_is_uniform_and_unrelated_to_the_parameters(run, true_updates):
    """Each masked vector: every value in [0, modulus), uniform over 64 equal bins (chi-square; the masks
    come from real key agreement, unseeded, so the threshold is far out: 1e-6), uncorrelated with the
    node's true parameters (|r| < 4/sqrt(n)); the plain quantised vector would lie in [0, 2**26], 1/64 of
    the range."""
    modulus = PROTOCOL.modulus
    for key, exchange in run.recorder.exchanges.items():
        masked = exchange.upload.tensors["masked"].numpy()
        assert masked.min() >= 0 and masked.max() < modulus
        observed = np.bincount((masked * 64 // modulus).astype(np.int64), minlength=64)
        assert chisquare(observed).pvalue > 1e-6, key
        plain = np.concatenate([np.asarray(w, dtype=np.float64).reshape(-1) for w in true_updates[key][0]])
        r = np.corrcoef(masked[1:].astype(np.float64), plain)[0, 1]
        assert abs(r) < 4 / math.sqrt(len(plain)), (key, r)
        assert np.mean(masked <= PROTOCOL.quantization_range) < 0.05, key


def test_the_fitres_metrics_travel_in_the_clear_and_are_recorded(run, task, true_updates):
    partition = task.load_partition(NODES, run.run_config)
    for (round, client), exchange in run.recorder.exchanges.items():
        tensors = exchange.upload.tensors
        _, count, loss = true_updates[round, client]
        assert int(tensors["sample_count"]) == count == (4 if round == 0 else len(partition.train[client]))
        assert float(tensors["metric.train_loss"]) == pytest.approx(loss, abs=1e-6)


def test_the_recorded_aggregate_is_the_weighted_average_of_the_true_updates(run, task, true_updates):
    """total[name] / total["sample_count"] (what Flower's strategy received) is the Flower-weighted
    average of the nodes' true parameters within the quantisation: each summed value is off by less than
    the record's quantum per node, divided by the summed weight. It is no single node's parameters."""
    names = [n for n, _ in task.build_model(run.run_config).named_parameters()]
    for round, record in run.recorder.aggregates.items():
        updates = [true_updates[round, c] for c in record.survivors]
        weights = [_flower_weight(n) for _, n, _ in updates]
        assert float(record.total["sample_count"]) == pytest.approx(sum(weights), rel=1e-12)
        bound = len(updates) * record.quantum / sum(weights) + 1e-6
        spread = 0.0
        for i, name in enumerate(names):
            truth = sum(w * np.asarray(u[0][i], dtype=np.float64) for w, u in zip(weights, updates)) / sum(weights)
            aggregate = (record.total[name] / record.total["sample_count"]).numpy()
            assert np.abs(aggregate - truth).max() <= bound, (round, name)
            spread = max(spread, max(np.abs(np.asarray(u[0][i]) - truth).max() for u in updates))
        assert spread > 10 * bound  # the nodes' parameters differ by more: the check could fail


# -- the same federation in fedsec's engine: what its server holds in the clear ------------------------------
class _LossReportingFedAvg(FedAvg):
    """fedsec's FedAvg that sends its mean training loss with its upload, as the app's node sends it as a
    FitRes metric (fedsec's own methods send no metric)."""

    def client_update(self, ctx, state, download):
        model = ctx.model
        set_params(model, dict(download.tensors))
        loss = train_supervised(ctx, model.parameters(), ctx.config.local_epochs, "local", cross_entropy_loss(model))
        return {}, make_upload(ctx, get_params(model), train_loss=loss)


def _engine_run(run, task, clear_fields: str, rounds: int) -> Recorder:
    """The recorded federation in fedsec's engine under secure aggregation: the app's model, data, seed and
    victim round, the protocol the Flower server sent, with ``clear_fields``."""
    torch.set_num_threads(TEST_THREADS)
    config = run.run_config
    recorder = Recorder()
    victim = VictimSetting(int(config["victim-batch"]), int(config["victim-steps"]),
                           {(r - 1, c) for r in task.victim_rounds(config) for c in range(NODES)})
    federation = Federation(
        _LossReportingFedAvg(), task.load_pool(), task.load_partition(NODES, config),
        FederationConfig(rounds=rounds, seed=int(config["seed"]), arch=str(config["arch"]),
                         train=TrainConfig(lr=float(config["lr"]), batch_size=int(config["batch-size"]),
                                           local_epochs=int(config["local-epochs"]))),
        channel=ServerChannel(recorder=recorder, secure=replace(run.recorder.secure, clear_fields=clear_fields)),
        victim=victim)
    federation.run(rounds)
    return recorder


@pytest.fixture(scope="module")
def engine_clear(run, task):
    return _engine_run(run, task, "flower", rounds=2)


def _beside(upload) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in upload.tensors.items() if name != "masked"}


def test_the_engine_holds_in_the_clear_what_the_flower_server_holds(run, task, true_updates, engine_clear):
    """secaggplus_mod clears only its FitRes' arrays: num_examples and the metrics reach the server beside
    each masked vector. The same federation in fedsec's engine under clear_fields="flower" holds the same
    fields of the same clients, round by round, in its records and beside each masked upload. Sample counts
    are equal; round 0's losses too (same model, batch and seeds). Later rounds start from each server's own
    decoding of the previous sum, which the two sides' rounding draws make differ (by about 1e-4 here), so
    each side's loss is checked against the app's own update from that side's download instead."""
    flower = run.recorder
    assert sorted(engine_clear.aggregates) == sorted(flower.aggregates) == [0, 1]
    for round, record in flower.aggregates.items():
        ours = engine_clear.aggregates[round]
        assert ours.survivors == record.survivors == tuple(range(NODES))
        assert {c: sorted(f) for c, f in ours.clear.items()} == {c: sorted(f) for c, f in record.clear.items()} \
            == {c: ["metric.train_loss", "sample_count"] for c in range(NODES)}
        for client, shown in record.clear.items():
            held = ours.clear[client]
            assert type(held["sample_count"]) is int and held["sample_count"] == shown["sample_count"]
            # beside the masked vector: the same names and dtypes, carrying the record's values
            theirs, mine = _beside(flower.get(round, client).upload), _beside(engine_clear.get(round, client).upload)
            assert {n: t.dtype for n, t in mine.items()} == {n: t.dtype for n, t in theirs.items()}
            assert {n: t.item() for n, t in mine.items()} == held
            assert {n: t.item() for n, t in theirs.items()} == shown
            if round == 0:
                assert held["metric.train_loss"] == pytest.approx(shown["metric.train_loss"], rel=1e-6)
            else:
                sent = [engine_clear.get(round, client).download.tensors[n].numpy()
                        for n, _ in task.build_model(run.run_config).named_parameters()]
                _, count, loss = task.local_update(sent, client, NODES, round + 1, run.run_config)
                assert held == {"sample_count": count, "metric.train_loss": pytest.approx(loss, rel=1e-6)}
                assert shown["metric.train_loss"] == pytest.approx(true_updates[round, client][2], rel=1e-6)


def test_hidden_the_engine_holds_nothing_beside_the_masked_uploads(run, task, engine_clear):
    """clear_fields="hidden" sends nothing of what the Flower server held in the clear, and the same
    masked vectors."""
    hidden = _engine_run(run, task, "hidden", rounds=1)
    assert run.recorder.aggregates[0].clear  # what Flower's server held of round 0
    assert hidden.aggregates[0].clear == {}
    for client in range(NODES):
        upload = hidden.get(0, client).upload
        assert set(upload.tensors) == {"masked"}
        assert torch.equal(upload.tensors["masked"], engine_clear.get(0, client).upload.tensors["masked"])


def test_the_round_label_histogram_is_read_from_the_aggregate(run):
    """The curious server's round-level attack on the recorded run: round 0's 16 training images (4 per
    node, one step each) counted per class from the summed classifier-bias update, exactly."""
    from attacks.harness import attack_rounds

    outcome = attack_rounds(recorded_run(run), "sum-labels", [0], ThreatModel(), Budget(iterations=1), seed=0,
                            progress=False)
    histogram = outcome.summary.statistics["histogram"]
    assert histogram["rounds"] == 1 and histogram["exact_rounds"] == 1
    true = {row["class"]: row["true_count"] for row in outcome.rows}
    assert sum(true.values()) == 16 and sum(v > 0 for v in true.values()) >= 3


def test_flower_audit_says_the_server_held_only_the_sum(run, tmp_path, capsys):
    out = tmp_path / "audit"
    overrides = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in CONFIG.items()
                         if k != "num-server-rounds")
    main(["flower", "audit", str(EXAMPLE), "--nodes", str(NODES), "--rounds", "2", "--ray-cpus", "1",
          "--threads", str(TEST_THREADS), "--run-config", overrides, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "held only each round's sum" in printed
    findings = {f["code"]: f for f in json.loads((out / "findings.json").read_text())}
    assert findings["SECURE_AGGREGATION"]["evidence"]["survivors"] == [NODES, NODES]
    clear = findings["FIELDS_IN_THE_CLEAR"]
    assert clear["evidence"]["fields"] == ["metric.train_loss", "sample_count"]
    labels = findings["ROUND_LABELS_FROM_SUM"]["evidence"]
    assert labels["rounds"] == 2 and labels["exact_rounds"] >= 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["secure_aggregation"].startswith("Flower SecAgg+")
    assert (out / "audit.csv").is_file() and (out / "audit.md").is_file() and (out / "config.toml").is_file()


def test_the_library_attack_writes_the_round_level_outputs(run, tmp_path):
    from fedsec.flower.harness import attack_secure_app
    from fedsec.jobs.attack import AttackSettings

    settings = AttackSettings(attack="sum-labels", rounds=(0, 1), train_rounds=2, threads=TEST_THREADS)
    summary = attack_secure_app(EXAMPLE, settings, nodes=NODES, run_config=CONFIG, out=tmp_path, ray_cpus=1,
                                progress=False)
    assert summary["run"] == "flower:flower-secagg" and summary["targets"] == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}
    assert summary["histogram"]["rounds"] == 2 and summary["histogram"]["count_errors"][0] == 0
    assert [r["round"] for r in summary["per_target"]] == [0, 1]
    assert (tmp_path / "attack.csv").read_text().count("\n") == 1 + 2 * 10  # one row per round and class


def test_flower_attack_refuses_a_secagg_app_in_one_line(run, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["flower", "attack", "dlg", str(EXAMPLE), "--nodes", str(NODES)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: dlg attacks one node's upload") and "\n" not in err
    assert "holds only each round's sum" in err


def test_relabel_renames_the_secure_aggregation_records():
    recorder = Recorder()
    recorder.on_aggregate(AggregateRecord(0, (0, 1, 2), (0, 2), (1,), {}, 1.0))
    recorder.relabel({0: 7, 1: 0})
    record = recorder.aggregates[0]
    assert (record.participants, record.survivors, record.dropped) == ((0, 2, 7), (2, 7), (0,))
    with pytest.raises(ValueError, match="merge"):
        recorder.relabel({2: 7})


# -- the recording point on hand-made messages (no simulation) ------------------------------------------
@pytest.fixture
def server_identity(monkeypatch):
    """What the simulation sets before a ServerApp creates messages (run, task and node ids)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


def test_a_round_halted_before_the_strategy_is_recorded_as_aborted(server_identity):
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    from fedsec.flower.secagg import SecAggRecording

    setup = {Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: 3, Key.SHARE_NUMBER: 3, Key.THRESHOLD: 2,
             Key.CLIPPING_RANGE: 8.0, Key.TARGET_RANGE: 2 ** 22, Key.MOD_RANGE: 2 ** 32, Key.MAX_WEIGHT: 1000.0}
    recording = SecAggRecording(Recorder())
    recording.begin(1, [30, 10, 20])
    messages = [Message(content=RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(setup))}), dst_node_id=node,
                        message_type="train") for node in (10, 20, 30)]
    assert recording.sent(messages) == Stage.SETUP
    recording.end()
    assert recording.recorder.secure == SecureAggregation(num_shares=1.0, reconstruction_threshold=2)
    record = recording.recorder.aggregates[0]
    assert record.participants == record.dropped == (0, 1, 2) and record.survivors == () and record.total == {}
    assert record.aborted == "SecAgg+ halted in its setup stage: the server unmasked nothing"


def test_unnamed_arrays_that_do_not_match_the_model_are_refused_in_one_line():
    from fedecouple.channel import Download, Upload
    from fedecouple.errors import UserError
    from fedsec.flower.secagg import check_secure_traffic

    recorder = Recorder()
    recorder.on_download(Download(0, 0, {"array.0": torch.zeros(3), "array.1": torch.zeros(2)}))
    with pytest.raises(UserError, match="sends 2 unnamed arrays, the declared model has 8 parameters"):
        check_secure_traffic(recorder, 8)
    recorder = Recorder()
    recorder.on_download(Download(0, 0, {"w": torch.zeros(3), "config.server-round": torch.tensor(1)}))
    recorder.on_upload(Upload(0, 0, {"masked": torch.zeros(3, dtype=torch.int64)}, {"secure_aggregation": True}))
    with pytest.raises(UserError, match="holds 3 values, not its download's 3 plus the weight factor"):
        check_secure_traffic(recorder, 1)
