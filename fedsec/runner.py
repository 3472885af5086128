"""Library functions behind ``fedsec train`` (the CLI only parses flags and calls these).

A run directory holds ``config.json`` (resolved config, seed, package versions),
``metrics.csv`` (round, client, accuracy, loss), ``summary.json``, ``partition.csv`` (class counts
per client) and ``checkpoint.pt`` (written atomically after every round, so ``--resume`` continues
an interrupted run and ends with the same ``metrics.csv``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from fedecouple.backends import BACKENDS, import_ray, make_backend
from fedecouple.channel import ServerChannel
from fedecouple.data import load_dataset, make_partition
from fedecouple.data.dataset import ImageDataset
from fedecouple.data.partition import Partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth, VictimSetting, summarize
from fedecouple.errors import UserError
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.base import Method, TrainConfig
from fedecouple.models import check_architecture

from . import io
from .versions import package_versions

PAPER_PRESET = {"clients": 20, "local_epochs": 5, "rounds": 200, "join_ratio": 1.0,
                "hyperparameters": {"lam": 0.8, "mu": 2.0, "tau": 2.0}}


@dataclass
class RunConfig:
    method: str = "fedecouple"
    dataset: str = "mnist5k"
    data_dir: str | None = None
    download: bool = False
    partition: str = "pathological"
    classes_per_client: int = 3
    s: float = 20.0
    samples_per_client: int | None = None
    beta: float = 0.1
    test_fraction: float = 0.25
    clients: int = 10
    rounds: int = 3
    local_epochs: int = 1
    join_ratio: float = 1.0
    lr: float = 0.05
    batch_size: int = 10
    seed: int = 0
    arch: str | None = None
    threads: int | None = None
    backend: str = "sequential"
    ray_address: str | None = None
    hyperparameters: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    def federation_config(self) -> FederationConfig:
        return FederationConfig(rounds=self.rounds, join_ratio=self.join_ratio, seed=self.seed, arch=self.arch,
                                train=TrainConfig(lr=self.lr, batch_size=self.batch_size, local_epochs=self.local_epochs))


def build_method(config: RunConfig) -> Method:
    if config.method not in METHODS:
        raise UserError(f"unknown method {config.method!r}; choose one of: {', '.join(METHODS)}")
    accepted = set(getattr(METHODS[config.method], "__dataclass_fields__", {}))
    unknown = sorted(set(config.hyperparameters) - accepted)
    if unknown:
        raise UserError(f"method {config.method} has no hyperparameter {', '.join(unknown)}; "
                        f"it takes: {', '.join(sorted(accepted)) or 'none'}")
    return make_method(config.method, **config.hyperparameters)


@dataclass
class Prepared:
    config: RunConfig
    dataset: ImageDataset
    partition: Partition
    method: Method


def prepare(config: RunConfig) -> Prepared:
    """Validate the config and load everything; raises ``UserError`` before anything is written."""
    method = build_method(config)
    if config.clients < 1:
        raise UserError(f"--clients must be at least 1, got {config.clients}")
    config.federation_config().validate(config.clients)
    if config.backend not in BACKENDS:
        raise UserError(f"unknown backend {config.backend!r}; choose one of: {', '.join(BACKENDS)}")
    if config.ray_address and config.backend != "ray":
        raise UserError("--ray-address needs --backend ray")
    if config.backend == "ray":
        import_ray()  # a missing extra fails here, before anything is written
    dataset = load_dataset(config.dataset, config.data_dir, config.download)
    if config.arch:  # before anything trains or is written (report, defend and attack all start here)
        check_architecture(config.arch, dataset.image_size)
    partition = make_partition(dataset.labels.numpy(), config.clients, config.partition,
                               num_classes=dataset.num_classes, classes_per_client=config.classes_per_client,
                               s=config.s, samples_per_client=config.samples_per_client, beta=config.beta,
                               test_fraction=config.test_fraction, seed=config.seed)
    return Prepared(config, dataset, partition, method)


def build_federation(prep: Prepared, channel: ServerChannel | None = None, ground_truth: GroundTruth | None = None,
                     victim: VictimSetting | None = None) -> Federation:
    if prep.config.threads:
        torch.set_num_threads(prep.config.threads)
    backend = make_backend(prep.config.backend, prep.config.ray_address, prep.config.threads)
    return Federation(prep.method, prep.dataset, prep.partition, prep.config.federation_config(), channel=channel,
                      ground_truth=ground_truth, victim=victim, backend=backend)


def run_record(config: RunConfig) -> dict:
    """What goes into config.json: the resolved config, the method's hyperparameters, versions."""
    return {"config": config.to_dict(), "method_hyperparameters": build_method(config).hyperparameters(),
            "torch_threads": torch.get_num_threads(), "versions": package_versions()}


def write_metrics(out: Path, fed: Federation, config: RunConfig, seconds: float) -> dict:
    io.write_csv(out / "metrics.csv", pd.DataFrame(fed.metrics, columns=["round", "client", "accuracy", "loss"]))
    summary = {"method": config.method, "dataset": config.dataset, "partition": config.partition,
               "clients": config.clients, "rounds": fed.completed_rounds, "seed": config.seed,
               "seconds": round(seconds, 2), **summarize(fed.metrics)}
    summary.pop("round", None)
    io.write_json(out / "summary.json", summary)
    return summary


def train(config: RunConfig, out: str | Path | None, resume: bool = False,
          on_round: Callable[[int, dict], None] | None = None) -> dict:
    """Train ``config`` (or continue the run in ``out`` when ``resume``), checkpointing each round."""
    prep = prepare(config)
    fed = build_federation(prep)
    try:
        return _train(fed, prep, config, out, resume, on_round)
    finally:
        fed.close()  # e.g. shut down the Ray this run started


def _train(fed: Federation, prep: Prepared, config: RunConfig, out, resume, on_round) -> dict:
    out_path = Path(out) if out is not None else None
    spent = 0.0
    if out_path is not None:
        ckpt = out_path / "checkpoint.pt"
        if resume and ckpt.exists():
            state = io.load_torch(ckpt)
            fed.load_state_dict(state["federation"])
            spent = float(state.get("seconds", 0.0))
        else:
            io.write_json(out_path / "config.json", run_record(config))
            io.write_csv(out_path / "partition.csv",
                         prep.partition.class_counts(prep.dataset.labels.numpy()).reset_index())
    start = time.perf_counter()
    summary = summarize(fed.metrics) if fed.metrics else {}
    while fed.completed_rounds < config.rounds:
        rows = fed.run_round()
        summary = summarize(rows)
        if out_path is not None:
            seconds = spent + time.perf_counter() - start
            io.save_torch(out_path / "checkpoint.pt", {"federation": fed.state_dict(), "seconds": seconds})
            summary = write_metrics(out_path, fed, config, seconds)
        if on_round is not None:
            on_round(fed.completed_rounds - 1, summary)
    seconds = spent + time.perf_counter() - start
    if out_path is not None:
        return write_metrics(out_path, fed, config, seconds)
    return {"method": config.method, "rounds": fed.completed_rounds, **summarize(fed.metrics)}


def load_run_config(run_dir: str | Path) -> RunConfig:
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise UserError(f"{path} not found: --resume needs a run directory written by `fedsec train --out`")
    try:
        return RunConfig.from_dict(io.read_json(path)["config"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a valid fedsec config ({exc}); start a new run instead") from None
