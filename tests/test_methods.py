"""Every federated method: uploads exactly its manifest, servers see only the channel, it trains;
FedPAC's classifier collaboration; ``fedsec compare``."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pandas as pd
import pytest
import torch

from fedecouple.channel import Interceptor, Recorder, ServerChannel, Upload
from fedecouple.data import load_dataset, make_partition
from fedecouple.data.partition import Partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth
from fedecouple.errors import UserError
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.base import TrainConfig
from fedecouple.methods.training import train_head
from fedecouple.methods.fedpac import head_weight_matrix, solve_simplex_qp
from helpers import TEST_THREADS

ALL = list(METHODS)
COMMUNICATING = [m for m in ALL if METHODS[m].communicates]
ROUNDS, CLIENTS, BATCH, LR = 3, 4, 20, 0.1
SHORT = {"fedecouple": 1}  # the slowest method (DA, three phases) is well past chance after 1


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def partition(digits):
    return make_partition(digits.labels.numpy(), CLIENTS, "pathological", num_classes=10, classes_per_client=3, seed=0)


@pytest.fixture(scope="module")
def small(digits):
    """3 clients, 3 classes each, 40 training and 20 test images each: for channel plumbing."""
    full = make_partition(digits.labels.numpy(), 3, "pathological", num_classes=10, classes_per_client=3, seed=1)
    return Partition(full.scheme, full.num_classes, [t[:40] for t in full.train], [t[:20] for t in full.test])


class Counter(Interceptor):
    name = "counter"

    def __init__(self):
        self.seen: dict[tuple[int, int], int] = {}

    def on_upload(self, message):
        key = (message.round, message.client_id)
        self.seen[key] = self.seen.get(key, 0) + 1
        return message


def federation(method: str, dataset, part, rounds: int, interceptors=(), **config):
    channel = ServerChannel(list(interceptors), recorder=Recorder())
    cfg = FederationConfig(rounds=rounds, seed=0, train=TrainConfig(**config))
    fed = Federation(make_method(method), dataset, part, cfg, channel=channel, ground_truth=GroundTruth())
    return fed, channel


_RUNS: dict = {}


@pytest.fixture(scope="module")
def trained(digits, partition):
    """One recorded federation per method, ``ROUNDS`` rounds (``SHORT`` for the slow ones), built on
    first use and shared by the tests."""
    def get(method: str):
        if method not in _RUNS:
            counter = Counter()
            fed, channel = federation(method, digits, partition, SHORT.get(method, ROUNDS), [counter],
                                      batch_size=BATCH, lr=LR)
            fed.run()
            _RUNS[method] = (fed, channel, counter)
        return _RUNS[method]
    return get


def expected_names(spec, held: set[int]) -> dict[str, tuple]:
    """name → shape the manifest allows for a client holding ``held`` classes."""
    out = {}
    for f in spec:
        if f.per_class:
            out.update({f.name.format(k=k): f.shape for k in held})
        else:
            out[f.name] = f.shape
    return out


# ------------------------------------------------------------------------------------------------
# the manifest and the channel


def test_registry_and_paper_defaults():
    assert set(ALL) == {"fedecouple", "fedavg", "ft-fedavg", "fedper", "fedrep", "fedpac", "fedproto", "local"}
    assert make_method("fedproto").lam == 1.0
    assert make_method("fedpac").lam == 1.0 and make_method("fedpac").head_epochs == 1
    assert make_method("ft-fedavg").finetune_epochs == 1
    assert make_method("fedpac", lam=0.5).lam == 0.5
    with pytest.raises(UserError):
        make_method("fedprox")


def test_fedpac_optimiser_defaults_are_the_reference_codes_and_bad_values_are_refused():
    pac = make_method("fedpac")
    assert (pac.head_lr, pac.momentum, pac.weight_decay) == (0.1, 0.5, 5e-4)
    for bad in ({"head_lr": 0.0}, {"momentum": 1.0}, {"momentum": -0.1}, {"weight_decay": -1e-4}):
        with pytest.raises(UserError, match=next(iter(bad))):
            make_method("fedpac", **bad)


@pytest.mark.parametrize("method", ALL)
def test_uploads_are_exactly_the_manifest(method, trained, digits, partition):
    fed, channel, counter = trained(method)
    spec = fed.method.manifest(fed.model)
    kinds = {f.name: f.kind for f in spec}
    rec = channel.recorder
    if method == "local":
        assert spec == [] and rec.exchanges == {} and channel.bytes_up == channel.bytes_down == 0
        return
    assert len(rec.exchanges) == fed.completed_rounds * CLIENTS
    labels = digits.labels.numpy()
    for (rnd, cid), ex in rec.exchanges.items():
        assert ex.upload is not None, f"no upload recorded for client {cid} in round {rnd}"
        held = set(np.unique(labels[partition.train[cid]]).tolist())
        allowed = expected_names(spec, held)
        got = {k: tuple(v.shape) for k, v in ex.upload.tensors.items()}
        assert got == allowed, f"{method} client {cid} round {rnd}: {sorted(set(got) ^ set(allowed))}"
        for name, value in ex.upload.tensors.items():
            kind = kinds.get(name) or next(f.kind for f in spec if f.per_class
                                           and re.fullmatch(re.escape(f.name).replace(r"\{k\}", r"\d+"), name))
            assert (not value.is_floating_point()) == (kind in ("sample_count", "class_counts")), name
            assert torch.isfinite(value.double()).all(), name


@pytest.mark.parametrize("method", ALL)
def test_each_upload_seen_exactly_once(method, trained):
    fed, channel, counter = trained(method)
    if method == "local":
        assert counter.seen == {}
        return
    assert counter.seen == {(r, c): 1 for r in range(fed.completed_rounds) for c in range(CLIENTS)}
    assert set(channel.recorder.exchanges) == set(counter.seen)


class SetFloats(Interceptor):
    """Replaces every floating-point field of every upload by a constant."""

    name = "set-floats"

    def __init__(self, value: float):
        self.value = value

    def on_upload(self, message):
        tensors = {k: torch.full_like(v, self.value) if v.is_floating_point() else v
                   for k, v in message.tensors.items()}
        return Upload(message.round, message.client_id, tensors, dict(message.meta))


class DropUploads(Interceptor):
    name = "drop"

    def on_upload(self, message):
        return None


@pytest.mark.parametrize("method", COMMUNICATING)
def test_server_sees_only_the_channel(method, digits, small):
    """Uploads replaced in the channel fully determine the aggregate; dropped uploads change nothing."""
    fed, _ = federation(method, digits, small, 1, [SetFloats(0.5)])
    before = dict(fed.server)
    fed.run()
    assert fed.server.keys() != before.keys() or any(not torch.equal(fed.server[k], before[k]) for k in before)
    for name, value in fed.server.items():
        if value.is_floating_point():
            assert torch.allclose(value, torch.full_like(value, 0.5)), f"{method}: {name} did not come from the channel"

    fed, channel = federation(method, digits, small, 1, [DropUploads()])
    before = {k: v.clone() for k, v in fed.server.items()}
    fed.run()
    assert fed.server.keys() == before.keys()
    assert all(torch.equal(fed.server[k], before[k]) for k in before)
    assert all(ex.upload is None for ex in channel.recorder.exchanges.values())


# ------------------------------------------------------------------------------------------------
# training and per-method behaviour


@pytest.mark.parametrize("method", ALL)
def test_trains_and_beats_chance(method, trained, digits, partition):
    fed, _, _ = trained(method)
    labels = digits.labels.numpy()
    # chance = always predicting the client's most frequent test class (3 classes per client)
    chance = np.mean([np.bincount(labels[t]).max() / len(t) for t in partition.test])
    last = [r["accuracy"] for r in fed.metrics if r["round"] == fed.completed_rounds - 1]
    assert len(last) == CLIENTS
    assert np.mean(last) > chance + 0.15, f"{method}: {np.mean(last):.3f} vs chance {chance:.3f}"


def test_client_state_is_only_what_the_method_keeps(trained):
    expect = {"fedecouple": {"extractor", "classifier"}, "fedavg": set(), "ft-fedavg": set(),
              "fedper": {"classifier"}, "fedrep": {"classifier"}, "fedpac": {"classifier"},
              "fedproto": {"extractor", "classifier"}, "local": {"extractor", "classifier"}}
    assert set(expect) == set(ALL)
    for method, groups in expect.items():
        fed, _, _ = trained(method)
        for cid, state in fed.clients.items():
            assert {k.split(".")[0] for k in state} == groups, (method, cid)


@pytest.mark.parametrize("method", ["fedper", "fedrep"])
def test_head_never_leaves_the_client(method, trained):
    fed, channel, _ = trained(method)
    for ex in channel.recorder.exchanges.values():
        assert not any(k.startswith("classifier.") for k in ex.upload.tensors)
        assert not any(k.startswith("classifier.") for k in ex.download.tensors)
    assert all(k.startswith("global.extractor.") for k in fed.server)
    heads = [fed.clients[c]["classifier.weight"] for c in range(CLIENTS)]
    assert not torch.equal(heads[0], heads[1])  # personal heads diverge


def test_fedproto_sends_no_weights(trained):
    fed, channel, _ = trained("fedproto")
    for ex in channel.recorder.exchanges.values():
        assert all(re.fullmatch(r"(prototype|class_count)\.\d+", k) for k in ex.upload.tensors)
        assert "sample_count" not in ex.upload.tensors
        assert all(re.fullmatch(r"prototype\.\d+", k) for k in ex.download.tensors)
        dim = fed.model.feature_dim
        assert all(v.shape == (dim,) for k, v in ex.upload.tensors.items() if k.startswith("prototype."))
    # the global prototype of a class is the count-weighted mean of what the clients sent last round
    ups = [channel.recorder.get(ROUNDS - 1, c).upload.tensors for c in range(CLIENTS)]
    for name, proto in ((k[len("global."):], v) for k, v in fed.server.items()):
        k = name.split(".")[1]
        pairs = [(float(u[f"class_count.{k}"]), u[name]) for u in ups if name in u]
        expected = sum(n * p for n, p in pairs) / sum(n for n, _ in pairs)
        assert torch.allclose(proto, expected, atol=1e-6)


def test_fedavg_and_finetuning(trained, digits, partition):
    fed, channel, _ = trained("fedavg")
    assert all(state == {} for state in fed.clients.values())
    ft, ft_channel, _ = trained("ft-fedavg")
    # same training and the same channel as FedAvg: fine-tuning happens only at evaluation
    for key, ex in channel.recorder.exchanges.items():
        other = ft_channel.recorder.exchanges[key].upload.tensors
        assert ex.upload.tensors.keys() == other.keys()
        assert all(torch.equal(v, other[k]) for k, v in ex.upload.tensors.items())
    acc = lambda f: np.mean([r["accuracy"] for r in f.metrics if r["round"] == ROUNDS - 1])  # noqa: E731
    assert acc(ft) > acc(fed)  # fine-tuning on label-skewed clients helps


@pytest.mark.parametrize("method,head", [("fedrep", 1), ("fedpac", 1)])
def test_head_then_base_phases(method, head, trained, partition):
    fed, _, _ = trained(method)
    for cid in range(CLIENTS):
        phases = [r.phase for r in fed.ground_truth.batches[(ROUNDS - 1, cid)]]
        n = max(len(partition.train[cid]) // BATCH, 1)  # batches per epoch (a ragged last one is dropped)
        assert phases == ["classifier"] * (head * n) + ["extractor"] * n


def test_train_head_freezes_the_base(digits, partition):
    fed, _ = federation("fedrep", digits, partition, 1)
    ctx = fed.context(0, 0)
    base = {k: v.clone() for k, v in fed.model.extractor.state_dict().items()}
    head = fed.model.classifier.weight.detach().clone()
    train_head(ctx, fed.model, 1)
    assert all(torch.equal(v, base[k]) for k, v in fed.model.extractor.state_dict().items())
    assert not torch.equal(head, fed.model.classifier.weight)


# ------------------------------------------------------------------------------------------------
# FedPAC's classifier collaboration


def test_fedpac_download_is_the_combination_of_last_rounds_heads(trained):
    fed, channel, _ = trained("fedpac")
    rec = channel.recorder
    for t in range(1, ROUNDS):
        ups = [rec.get(t - 1, c).upload.tensors for c in range(CLIENTS)]
        h = torch.stack([u["h"].double() for u in ups])
        v = torch.stack([u["V"].double() / u["sample_count"].double() for u in ups])
        for i in range(CLIENTS):
            alpha, _ = solve_simplex_qp(head_weight_matrix(i, h, v), i)
            sent = rec.get(t, i).download.tensors
            for name in ("classifier.weight", "classifier.bias"):
                expected = sum(float(a) * u[name] for a, u in zip(alpha, ups))
                assert torch.allclose(sent[name], expected, atol=1e-5)


def test_fedpac_heads_do_not_depend_on_upload_order(digits, small):
    fed, channel = federation("fedpac", digits, small, 2)
    fed.run()
    ups = [channel.recorder.get(1, c).upload for c in range(3)]
    server_before = {k: v for k, v in fed.server.items()}
    results = [fed.method.aggregate(dict(server_before), list(p), 1) for p in itertools.permutations(ups)]
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        assert all(torch.equal(other[k], results[0][k]) for k in other)
    assert {f"head.{c}.classifier.weight" for c in range(3)} <= results[0].keys()


def test_fedpac_run_independent_of_client_processing_order(digits, small):
    class Reversed(Federation):
        def sample_clients(self, round):
            return list(reversed(super().sample_clients(round)))

    runs = []
    for cls in (Federation, Reversed):
        cfg = FederationConfig(rounds=2, seed=0, train=TrainConfig())
        fed = cls(make_method("fedpac"), digits, small, cfg)
        fed.run()
        runs.append(fed.server)
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.allclose(runs[0][k], runs[1][k], atol=1e-6) for k in runs[0])


def test_simplex_qp():
    rng = np.random.default_rng(0)
    for m in (2, 3, 6):
        a = rng.normal(size=(m, 4))
        p = a @ a.T + np.diag(rng.uniform(0.01, 1, m))
        alpha, ok = solve_simplex_qp(p, 0)
        assert ok and np.all(alpha >= 0) and np.isclose(alpha.sum(), 1.0)
        # no feasible point does better (a coarse check against random simplex points)
        trials = rng.dirichlet(np.ones(m), size=2000)
        assert alpha @ p @ alpha <= np.min(np.einsum("ij,jk,ik->i", trials, p, trials)) + 1e-6
    # identical clients, equal variance: the uniform combination is optimal
    alpha, ok = solve_simplex_qp(np.eye(3), 1)
    assert ok and np.allclose(alpha, 1 / 3, atol=1e-4)
    # not PSD (negative eigenvalue), NaN, zero, single client: never crash, always on the simplex
    for p, own in ((np.array([[1.0, 3.0], [3.0, 1.0]]), 0), (np.array([[np.nan, 0], [0, 1.0]]), 1),
                   (np.zeros((3, 3)), 2), (np.ones((1, 1)), 0), (-np.eye(3), 0)):
        alpha, _ = solve_simplex_qp(p, own)
        assert np.all(alpha >= 0) and np.isclose(alpha.sum(), 1.0)
    assert np.array_equal(solve_simplex_qp(np.array([[np.nan, 0], [0, 1.0]]), 1)[0], [0.0, 1.0])


# ------------------------------------------------------------------------------------------------
# fedsec compare


def test_compare_on_digits(tmp_path, monkeypatch, capsys):
    from fedsec import runner
    from fedsec.cli import main
    from fedsec.jobs import compare as cmp
    from fedsec.runner import RunConfig

    base = RunConfig.of(dataset="digits", clients=3, rounds=1, threads=TEST_THREADS)
    frame = cmp.compare(base, ["fedavg", "fedproto"], [0, 1], tmp_path, progress=False)
    table = pd.read_csv(tmp_path / "accuracy.csv")
    assert list(table.columns) == ["method", "seed", "mean_accuracy", "std_accuracy"]
    assert sorted(zip(table["method"], table["seed"])) == [("fedavg", 0), ("fedavg", 1), ("fedproto", 0), ("fedproto", 1)]
    assert len(frame) == 4 and table["mean_accuracy"].between(0, 1).all()
    md = (tmp_path / "accuracy.md").read_text()
    assert "| fedavg | 0, 1 |" in md and "| fedproto | 0, 1 |" in md and "±" in md
    for m in ("fedavg", "fedproto"):
        assert (tmp_path / m / "seed1" / "summary.json").exists()
    # same partition for every method of a seed
    parts = [pd.read_csv(tmp_path / m / "seed0" / "partition.csv") for m in ("fedavg", "fedproto")]
    pd.testing.assert_frame_equal(*parts)

    # resumable: finished runs are skipped
    def boom(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(runner, "train", boom)
    again = cmp.compare(base, ["fedavg", "fedproto"], [0, 1], tmp_path, progress=False)
    pd.testing.assert_frame_equal(again.reset_index(drop=True), frame.reset_index(drop=True))
    monkeypatch.undo()

    # a changed configuration in the same folder is refused, not overwritten
    with pytest.raises(UserError, match="different configuration"):
        cmp.compare(RunConfig.of(dataset="digits", clients=4, rounds=1), ["fedavg"], [0], tmp_path, progress=False)

    # unknown methods: one line, exit status 2
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--methods", "fedavg,nope", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown method nope") and "\n" not in err
    assert not (tmp_path / "x").exists()
