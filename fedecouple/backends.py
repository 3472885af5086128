"""Execution backends: where a round's client updates run.

The driver (``Federation.run_round``) sends every download through the server channel, hands the
round's client updates to a backend, then sends the uploads back through the channel in client
order. A backend runs ``method.client_update`` for a list of ``ClientJob`` objects and returns one
``ClientResult`` per job, in the same order; its ``map`` runs other independent work the same way
(``fedsec attack`` fans its batches of targets out through it):

* ``SequentialBackend``: one after another in this process, on the driver's workspace model (the
  default; what the engine always did);
* ``RayBackend``: one Ray task per client. The data set's tensors go into the object store once
  (``ray.put``), each task rebuilds its workspace model from a ``ModelSpec``, and the client's
  persistent state travels with the task and comes back with the result.

Both build the client's context and seed it the same way (``run_update``): the batch-order
generator is seeded with ``derive_seed(seed, round, client, 1)`` and torch's global generator with
``derive_seed(seed, round, client, 2)`` right before the update, so the same seed gives the same
numbers under either backend — provided the torch thread count is the same too (floating-point
reductions in convolutions depend on it). Ray workers use ``threads`` torch threads (default 1,
one per reserved CPU); the driver uses the process's setting (``torch.set_num_threads``), so set both
to 1 for results bit-identical to a sequential run.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from dataclasses import replace

from .channel import Download, Upload
from .data.dataset import ImageDataset
from .devices import is_cuda, to_device
from .errors import DIVERGED, UserError
from .methods.base import BatchRecord, ClientContext, Method, State, TrainConfig
from .models import SplitModel, build_custom, build_model, check_architecture, check_fits, default_architecture

BACKENDS = ("sequential", "ray")
RAY_HINT = "pip install ray (from a checkout: pip install -e '.[ray]')"


@dataclass(frozen=True)
class ModelSpec:
    """Enough to rebuild the workspace model anywhere (its weights are always set by the method):
    a built-in architecture, or the user's ``factory`` (``package.module:factory``, the federation's
    ``model``), on ``device``."""

    arch: str
    channels: int
    image_size: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    factory: str | None = None
    device: str = "cpu"

    @classmethod
    def for_data(cls, dataset: ImageDataset, arch: str | None = None, factory: str | None = None,
                 device: str = "cpu") -> "ModelSpec":
        """The model a federation on ``dataset`` trains: ``factory`` if given, else ``arch``, else the
        image size's default architecture."""
        arch = factory or arch or default_architecture(dataset.channels, dataset.image_size)
        return cls(arch, dataset.channels, dataset.image_size, dataset.num_classes, tuple(dataset.mean),
                   tuple(dataset.std), factory, str(device))

    def build(self) -> SplitModel:
        if self.factory:
            model = build_custom(self.factory)
        else:
            model = build_model(self.arch, self.channels, self.image_size, self.num_classes, self.mean, self.std)
        return model.to(self.device)

    def check(self) -> None:
        """A one-line UserError unless the model exists and fits the data set's images and classes
        (before anything trains; a user's factory is built once, on the CPU)."""
        if not self.factory:
            check_architecture(self.arch, self.image_size)
            return
        with torch.random.fork_rng(devices=[]):  # checking draws no number a run would draw
            model = build_custom(self.factory)
        check_fits(model, self.channels, self.image_size, self.num_classes, f"model {self.factory!r}",
                   fields=("model",))


@dataclass
class ClientJob:
    """One client update: what the client received, its kept state, which of the pooled samples it
    trains on, its training config and its seeds."""

    client_id: int
    round: int
    download: Download
    state: State
    indices: np.ndarray
    config: TrainConfig
    generator_seed: int  # batch order: torch.Generator().manual_seed(generator_seed)
    torch_seed: int  # torch.manual_seed(torch_seed) right before client_update (augmentation draws)
    steps_per_phase: int | None = None


@dataclass
class ClientResult:
    client_id: int
    state: State
    upload: Upload
    indices: np.ndarray  # the client's local training set (pool indices): the ground-truth hook's
    batch_log: list[BatchRecord] = field(default_factory=list)
    private: dict[str, torch.Tensor] = field(default_factory=dict)


def make_context(client_id: int, round: int, images: torch.Tensor, labels: torch.Tensor, indices: np.ndarray,
                 model: SplitModel, config: TrainConfig, num_classes: int, generator_seed: int,
                 steps_per_phase: int | None = None) -> ClientContext:
    """A client's context over ``images``/``labels`` (already restricted to ``indices``)."""
    gen = torch.Generator().manual_seed(generator_seed)
    return ClientContext(client_id, round, images, labels, indices, model, config, num_classes, gen,
                         steps_per_phase=steps_per_phase)


