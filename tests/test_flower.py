"""fedsec.flower: recording a Flower app's federation, its ground truth, and the one-line errors.

The three simulations run the example app (examples/flower_mnist) in Flower's simulation engine on Ray
with 4 nodes, 1 round and one CPU (20-30 s each on a shared 2-core machine, mostly Ray and worker start-up).
"""
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before Flower is first imported: no network calls
flwr = pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")
pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install -e '.[flower]'")
pytestmark = pytest.mark.usefixtures("shared_ray")  # simulations share one Ray instance and its actors

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedecouple.channel import Interceptor, Recorder, ServerChannel  # noqa: E402
from fedecouple.data import load_dataset, make_partition  # noqa: E402
from fedecouple.engine import Federation, FederationConfig, GroundTruth, VictimSetting  # noqa: E402
from fedecouple.errors import UserError  # noqa: E402
from fedecouple.methods import make_method  # noqa: E402
from fedecouple.methods.base import TrainConfig  # noqa: E402
from fedsec.cli import main  # noqa: E402
from defenses.filters import FilterChain, NormClip  # noqa: E402
from fedsec.flower.harness import recorded_run  # noqa: E402
from fedsec.flower.recording import RecordingStrategy  # noqa: E402
from fedsec.flower.simulation import simulate  # noqa: E402
from fedsec.jobs.attack import AttackSettings  # noqa: E402
from helpers import TEST_THREADS  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_mnist"
NODES = 4
VICTIM = {"num-server-rounds": 1, "victim-batch": 1, "victim-steps": 1, "fraction-evaluate": 0.0,
          "arch": "cnn28-same"}


