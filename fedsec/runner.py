"""Library functions behind ``fedsec train`` (the CLI only parses flags and calls these).

A run directory holds ``config.json`` (resolved config, seed, package versions),
``metrics.csv`` (round, client, accuracy, loss), ``summary.json``, ``partition.csv`` (class counts
per client) and ``checkpoint.pt`` (written atomically after every round, so ``--resume`` continues
an interrupted run and ends with the same ``metrics.csv``).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import re
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import torch

from fedecouple.backends import BACKENDS, ModelSpec, import_ray, make_backend
from fedecouple.channel import ServerChannel
from fedecouple.data import load_dataset, make_partition
from fedecouple.data.dataset import ImageDataset
from fedecouple.data.partition import Partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth, VictimSetting, summarize
from fedecouple.errors import UserError
from fedecouple.methods import make_method, method_class
from fedecouple.methods.base import Method, TrainConfig
from fedecouple.secure_aggregation import SecureAggregation
from fedecouple.devices import deterministic, device_record, resolve_device

from . import io
from .versions import provenance

# ``--preset paper``: the paper's federation (Section V); each method adds its own ``paper_preset``
PAPER_FEDERATION = {"clients": 20, "local_epochs": 5, "rounds": 200, "join_ratio": 1.0}
# ``--preset audit``: a federation trained to a useful accuracy in minutes (report and attack add the
# audit's attack plan: ``fedsec.jobs.report.audit_preset``)
AUDIT_FEDERATION = {"clients": 20, "rounds": 20, "join_ratio": 1.0}


@dataclass
class DataConfig:
    """Which data set, where it lives, and how it is split over clients."""

    dataset: str = "mnist5k"
    data_dir: str | None = None
    download: bool = False
    partition: str = "pathological"
    classes_per_client: int = 3
    s: float = 20.0
    samples_per_client: int | None = None
    train_images: int | None = None  # every client trains on exactly this many images (any partition)
    beta: float = 0.1
    test_fraction: float = 0.25
    clients: int = 10


@dataclass
class ExecutionConfig:
    """Where the computation runs. Same seed and same ``threads`` give the same numbers on every
    backend, so none of this is part of a result's identity (``RESULT_NEUTRAL``). The device is the
    federation's (``FederationConfig.device``): a GPU's floats differ from the CPU's in the last
    bits, so its numbers are its own."""

    threads: int | None = None
    backend: str = "sequential"
    ray_address: str | None = None


@dataclass
class SecureConfig:
    """``--secure-aggregation`` and the protocol's parameters (``fedecouple.secure_aggregation``, with the
    meaning Flower's ``SecAggPlusWorkflow`` gives them; defaults: its own, every pair masking). Off: the
    server sees every upload."""

    secure_aggregation: bool = False
    sa_clipping_range: float = SecureAggregation.clipping_range
    sa_quantization_range: int = SecureAggregation.quantization_range
    sa_modulus: int = SecureAggregation.modulus
    sa_num_shares: int | float = SecureAggregation.num_shares
    sa_threshold: int | float = SecureAggregation.reconstruction_threshold
    sa_max_weight: float = SecureAggregation.max_weight
    sa_clear_fields: str = SecureAggregation.clear_fields

    def protocol(self, seed: int) -> SecureAggregation | None:
        """The protocol (None: off); a bad combination of values is a one-line error naming the flags."""
        if not self.secure_aggregation:
            return None
        try:
            return SecureAggregation(clipping_range=self.sa_clipping_range,
                                     quantization_range=self.sa_quantization_range, modulus=self.sa_modulus,
                                     num_shares=self.sa_num_shares, reconstruction_threshold=self.sa_threshold,
                                     max_weight=self.sa_max_weight, seed=seed, clear_fields=self.sa_clear_fields)
        except UserError as exc:  # the engine names its own fields; the user gave flags
            raise UserError(_PROTOCOL_FIELD.sub(lambda m: PROTOCOL_FLAGS[m.group(0)], str(exc))) from None


# the protocol's fields (``SecureAggregation``) and the flags that set them
PROTOCOL_FLAGS = {"clipping_range": "--sa-clipping-range", "quantization_range": "--sa-quantization-range",
                  "modulus": "--sa-modulus", "num_shares": "--sa-num-shares",
                  "reconstruction_threshold": "--sa-threshold", "max_weight": "--sa-max-weight",
                  "clear_fields": "--sa-clear-fields"}
_PROTOCOL_FIELD = re.compile(r"\b(" + "|".join(PROTOCOL_FLAGS) + r")\b")


# the settings that never change a result: where the data lives and how (where) it is computed
RESULT_NEUTRAL = ("data_dir", "download", "threads", "backend", "ray_address")
# settings left out of a result's key at these values, so results written before they existed
# (CPU runs of the built-in architectures) keep the keys they had
OMITTED_AT_DEFAULT = {"device": "cpu", "model": None, "train_images": None, "dropout": 0.0,
                      **{f.name: f.default for f in fields(SecureConfig)}}


@dataclass
class RunConfig:
    """One federation run: the method and its hyperparameters, the data, the federation (rounds,
    seed, local training) and where it executes. ``to_dict``/``from_dict`` use one flat namespace
    (the CLI's flag names), which is what ``config.json`` holds."""

    method: str = "fedecouple"
    data: DataConfig = field(default_factory=DataConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    hyperparameters: dict = field(default_factory=dict)
    secure: SecureConfig = field(default_factory=SecureConfig)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        """From the flat namespace; missing keys take their defaults, unknown keys are ignored
        (config.json files of older versions load)."""
        known = {k: v for k, v in data.items() if k in _FLAT}
        return cls.of(**known)

    @classmethod
    def of(cls, **flat) -> "RunConfig":
        """From flat keyword arguments (``RunConfig.of(method="fedper", clients=20, lr=0.1)``)."""
        unknown = sorted(set(flat) - set(_FLAT))
        if unknown:
            raise TypeError(f"RunConfig has no setting {', '.join(unknown)}")
        parts = {name: {k: v for k, v in flat.items() if _FLAT[k] == name} for name in _PARTS}
        federation = FederationConfig()
        train = replace(federation.train, **parts.pop("train"))
        return cls(method=flat.get("method", "fedecouple"), data=DataConfig(**parts["data"]),
                   federation=replace(federation, train=train, **parts["federation"]),
                   execution=ExecutionConfig(**parts["execution"]),
                   hyperparameters=dict(flat.get("hyperparameters") or {}), secure=SecureConfig(**parts["secure"]))

    def to_dict(self) -> dict:
        federation = asdict(self.federation)
        train = federation.pop("train")
        return {"method": self.method, **asdict(self.data), **federation, **train, **asdict(self.execution),
                "hyperparameters": dict(self.hyperparameters), **asdict(self.secure)}

    def updated(self, **flat) -> "RunConfig":
        """A copy with some flat settings changed (``config.updated(rounds=5, method="fedper")``)."""
        return RunConfig.of(**{**self.to_dict(), **flat})

    def result_key(self) -> dict:
        """The settings a result depends on (everything but ``RESULT_NEUTRAL``), JSON-normalised:
        two runs with equal keys give the same numbers."""
        return {k: v for k, v in json.loads(json.dumps(self.to_dict(), sort_keys=True)).items()
                if k not in RESULT_NEUTRAL and not (k in OMITTED_AT_DEFAULT and v == OMITTED_AT_DEFAULT[k])}


_PARTS = ("data", "federation", "train", "execution", "secure")
_FLAT = {"method": None, "hyperparameters": None,
         **{f.name: "data" for f in fields(DataConfig)}, **{f.name: "execution" for f in fields(ExecutionConfig)},
         **{f.name: "secure" for f in fields(SecureConfig)},
         **{f.name: "federation" for f in fields(FederationConfig) if f.name != "train"},
         **{f.name: "train" for f in fields(TrainConfig)}}


def build_method(config: RunConfig) -> Method:
    """The configured method; unknown names and hyperparameters are one-line errors."""
    cls = method_class(config.method)
    unknown = sorted(set(config.hyperparameters) - set(cls.hyperparameter_names()))
    if unknown:
        raise UserError(f"method {config.method} has no hyperparameter {', '.join(unknown)}; "
                        f"it takes: {', '.join(cls.hyperparameter_names()) or 'none'}")
    return make_method(config.method, **config.hyperparameters)


class DatasetCache:
    """Data sets loaded once and shared by every run that reads them (runs only read the tensors)."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str], ImageDataset] = {}

    def load(self, name: str, data_dir=None, download: bool = False) -> ImageDataset:
        key = (name, str(data_dir))
        if key not in self._loaded:
            self._loaded[key] = load_dataset(name, data_dir, download)
        return self._loaded[key]


# the cache ``prepare`` reads from while a ``shared_datasets()`` block runs (None: load every time)
_DATASETS: contextvars.ContextVar[DatasetCache | None] = contextvars.ContextVar("fedsec_datasets", default=None)


@contextlib.contextmanager
def shared_datasets() -> Iterator[DatasetCache]:
    """Within the block every ``prepare`` loads each data set once (a comparison, a report, an attack
    and its time estimate); a block inside another shares the outer block's cache."""
    cache = _DATASETS.get()
    if cache is not None:
        yield cache
        return
    token = _DATASETS.set(DatasetCache())
    try:
        yield _DATASETS.get()
    finally:
        _DATASETS.reset(token)


def _load(data: DataConfig) -> ImageDataset:
    cache = _DATASETS.get()
    if cache is None:
        return load_dataset(data.dataset, data.data_dir, data.download)
    return cache.load(data.dataset, data.data_dir, data.download)


@dataclass
class Prepared:
    config: RunConfig
    dataset: ImageDataset
    partition: Partition
    method: Method


def prepare(config: RunConfig) -> Prepared:
    """Validate the config and load everything; raises ``UserError`` before anything is written."""
    method = build_method(config)
    data, execution = config.data, config.execution
    if data.clients < 1:
        raise UserError(f"--clients must be at least 1, got {data.clients}")
    config.federation.validate(data.clients)
    if config.secure.protocol(config.federation.seed) is not None and (refusal := method.secure_refusal()):
        raise UserError(refusal)  # before any data is loaded (the protocol's parameters are checked above)
    if data.train_images is not None and data.samples_per_client is not None and data.partition != "weak":
        raise UserError(f"give --train-images or --samples-per-client, not both: outside the weak partition "
                        f"--samples-per-client caps the training set (at most N), --train-images fixes it (exactly N)")
    if execution.backend not in BACKENDS:
        raise UserError(f"unknown backend {execution.backend!r}; choose one of: {', '.join(BACKENDS)}")
    if execution.ray_address and execution.backend != "ray":
        raise UserError("--ray-address needs --backend ray")
    if execution.backend == "ray":
        import_ray()  # a missing extra fails here, before anything is written
    if config.federation.model and config.federation.arch:
        raise UserError("give --arch or --model, not both (--model is your own architecture)")
    device = resolve_device(config.federation.device)  # e.g. a GPU machine's config.json resumed on a CPU-only one
    if execution.backend == "ray" and device.startswith("cuda:"):
        raise UserError(f"--device {device} with --backend ray: Ray gives each task the GPU it reserved; "
                        f"use --device cuda")
    dataset = _load(data)
    # before anything trains or is written (report, defend and attack start here)
    ModelSpec.for_data(dataset, config.federation.arch, config.federation.model).check()
    partition = make_partition(dataset.labels.numpy(), data.clients, data.partition,
                               num_classes=dataset.num_classes, classes_per_client=data.classes_per_client,
                               s=data.s, samples_per_client=data.samples_per_client, beta=data.beta,
                               test_fraction=data.test_fraction, seed=config.federation.seed,
                               train_images=data.train_images)
    return Prepared(config, dataset, partition, method)


def build_federation(prep: Prepared, channel: ServerChannel | None = None, ground_truth: GroundTruth | None = None,
                     victim: VictimSetting | None = None) -> Federation:
    execution = prep.config.execution
    if execution.threads:
        torch.set_num_threads(execution.threads)
    deterministic(prep.config.federation.device)
    backend = make_backend(execution.backend, execution.ray_address, execution.threads, prep.config.federation.device)
    protocol = prep.config.secure.protocol(prep.config.federation.seed)
    if protocol is not None:
        channel = channel if channel is not None else ServerChannel()
        channel.recorder.secure = protocol  # the channel reads it there
    return Federation(prep.method, prep.dataset, prep.partition, prep.config.federation, channel=channel,
                      ground_truth=ground_truth, victim=victim, backend=backend)


def run_record(config: RunConfig, method: Method) -> dict:
    """What goes into config.json: the resolved config, the method's hyperparameters, versions."""
    return {"config": config.to_dict(), "method_hyperparameters": method.hyperparameters(),
            "torch_threads": torch.get_num_threads(), **device_record(config.federation.device),
            **provenance()}


ROUND_COLUMNS = ["round", "participants", "survivors", "dropped", "clipped", "aborted"]


def round_summary(fed: Federation, config: RunConfig) -> tuple[dict, pd.DataFrame | None]:
    """Under secure aggregation or dropout: (summary.json's entries on what the server held and the
    round log's totals, rounds.csv's rows); otherwise ({}, None)."""
    protocol = config.secure.protocol(config.federation.seed)
    if protocol is None and not config.federation.dropout:
        return {}, None
    frame = pd.DataFrame([{**r, "dropped": r["participants"] - r["survivors"]} for r in fed.round_log],
                         columns=ROUND_COLUMNS)
    entries = {"dropout": config.federation.dropout, "round_log": {
        "rounds": len(frame), "participants": int(frame["participants"].sum()),
        "survivors": int(frame["survivors"].sum()), "dropped": int(frame["dropped"].sum()),
        "clipped": int(frame["clipped"].sum()),
        "clipped_rounds": frame.loc[frame["clipped"] > 0, "round"].astype(int).tolist(),
        "aborted_rounds": frame.loc[frame["aborted"].astype(bool), "round"].astype(int).tolist()}}
    if protocol is not None:
        clear = in_the_clear(protocol, fed.method.upload_kinds(fed.model), fed.channel.recorder.aggregates.values())
        beside = (f"; in the clear beside each masked upload: {', '.join(clear)} (as Flower's SecAgg+ leaves a "
                  f"FitRes' num_examples and metrics)" if clear else
                  "; nothing in the clear" + (" (clear_fields hidden: stricter than Flower's SecAgg+, which sends "
                                              "each FitRes' num_examples and metrics unmasked)"
                                              if protocol.clear_fields == "hidden" else ""))
        entries["secure_aggregation"] = {
            "server_held": "the sum of each round's arrived summands, never one client's (masked uploads are "
                           "uniform over the modulus)" + beside,
            "in_the_clear": clear,
            "protocol": {**protocol.describe(), "quantum": protocol.quantum},
            "decoding_bound": "each summed value within (survivors x quantum) of the sum of what the survivors "
                              "sent; a client's weight n / max_weight is sent as round(weight x quantization_range), "
                              "exactly"}
    return entries, frame


def in_the_clear(protocol: SecureAggregation, upload_kinds: set[str], records) -> list[str]:
    """The fields a run's masked uploads carried unmasked: under ``clear_fields="flower"`` the sample
    count when the method uploads one (``upload_kinds``: its manifest's, so a resumed run whose records
    cover only its new rounds says the same) and the training metrics the records hold; none when hidden."""
    if protocol.clear_fields != "flower":
        return []
    return sorted(({"sample_count"} if "sample_count" in upload_kinds else set())
                  | {name for record in records for values in record.clear.values() for name in values})


def write_metrics(out: Path, fed: Federation, config: RunConfig, seconds: float) -> dict:
    io.write_csv(out / "metrics.csv", pd.DataFrame(fed.metrics, columns=["round", "client", "accuracy", "loss"]))
    summary = {"method": config.method, "dataset": config.data.dataset, "partition": config.data.partition,
               "clients": config.data.clients, "rounds": fed.completed_rounds, "seed": config.federation.seed,
               "seconds": round(seconds, 2), **device_record(config.federation.device), **summarize(fed.metrics)}
    summary.pop("round", None)
    entries, rounds = round_summary(fed, config)
    summary.update(entries)
    if rounds is not None:
        io.write_csv(out / "rounds.csv", rounds)
    io.write_json(out / "summary.json", summary)
    return summary


def train(config: RunConfig, out: str | Path | None, resume: bool = False,
          on_round: Callable[[int, dict], None] | None = None, metrics: list | None = None) -> dict:
    """Train ``config`` (or continue the run in ``out`` when ``resume``), checkpointing each round;
    ``metrics``, when given, receives the rows of metrics.csv (round, client, accuracy, loss)."""
    prep = prepare(config)
    fed = build_federation(prep)
    try:
        summary = _train_checkpointed(fed, prep, None if out is None else Path(out), resume, on_round)
        if metrics is not None:
            metrics.extend(fed.metrics)
        return summary
    finally:
        fed.close()  # e.g. shut down the Ray this run started


def train_federation(fed: Federation, prep: Prepared, out: str | Path) -> dict:
    """Train a federation the caller built (and closes), e.g. one whose channel records rounds for
    an attack, writing ``out`` as ``train`` does."""
    return _train_checkpointed(fed, prep, Path(out), False, None)


def _train_checkpointed(fed: Federation, prep: Prepared, out: Path | None, resume: bool, on_round) -> dict:
    """Run the rounds still to do, writing checkpoint, metrics and summary after each (into ``out``)."""
    config = prep.config
    spent = 0.0
    if out is not None:
        ckpt = out / "checkpoint.pt"
        if resume and ckpt.exists():
            state = io.load_torch(ckpt)
            fed.load_state_dict(state["federation"])
            spent = float(state.get("seconds", 0.0))
        else:
            io.write_json(out / "config.json", run_record(config, prep.method))
            io.write_csv(out / "partition.csv",
                         prep.partition.class_counts(prep.dataset.labels.numpy()).reset_index())
    start = time.perf_counter()
    summary = summarize(fed.metrics) if fed.metrics else {}
    while fed.completed_rounds < config.federation.rounds:
        rows = fed.run_round()
        summary = summarize(rows)
        if out is not None:
            seconds = spent + time.perf_counter() - start
            io.save_torch(out / "checkpoint.pt", {"federation": fed.state_dict(), "seconds": seconds})
            summary = write_metrics(out, fed, config, seconds)
        if on_round is not None:
            on_round(fed.completed_rounds - 1, summary)
    seconds = spent + time.perf_counter() - start
    if out is not None:
        return write_metrics(out, fed, config, seconds)
    return {"method": config.method, "rounds": fed.completed_rounds, **summarize(fed.metrics),
            **round_summary(fed, config)[0]}


def load_run_config(run_dir: str | Path) -> RunConfig:
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise UserError(f"{path} not found: --resume needs a run directory written by `fedsec train --out`")
    try:
        return RunConfig.from_dict(io.read_json(path)["config"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a valid fedsec config ({exc}); start a new run instead") from None