def run_update(method: Method, job: ClientJob, images: torch.Tensor, labels: torch.Tensor, model: SplitModel,
               num_classes: int) -> ClientResult:
    """Run one client update exactly as the engine always has (same context, same seeding).

    It computes where ``model`` lives: the client's data, kept state and download move there, and
    its state, upload and private values come back to the CPU, where the channel and the server
    keep everything (no copies on the CPU)."""
    device = next(model.parameters()).device
    ctx = make_context(job.client_id, job.round, images.to(device), labels.to(device), job.indices, model,
                       job.config, num_classes, job.generator_seed, job.steps_per_phase)
    torch.manual_seed(job.torch_seed)
    download = job.download if device.type == "cpu" else \
        replace(job.download, tensors=to_device(job.download.tensors, device))
    state, upload = method.client_update(ctx, to_device(job.state, device), download)
    check_finite_upload(upload, job.client_id, job.round)
    if device.type != "cpu":
        state, upload = to_device(state, "cpu"), replace(upload, tensors=to_device(upload.tensors, "cpu"))
    return ClientResult(job.client_id, state, upload, job.indices, ctx.batch_log, to_device(ctx.private, "cpu"))


def check_finite_upload(upload: Upload, client_id: int, round: int) -> None:
    """A one-line error where a client's upload holds a non-finite number: its training diverged
    although every loss stayed finite (e.g. features overflowing into a prototype), and an upload
    like that would poison the server's average and every attack on it."""
    bad = [name for name, t in upload.tensors.items()
           if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise UserError(f"{DIVERGED} (non-finite upload: {', '.join(bad[:3])}) on client {client_id} in round "
                        f"{round}; lower lr", fields=("lr",))


class Backend:
    """Runs a round's client updates; results come back in job order.

    ``jobs`` may be a lazy iterable (the engine passes each download through the channel as the
    backend asks for the next job): a backend must not assume it can iterate it twice.
    """

    name = "backend"

    def run_updates(self, method: Method, dataset: ImageDataset, spec: ModelSpec, workspace: SplitModel,
                    jobs: Iterable[ClientJob]) -> list[ClientResult]:
        raise NotImplementedError

    def map(self, function: Callable, arguments: Sequence[tuple], threads: int = 1,
            on_result: Callable[[int], None] | None = None) -> list:
        """``[function(*args) for args in arguments]``, run where this backend runs work, each call
        with ``threads`` torch threads; ``on_result(i)`` is called as call i finishes (e.g. a
        progress bar). Used to fan attacks on many targets out like client updates."""
        raise NotImplementedError

    def close(self) -> None:
        """Release whatever the backend started (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SequentialBackend(Backend):
    """Every update in this process, one after another, on the driver's workspace model."""

    name = "sequential"

    def run_updates(self, method, dataset, spec, workspace, jobs):
        results = []
        for job in jobs:
            idx = torch.from_numpy(job.indices)
            results.append(run_update(method, job, dataset.images[idx], dataset.labels[idx], workspace,
                                      dataset.num_classes))
        return results

    def map(self, function, arguments, threads=1, on_result=None):
        out = []
        for i, args in enumerate(arguments):
            out.append(_call_with_threads(function, args, threads))
            if on_result is not None:
                on_result(i)
        return out


def _call_with_threads(function: Callable, args: tuple, threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return function(*args)
    finally:
        torch.set_num_threads(previous)


def import_ray():
    """``ray``, or a UserError naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise UserError(f"backend ray needs Ray, which is not installed: {RAY_HINT}", fields=("backend",)) from None
    return ray


def _ray_task(method: Method, spec: ModelSpec, images: np.ndarray, labels: np.ndarray, job: ClientJob,
              threads: int) -> ClientResult:
    """Body of one Ray task (runs in a worker). ``images``/``labels`` arrive from the object store
    as read-only zero-copy arrays; indexing copies out just this client's samples."""
    torch.set_num_threads(threads)
    if is_cuda(spec.device):  # Ray shows a task only the GPU it reserved, as cuda:0
        spec = replace(spec, device="cuda")
    model = spec.build()  # before seeding: building draws from torch's generator
    x = torch.from_numpy(images[job.indices])
    y = torch.from_numpy(labels[job.indices])
    return run_update(method, job, x, y, model, spec.num_classes)


def _ray_warmup(threads: int) -> int:
    torch.set_num_threads(threads)
    import fedecouple.methods  # noqa: F401  (import the package once per worker)
    return os.getpid()


def start_local_ray(num_cpus: int | None = None, **kwargs) -> None:
    """``ray.init`` a local Ray with ``num_cpus`` CPUs (default: this machine's cores), quiet, no
    dashboard, and workers at normal priority: Ray runs workers at niceness 15 by default, which on
    a machine shared with other jobs starves client updates that the sequential backend would run
    at niceness 0."""
    import logging

    ray = import_ray()
    ray.init(num_cpus=num_cpus or local_cpus(), include_dashboard=False, logging_level=logging.WARNING,
             _system_config={"worker_niceness": 0}, **kwargs)


def local_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class RayBackend(Backend):
    """One Ray task per client update.

    ``address`` joins an existing cluster (``ray.init(address=...)``; every node needs fedsec
    installed); without it a local Ray starts with ``num_cpus`` CPUs (default: this machine's
    cores). A Ray already initialised in this process is reused and left running. Each task
    reserves ``threads`` CPUs and runs torch with that many threads; on a CUDA ``device`` each task
    also asks Ray for a share of a GPU (``num_gpus``: the cluster's GPUs divided among as many
    tasks as its CPUs run at once, at most one whole GPU per task).
    """

    name = "ray"

    def __init__(self, address: str | None = None, threads: int | None = None, num_cpus: int | None = None,
                 device: str = "cpu"):
        self.ray = import_ray()
        self.threads = int(threads) if threads else 1
        if self.threads < 1:
            raise UserError(f"threads must be at least 1, got {threads}", fields=("threads",))
        self._started = False
        if not self.ray.is_initialized():
            if address:
                import logging

                self.ray.init(address=address, logging_level=logging.WARNING)
            else:
                start_local_ray(num_cpus)
            self._started = True
        try:
            self._check_cpus(self.threads, "client update")
        except UserError:
            self.close()
            raise
        self.num_gpus = self._gpu_share(device)
        self._task = self.ray.remote(_ray_task).options(num_cpus=self.threads, num_gpus=self.num_gpus)
        self._data: tuple[ImageDataset, object, object] | None = None

    def _check_cpus(self, threads: int, per: str) -> None:
        """A task reserving more CPUs than the cluster has would wait forever: say so instead."""
        cpus = self.ray.cluster_resources().get("CPU", 0)
        if threads > cpus:
            raise UserError(f"threads {threads} asks more CPUs per {per} than the Ray cluster has ({cpus:g}); "
                            f"lower threads", fields=("threads",))

    def _gpu_share(self, device: str) -> float:
        """GPUs one task asks for: 0 on the CPU; a CUDA device on a cluster without GPUs is an error."""
        if not is_cuda(device):
            return 0
        gpus = self.ray.cluster_resources().get("GPU", 0)
        if gpus <= 0:
            self.close()
            raise UserError(f"device {device} with backend ray: the Ray cluster has no GPUs",
                            fields=("device", "backend"))
        return min(1.0, gpus / self.workers())

    def workers(self) -> int:
        """How many updates can run at once on the cluster."""
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)) // self.threads)

    def warm_up(self) -> None:
        """Start the worker processes and import torch and fedecouple in each (first-round latency)."""
        task = self.ray.remote(_ray_warmup).options(num_cpus=self.threads)
        self.ray.get([task.remote(self.threads) for _ in range(self.workers())])

    def _dataset_refs(self, dataset: ImageDataset):
        if self._data is None or self._data[0] is not dataset:
            self._data = (dataset, self.ray.put(dataset.images.numpy()), self.ray.put(dataset.labels.numpy()))
        return self._data[1], self._data[2]

    def run_updates(self, method, dataset, spec, workspace, jobs):
        images, labels = self._dataset_refs(dataset)
        method_ref, spec_ref = self.ray.put(method), self.ray.put(spec)
        refs = [self._task.remote(method_ref, spec_ref, images, labels, job, self.threads) for job in jobs]
        with self._user_errors():
            return self.ray.get(refs) if refs else []

    @contextmanager
    def _user_errors(self):
        """A UserError raised in a task (e.g. "training diverged ...; lower lr") surfaces as itself:
        one line, as under the sequential backend."""
        try:
            yield
        except self.ray.exceptions.RayTaskError as exc:
            if isinstance(getattr(exc, "cause", None), UserError):
                raise exc.cause from None
            raise

    def map(self, function, arguments, threads=1, on_result=None):
        self._check_cpus(threads, "task")
        remote = self.ray.remote(_call_with_threads).options(num_cpus=threads, num_gpus=self.num_gpus)
        function_ref = self.ray.put(function)
        refs = [remote.remote(function_ref, args, threads) for args in arguments]
        position = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        with self._user_errors():
            try:
                while pending:
                    done, pending = self.ray.wait(pending, num_returns=1)
                    self.ray.get(done)  # a failed call raises here, at once, as it would in sequence
                    if on_result is not None:
                        on_result(position[done[0]])
            except BaseException:
                for ref in pending:
                    self.ray.cancel(ref)
                raise
            return self.ray.get(refs)

    def close(self) -> None:
        self._data = None
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()
        self._started = False


def make_backend(backend: str = "sequential", address: str | None = None, threads: int | None = None,
                 device: str = "cpu") -> Backend:
    """The backend named ``backend``; ``address`` (a Ray cluster's), ``threads`` and ``device`` as
    ``RayBackend`` takes them."""
    if backend == "sequential":
        if address:
            raise UserError("address needs backend ray", fields=("address", "backend"))
        return SequentialBackend()
    if backend == "ray":
        return RayBackend(address=address, threads=threads, device=device)
    raise UserError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