# -- RecordingStrategy on a fake grid (no simulation) ------------------------------------------------
@pytest.fixture
def server_identity(monkeypatch):
    """What the simulation sets before a ServerApp creates messages (run, task and node ids)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


class FakeGrid:
    """The one Grid method a FedAvg round configuration calls."""

    def __init__(self, node_ids):
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return list(self.node_ids)


def _reply(instruction: Message, weight: float, count: int) -> Message:
    arrays = ArrayRecord({"extractor.w": torch.full((2, 2), weight), "classifier.b": torch.tensor([weight])})
    metrics = MetricRecord({"num-examples": count, "train_loss": 0.5})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=instruction)


def _round(strategy, grid, weights, counts):
    initial = ArrayRecord({"extractor.w": torch.zeros(2, 2), "classifier.b": torch.zeros(1)})
    messages = list(strategy.configure_train(1, initial, ConfigRecord(), grid))
    by_node = {m.metadata.dst_node_id: m for m in messages}
    replies = [_reply(by_node[node], weights[node], counts[node]) for node in sorted(by_node)]
    return strategy.aggregate_train(1, replies)


def test_recording_strategy_records_and_delegates(server_identity):
    grid = FakeGrid([907, 15, 4242])
    weights, counts = {907: 1.0, 15: 3.0, 4242: 5.0}, {907: 1, 15: 1, 4242: 2}
    recorder = Recorder()
    strategy = RecordingStrategy(FedAvg(), recorder)
    assert strategy.fraction_train == 1.0  # attributes read through to the wrapped strategy
    arrays, metrics = _round(strategy, grid, weights, counts)
    plain, _ = _round(FedAvg(), grid, weights, counts)
    # aggregation delegated unchanged: (1·1 + 1·3 + 2·5) / 4
    assert torch.equal(arrays.to_torch_state_dict()["extractor.w"], plain.to_torch_state_dict()["extractor.w"])
    assert float(arrays.to_torch_state_dict()["classifier.b"]) == pytest.approx(3.5)
    # client ids are the ranks of the node ids; Flower round 1 is round 0
    assert strategy.client_ids.nodes() == {0: 15, 1: 907, 2: 4242}
    assert sorted(recorder.exchanges) == [(0, 0), (0, 1), (0, 2)]
    for client, node in strategy.client_ids.nodes().items():
        exchange = recorder.get(0, client)
        assert exchange.download.meta["node_id"] == node and exchange.download.meta["config"]["server-round"] == 1
        assert torch.equal(exchange.download.tensors["extractor.w"], torch.zeros(2, 2))
        assert torch.equal(exchange.upload.tensors["extractor.w"], torch.full((2, 2), weights[node]))
        assert int(exchange.upload.tensors["sample_count"]) == counts[node]
        assert float(exchange.upload.tensors["metric.train_loss"]) == 0.5


def test_recording_strategy_interceptors_act_before_aggregation(server_identity):
    grid = FakeGrid([1, 2])
    recorder = Recorder()
    chain = FilterChain([NormClip(1.0)])  # on the update: upload minus the download it answers
    strategy = RecordingStrategy(FedAvg(), recorder, interceptors=[chain])
    arrays, _ = _round(strategy, grid, {1: 2.0, 2: 4.0}, {1: 1, 2: 1})
    for client in (0, 1):
        upload = recorder.get(0, client).upload.tensors
        norm = torch.cat([upload["extractor.w"].reshape(-1), upload["classifier.b"]]).norm()  # download: zeros
        assert float(norm) == pytest.approx(1.0, rel=1e-5)  # the recorder stores the clipped upload
    # the strategy averaged the clipped updates: every entry 1/sqrt(5) for both nodes
    assert torch.allclose(arrays.to_torch_state_dict()["extractor.w"], torch.full((2, 2), 5 ** -0.5))


def test_recording_strategy_drops_what_an_interceptor_drops(server_identity):
    class DropFirst(Interceptor):
        def on_upload(self, message):
            return None if message.client_id == 0 else message

    grid = FakeGrid([1, 2])
    strategy = RecordingStrategy(FedAvg(), Recorder(), interceptors=[DropFirst()])
    arrays, _ = _round(strategy, grid, {1: 2.0, 2: 4.0}, {1: 1, 2: 1})
    assert torch.equal(arrays.to_torch_state_dict()["extractor.w"], torch.full((2, 2), 4.0))
    assert strategy.recorder.get(0, 0).upload is None


def test_recording_strategy_refuses_a_legacy_strategy():
    from flwr.server.strategy import FedAvg as LegacyFedAvg

    with pytest.raises(UserError, match="legacy Flower strategy"):
        RecordingStrategy(LegacyFedAvg(), Recorder())


# -- the example app in Flower's simulation engine ---------------------------------------------------
@pytest.fixture(scope="module")
def fedavg_victim_run():
    torch.set_num_threads(TEST_THREADS)
    return simulate(EXAMPLE, nodes=NODES, run_config=VICTIM, ray_cpus=1)


def _engine_run(arch: str):
    dataset = load_dataset("mnist5k")
    partition = make_partition(dataset.labels.numpy(), NODES, "pathological", num_classes=10, classes_per_client=3,
                               seed=0)
    recorder, ground_truth = Recorder(), GroundTruth()
    fed = Federation(make_method("fedavg"), dataset, partition,
                     FederationConfig(rounds=1, seed=0, arch=arch,
                                      train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1)),
                     channel=ServerChannel(recorder=recorder), ground_truth=ground_truth,
                     victim=VictimSetting(batch=1, steps=1, targets={(0, c) for c in range(NODES)}))
    fed.run(1)
    return recorder, ground_truth


def test_fedavg_app_uploads_equal_the_engine(fedavg_victim_run):
    """Same model, data and seed: each node's recorded download and upload equal what fedsec's engine
    records for the same client (client c: the node holding partition c). Bit-identical here: the app
    seeds like the engine and both run one torch thread."""
    run = fedavg_victim_run
    recorder, ground_truth = _engine_run("cnn28-same")
    assert {c: info["partition_id"] for c, info in run.clients.items()} == {c: c for c in range(NODES)}
    assert sorted(run.recorder.exchanges) == sorted(recorder.exchanges)
    for client in range(NODES):
        ours, theirs = run.recorder.get(0, client), recorder.get(0, client)
        for sent, expected in ((ours.download, theirs.download), (ours.upload, theirs.upload)):
            for name, tensor in expected.tensors.items():
                assert sent.tensors[name].dtype == tensor.dtype, name
                assert torch.allclose(sent.tensors[name], tensor, rtol=0, atol=1e-7), name
        # the only field the engine does not have: the loss Flower apps report
        assert set(ours.upload.tensors) - set(theirs.upload.tensors) == {"metric.train_loss"}
        assert run.ground_truth.samples(0, client).tolist() == ground_truth.samples(0, client).tolist()


def test_dlg_recovers_the_images_from_the_recorded_uploads(fedavg_victim_run, tmp_path):
    """The recorded Flower run through fedsec's own attack harness: two targets, one image and one step each."""
    from attacks.harness import attack_recorded
    from fedsec.jobs.attack import write_attack
    from fedsec.recording import choose_targets

    run = fedavg_victim_run
    # two starts, the lower objective kept: a single DLG start can stall on another CPU's rounding
    settings = AttackSettings(attack="dlg", targets=2, iterations=30, restarts=2).resolved(seed=0)
    targets = choose_targets(run.participants, settings)
    args = settings.split()
    outcome = attack_recorded(recorded_run(run), args.spec, targets, args.threat, args.budget, seed=args.seed,
                              batched=args.batched, victim=args.victim, progress=False)
    summary = write_attack(tmp_path, settings, targets, outcome, {}, start=0.0)
    assert summary["run"] == "flower:flower-mnist" and summary["method"] == "fedavg"
    assert summary["images_scored"] == 2 and summary["label_accuracy"] == 1.0
    rows = pd.read_csv(tmp_path / "attack.csv")
    assert len(rows) == 2 and (rows["psnr"] >= 30.0).all(), rows
    assert (rows["prior_psnr"] < 20.0).all()
    assert (tmp_path / "reconstructions.png").stat().st_size > 0


