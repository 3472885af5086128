"""Execution backends: the Ray backend gives the same numbers, the same channel traffic and the same
interceptor calls as the sequential one; a missing Ray is a one-line error naming the extra."""
import importlib.util
import sys

import numpy as np
import pytest
import torch

from fedecouple.backends import RayBackend, SequentialBackend, make_backend
from fedecouple.channel import Interceptor
from fedecouple.errors import UserError
from fedsec.jobs.attack import AttackSettings, run_attack
from fedsec.runner import RunConfig, prepare, train

from helpers import run_python, tiny_federation
from helpers import TEST_THREADS

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install -e '.[ray]'; CI installs it)")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray started inside the test module and shut down after it (one the Flower tests keep
    running in this worker, ``shared_ray``, is stopped first; their next simulation starts it again)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


class Log(Interceptor):
    """Remembers every message it is shown, in order."""

    name = "log"

    def __init__(self):
        self.events = []

    def on_download(self, message):
        self.events.append(("down", message.round, message.client_id))
        return message

    def on_upload(self, message):
        self.events.append(("up", message.round, message.client_id))
        return message


def _run(digits, method, backend, rounds=2, interceptors=()):
    torch.set_num_threads(TEST_THREADS)
    fed = tiny_federation(digits, method=method, clients=3, rounds=rounds, interceptors=interceptors, backend=backend)
    fed.run()
    return fed


def _same_rows(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == y[k] or (np.isnan(x[k]) and np.isnan(y[k])), (k, x, y)


def _same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@needs_ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fedecouple", "fedper"])
def test_ray_gives_identical_metrics_and_uploads(digits, ray_local, method):
    seq = _run(digits, method, SequentialBackend())
    with RayBackend(threads=TEST_THREADS) as backend:
        par = _run(digits, method, backend)
    assert ray_local.is_initialized()  # a Ray the backend did not start is left running
    _same_rows(seq.metrics, par.metrics)
    assert len(seq.metrics) == 6
    assert sorted(seq.channel.recorder.exchanges) == sorted(par.channel.recorder.exchanges)
    for key, ex in seq.channel.recorder.exchanges.items():
        other = par.channel.recorder.exchanges[key]
        _same_tensors(ex.download.tensors, other.download.tensors)
        _same_tensors(ex.upload.tensors, other.upload.tensors)
    for cid in seq.clients:
        _same_tensors(seq.clients[cid], par.clients[cid])
    _same_tensors(seq.server, par.server)
    assert seq.ground_truth.batches.keys() == par.ground_truth.batches.keys()
    for key, batches in seq.ground_truth.batches.items():
        other = par.ground_truth.batches[key]
        assert [b.phase for b in batches] == [b.phase for b in other]
        assert all(np.array_equal(a.indices, b.indices) for a, b in zip(batches, other))
        _same_tensors(seq.ground_truth.private[key], par.ground_truth.private[key])


@needs_ray
@pytest.mark.timeout(300)
def test_interceptors_see_every_message_once_in_client_order(digits, ray_local):
    seq_log, ray_log = Log(), Log()
    _run(digits, "fedecouple", SequentialBackend(), interceptors=[seq_log])
    with RayBackend(threads=TEST_THREADS) as backend:
        _run(digits, "fedecouple", backend, interceptors=[ray_log])
    expected = [(kind, r, c) for r in range(2) for kind in ("down", "up") for c in range(3)]
    assert seq_log.events == expected
    assert ray_log.events == expected


@needs_ray
@pytest.mark.timeout(300)
def test_dropped_download_skips_the_client_under_ray(digits, ray_local):
    class DropOne(Interceptor):
        def on_download(self, message):
            return None if message.client_id == 1 else message

    with RayBackend(threads=TEST_THREADS) as backend:
        fed = _run(digits, "fedavg", backend, rounds=1, interceptors=[DropOne()])
    assert (0, 1) not in fed.ground_truth.batches and (0, 0) in fed.ground_truth.batches
    assert fed.channel.recorder.get(0, 1).upload is None


@needs_ray
@pytest.mark.timeout(300)
def test_train_writes_the_same_metrics_csv_under_both_backends(tmp_path, ray_local):
    fast = dict(method="fedecouple", dataset="digits", clients=3, rounds=2, seed=0, threads=TEST_THREADS)
    train(RunConfig.of(**fast), tmp_path / "seq")
    train(RunConfig.of(**fast, backend="ray"), tmp_path / "ray")
    assert ray_local.is_initialized()
    assert (tmp_path / "seq" / "metrics.csv").read_text() == (tmp_path / "ray" / "metrics.csv").read_text()


@needs_ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("batched", [True, False])
def test_attack_writes_the_same_attack_csv_under_both_backends(tmp_path, ray_local, batched):
    """Attacks fan out as Ray tasks (one per batch of targets sharing a model, or one per target)."""
    fast = dict(method="fedavg", dataset="digits", clients=4, seed=0, threads=TEST_THREADS)
    for backend in ("sequential", "ray"):
        run_attack(RunConfig.of(**fast, backend=backend), AttackSettings("dlg", targets=3, iterations=8, batched=batched),
                   out=tmp_path / backend, progress=False)
    assert ray_local.is_initialized()
    seq = (tmp_path / "sequential" / "attack.csv").read_text()
    assert seq == (tmp_path / "ray" / "attack.csv").read_text()
    assert len(seq.strip().splitlines()) == 4


def test_missing_ray_is_a_user_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(UserError, match=r"pip install ray \(from a checkout: pip install -e '\.\[ray\]'\)"):
        make_backend("ray")
    with pytest.raises(UserError, match=r"pip install -e '\.\[ray\]'"):
        prepare(RunConfig.of(dataset="digits", clients=3, backend="ray"))


def test_backend_flag_errors():
    with pytest.raises(UserError, match="--ray-address needs --backend ray"):
        prepare(RunConfig.of(dataset="digits", clients=3, ray_address="auto"))
    with pytest.raises(UserError, match="unknown backend"):
        make_backend("dask")


def test_cli_backend_flag_is_one_line_error_without_ray(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from fedsec.cli import main; "
            "main(['train', '--dataset', 'digits', '--clients', '3', '--rounds', '1', '--backend', 'ray'])")
    res = run_python(code, timeout=120, cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "pip install -e '.[ray]'" in res.stderr


@needs_ray
@pytest.mark.timeout(300)
def test_user_errors_in_a_ray_task_reach_the_driver_as_user_errors(digits, ray_local):
    with RayBackend(threads=TEST_THREADS) as backend:
        fed = tiny_federation(digits, method="fedavg", clients=2, lr=1e9, backend=backend)
        with pytest.raises(UserError, match="diverged"):
            fed.run_round()
    with pytest.raises(UserError, match="lower threads"):
        RayBackend(threads=64)