def test_fedper_audit_reports_the_head_as_never_uploaded(tmp_path, capsys):
    out = tmp_path / "audit"
    main(["flower", "audit", str(EXAMPLE), "--nodes", str(NODES), "--no-evidence", "--ray-cpus", "1",
          "--run-config", "strategy='fedper' num-server-rounds=1 fraction-evaluate=0.0", "--out", str(out)])
    findings = {f["code"]: f for f in json.loads((out / "findings.json").read_text())}
    kept = findings["PARAMETERS_NEVER_UPLOADED"]
    assert kept["evidence"]["parameters"] == ["classifier.weight", "classifier.bias"]
    assert kept["evidence"]["uploads_checked"] == NODES
    assert "the classifier never left the clients" in kept["finding"]
    fields = pd.read_csv(out / "audit.csv")
    assert len(fields) and not fields["field"].str.startswith("classifier.").any()
    assert set(fields["kind"]) == {"extractor", "sample_count", "other"}  # other: the reported train loss
    assert findings["UNDECLARED_FIELDS"]["evidence"]["fields"] == ["metric.train_loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "fedper" and summary["flower"]["nodes"] == NODES
    assert "PARAMETERS_NEVER_UPLOADED" in capsys.readouterr().out


# -- one-line errors through the CLI -----------------------------------------------------------------
def _fails(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "Traceback" not in err
    return err


def test_error_flower_not_installed(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "flwr", None)
    err = _fails(capsys, ["flower", "audit", str(EXAMPLE), "--out", str(tmp_path / "out")])
    assert "pip install -e '.[flower]'" in err
    assert not (tmp_path / "out").exists()


def test_error_app_dir_without_flower_components(capsys, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1.0"\n')
    err = _fails(capsys, ["flower", "audit", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "[tool.flwr.app.components]" in err
    assert not (tmp_path / "out").exists()
    err = _fails(capsys, ["flower", "attack", str(tmp_path / "nowhere"), "--attack", "dlg"])
    assert "not a directory" in err


LEGACY_SERVER = '''
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg

def server_fn(context):
    return ServerAppComponents(strategy=FedAvg(), config=ServerConfig(num_rounds=1))

app = ServerApp(server_fn=server_fn)
'''

WRONG_DECLARATION = '''
from PACKAGE.task import fedsec_declaration


def declaration(run_config):
    """Claims the FedPer protocol (head kept on the nodes) whatever strategy the app runs."""
    return {**fedsec_declaration(run_config), "method": "fedper", "local-parameters": ["classifier.*"]}
'''


def _copy_example(root: Path, package: str, files: dict[str, str], references: dict[str, str]) -> Path:
    """The example app under another package name (modules are cached by name in this process), with
    extra modules ``files`` (``PACKAGE`` standing for the package) and the references of its pyproject
    (components, declaration) replaced as ``references`` says (old → new, without the package)."""
    app = root / package
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "flower_mnist").rename(app / package)
    for path in (app / package).glob("*.py"):
        path.write_text(path.read_text().replace("from flower_mnist import", f"from {package} import"))
    for name, text in files.items():
        (app / package / f"{name}.py").write_text(textwrap.dedent(text).replace("PACKAGE", package))
    text = (app / "pyproject.toml").read_text()
    for old, new in references.items():
        text = text.replace(f'"flower_mnist.{old}"', f'"flower_mnist.{new}"')
    (app / "pyproject.toml").write_text(text.replace("flower_mnist.", f"{package}."))
    return app


def test_error_strategy_not_message_api(capsys, tmp_path):
    app = _copy_example(tmp_path, "legacy_mnist", {"legacy_server": LEGACY_SERVER},
                        {"server_app:app": "legacy_server:app"})
    err = _fails(capsys, ["flower", "audit", str(app), "--nodes", "2", "--out", str(tmp_path / "out")])
    assert "legacy" in err and "flwr.serverapp.strategy.Strategy" in err
    assert not (tmp_path / "out").exists()


def test_error_declaration_does_not_match_the_arrays_sent(capsys, tmp_path):
    app = _copy_example(tmp_path, "mismatch_mnist", {"wrong": WRONG_DECLARATION},
                        {"task:fedsec_declaration": "wrong:declaration"})
    err = _fails(capsys, ["flower", "audit", str(app), "--nodes", "2", "--no-evidence", "--ray-cpus", "1",
                          "--run-config", "num-server-rounds=1 victim-batch=1 fraction-evaluate=0.0",
                          "--out", str(tmp_path / "out")])
    assert "the declaration keeps classifier.bias, classifier.weight on the nodes, but the app uploads it" in err
    assert not (tmp_path / "out").exists()


def test_error_run_config_token_without_a_value_and_a_declaration_that_raises(capsys, tmp_path):
    """A --run-config token without '=' (Flower's parser would drop it) and a declaration that raises
    on the run config it was given: one line each, exit 2, nothing written."""
    err = _fails(capsys, ["flower", "attack", str(EXAMPLE), "--attack", "ig", "--run-config", "bogus",
                          "--out", str(tmp_path / "out")])
    assert "--run-config expects space-separated key=value pairs" in err and "bogus" in err
    err = _fails(capsys, ["flower", "audit", str(EXAMPLE), "--no-evidence", "--run-config", "lr='x'",
                          "--out", str(tmp_path / "out")])
    assert "raised ValueError" in err and "--run-config" in err
    assert not (tmp_path / "out").exists()
