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
import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pandas as pd
import torch

from fedecouple.backends import BACKENDS, ModelSpec, import_ray, make_backend
from fedecouple.channel import ServerChannel, Upload
from fedecouple.data import load_dataset, make_partition
from fedecouple.data.dataset import ImageDataset
from fedecouple.data.partition import Partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth, VictimSetting, round_half_up, summarize
from fedecouple.errors import UserError
from fedecouple.methods import make_method, method_class
from fedecouple.methods.base import Method, TrainConfig, hyperparameter_names, upload_kinds
from fedecouple.methods.facets import SecureSummation, secure_passes, secure_refusal
from fedecouple.secure_aggregation import Layout, SecureAggregation
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
    server sees every upload. ``sa_dp_epsilon`` (None: off) turns on distributed differential privacy:
    each client adds Skellam noise before masking, calibrated once per run (``calibrated_protocol``) so
    that the run's sums compose to that ε at ``sa_dp_delta``, each client's values L2-clipped to
    ``sa_dp_clip`` first (``defenses.distributed_dp``)."""

    secure_aggregation: bool = False
    sa_clipping_range: float = SecureAggregation.clipping_range
    sa_quantization_range: int = SecureAggregation.quantization_range
    sa_modulus: int = SecureAggregation.modulus
    sa_num_shares: int | float = SecureAggregation.num_shares
    sa_threshold: int | float = SecureAggregation.reconstruction_threshold
    sa_max_weight: float = SecureAggregation.max_weight
    sa_clear_fields: str = SecureAggregation.clear_fields
    sa_dp_epsilon: float | None = None
    sa_dp_delta: float = SecureAggregation.dp_delta
    sa_dp_clip: float = 1.0

    def protocol(self, seed: int, dp_noise: float = 0.0) -> SecureAggregation | None:
        """The protocol (None: off), with ``dp_noise`` as each client's Skellam μ (``calibrated_protocol``
        finds it from ``sa_dp_epsilon``; 0, the default, leaves the noise out: the parameters alone); a bad
        combination of values is a one-line error naming the fields (``fedsec.field_names`` names them as each
        front end does)."""
        if not self.secure_aggregation:
            return None
        self._check_dp()
        return SecureAggregation(clipping_range=self.sa_clipping_range,
                                     quantization_range=self.sa_quantization_range, modulus=self.sa_modulus,
                                 num_shares=self.sa_num_shares, reconstruction_threshold=self.sa_threshold,
                                 max_weight=self.sa_max_weight, seed=seed, clear_fields=self.sa_clear_fields,
                                 dp_noise=dp_noise, dp_l2_clip=self.sa_dp_clip if dp_noise else None,
                                 dp_delta=self.sa_dp_delta)

    def _check_dp(self) -> None:
        eps = self.sa_dp_epsilon
        if eps is not None and not (0 < eps < math.inf):
            raise UserError(f"sa_dp_epsilon must be positive and finite (leave it out for no noise), got {eps}",
                            fields=("sa_dp_epsilon",))
        if not 0 < self.sa_dp_delta < 1:
            raise UserError(f"sa_dp_delta must be in (0, 1), got {self.sa_dp_delta}", fields=("sa_dp_delta",))
        if not (0 < self.sa_dp_clip < math.inf):
            raise UserError(f"sa_dp_clip must be positive, got {self.sa_dp_clip}", fields=("sa_dp_clip",))
        changed = [name for name, value, default in (("sa_dp_delta", self.sa_dp_delta, SecureAggregation.dp_delta),
                                                     ("sa_dp_clip", self.sa_dp_clip, 1.0)) if value != default]
        if eps is None and changed:  # a user who sets them believes the noise is on
            raise UserError(f"{' and '.join(changed)} set{'s' if len(changed) == 1 else ''} distributed differential "
                            f"privacy, which is off: add sa_dp_epsilon or drop the option",
                            fields=(*changed, "sa_dp_epsilon"))


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
    names = hyperparameter_names(cls)
    unknown = sorted(set(config.hyperparameters) - set(names))
    if unknown:
        raise UserError(f"method {config.method} has no hyperparameter {', '.join(unknown)}; "
                        f"it takes: {', '.join(names) or 'none'}")
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
    protocol: SecureAggregation | None = None  # the run's secure aggregation, its noise calibrated (None: off)


def prepare(config: RunConfig) -> Prepared:
    """Validate the config and load everything; raises ``UserError`` before anything is written."""
    method = build_method(config)
    data, execution = config.data, config.execution
    if data.clients < 1:
        raise UserError(f"--clients must be at least 1, got {data.clients}")
    config.federation.validate(data.clients)
    if config.secure.protocol(config.federation.seed) is not None and (refusal := secure_refusal(method)):
        raise UserError(refusal)  # before any data is loaded (the protocol's parameters are checked above)
    if data.train_images is not None and data.samples_per_client is not None and data.partition != "weak":
        raise UserError("give --train-images or --samples-per-client, not both: outside the weak partition "
                        "--samples-per-client caps the training set (at most N), --train-images fixes it (exactly N)")
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
    return Prepared(config, dataset, partition, method, calibrated_protocol(config, method, dataset))


def summand_size(method: Method, model, num_classes: int, max_weight: float) -> int:
    """How many values one client's secure sum carries besides Flower's weight factor: the layout of the
    method's summands (``SecureSummation.secure_summands``) for an upload holding every field of its manifest
    (per-class fields for every class, as a method's summands always cover every class)."""
    if not isinstance(method, SecureSummation):
        raise UserError(secure_refusal(method) or f"{method.name} has no secure-aggregation variant")
    tensors = {}
    for spec in method.manifest(model):
        for name in ([spec.name.format(k=k) for k in range(num_classes)] if spec.per_class else [spec.name]):
            tensors[name] = torch.ones(spec.shape, dtype=torch.float64)
    layout = Layout.of(method.secure_summands(Upload(0, 0, tensors), max_weight, num_classes))
    return layout.size - (1 if layout.weighted else 0)


def participants_per_round(config: RunConfig) -> int:
    """The clients a round samples (``Federation.sample_clients``): round(join_ratio · clients), at least 1."""
    return max(1, round_half_up(config.federation.join_ratio * config.data.clients))


def calibrated_protocol(config: RunConfig, method: Method, dataset: ImageDataset) -> SecureAggregation | None:
    """The run's protocol (None: off). Under ``--sa-dp-epsilon`` each client's Skellam μ is calibrated
    once, here (``defenses.distributed_dp.calibrate``): the run's sums (its rounds times the method's
    secure passes) of every sampled client (no dropout assumed), of the method's summand size on the
    configured model, compose to that ε at ``--sa-dp-delta``; a noise the modulus cannot hold is refused."""
    base = config.secure.protocol(config.federation.seed)
    if base is None or config.secure.sa_dp_epsilon is None or not method.communicates:
        return base  # a method that never communicates sends nothing to noise
    from defenses.distributed_dp import calibrate

    model = ModelSpec.for_data(dataset, config.federation.arch, config.federation.model).build()
    dimension = summand_size(method, model, dataset.num_classes, base.max_weight)
    clients = participants_per_round(config)
    releases = max(1, config.federation.rounds) * secure_passes(method)
    mu = calibrate(config.secure.sa_dp_epsilon, config.secure.sa_dp_delta, releases, clients, dimension,
                   config.secure.sa_dp_clip, base)
    protocol = config.secure.protocol(config.federation.seed, dp_noise=mu)
    protocol.check_headroom(clients)
    return protocol


def build_federation(prep: Prepared, channel: ServerChannel | None = None, ground_truth: GroundTruth | None = None,
                     victim: VictimSetting | None = None) -> Federation:
    execution = prep.config.execution
    if execution.threads:
        torch.set_num_threads(execution.threads)
    deterministic(prep.config.federation.device)
    backend = make_backend(execution.backend, execution.ray_address, execution.threads, prep.config.federation.device)
    protocol = prep.protocol if prep.protocol is not None else calibrated_protocol(prep.config, prep.method,
                                                                                   prep.dataset)
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


DP_ROUND_COLUMNS = ["dp_clipped", "epsilon_round", "epsilon_total", "epsilon_isolated"]


def round_summary(fed: Federation, config: RunConfig) -> tuple[dict, pd.DataFrame | None]:
    """Under secure aggregation or dropout: (summary.json's entries on what the server held and the
    round log's totals, rounds.csv's rows); otherwise ({}, None). Under distributed DP rounds.csv adds
    each round's ε, the run's ε up to it and a client's ε up to it against a server that isolates it
    (``distributed_privacy``)."""
    protocol = fed.channel.secure if config.secure.secure_aggregation else None
    if protocol is None and not config.federation.dropout:
        return {}, None
    frame = pd.DataFrame([{**r, "dropped": r["participants"] - r["survivors"]} for r in fed.round_log],
                         columns=ROUND_COLUMNS)
    private = distributed_privacy(fed, protocol, config.secure.sa_dp_epsilon) if protocol is not None and protocol.private else None
    if private is not None:
        frame = pd.concat([frame, pd.DataFrame(private.pop("per_round"), columns=DP_ROUND_COLUMNS)], axis=1)
    entries = {"dropout": config.federation.dropout, "round_log": {
        "rounds": len(frame), "participants": int(frame["participants"].sum()),
        "survivors": int(frame["survivors"].sum()), "dropped": int(frame["dropped"].sum()),
        "clipped": int(frame["clipped"].sum()),
        "clipped_rounds": frame.loc[frame["clipped"] > 0, "round"].astype(int).tolist(),
        "aborted_rounds": frame.loc[frame["aborted"].astype(bool), "round"].astype(int).tolist()}}
    if protocol is not None:
        clear = in_the_clear(protocol, upload_kinds(fed.method, fed.model), fed.channel.recorder.aggregates.values())
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
        if private is not None:
            entries["secure_aggregation"]["distributed_dp"] = private
    return entries, frame


def round_releases(entry: dict) -> list[int]:
    """The survivor counts of the sums a round of the round log released: none when it aborted; two for a
    two-pass round whose second sum decoded (the log keeps that pass's survivors, at most the first's, so
    the first sum is accounted with at most its survivors: an upper bound on its ε); one otherwise."""
    if entry.get("aborted"):
        return []
    return [int(entry["survivors"])] * (2 if entry.get("second_pass", None) == "" else 1)


def distributed_privacy(fed: Federation, protocol: SecureAggregation, target: float | None) -> dict:
    """What distributed DP spent over the rounds of ``fed``'s round log (``defenses.distributed_dp``):
    summary.json's entry, with ``per_round`` (rounds.csv's ``DP_ROUND_COLUMNS``) to be popped; ``target``:
    the ε the noise was calibrated for."""
    from defenses.distributed_dp import ORDERS, epsilon_of, round_rdp

    dimension = summand_size(fed.method, fed.model, fed.dataset.num_classes, protocol.max_weight)
    total, isolated, rows = np.zeros_like(ORDERS), np.zeros_like(ORDERS), []
    for entry in fed.round_log:
        releases = round_releases(entry)
        spent = sum((round_rdp(protocol, n, dimension) for n in releases), np.zeros_like(ORDERS))
        total, isolated = total + spent, isolated + len(releases) * round_rdp(protocol, 1, dimension)
        rows.append({"dp_clipped": int(entry.get("dp_clipped", 0)),
                     "epsilon_round": epsilon_of(spent, protocol.dp_delta) if releases else 0.0,
                     "epsilon_total": epsilon_of(total, protocol.dp_delta),
                     "epsilon_isolated": epsilon_of(isolated, protocol.dp_delta)})
    l1, l2 = protocol.sensitivity(dimension)
    return {"mechanism": "Skellam noise added by each client before masking (The Skellam Mechanism for "
                         "Differentially Private Federated Learning); no amplification by sampling",
            "target_epsilon": target, "delta": protocol.dp_delta, "mu_per_client": protocol.dp_noise,
            "l2_clip": protocol.dp_l2_clip, "dimension": dimension, "l1_sensitivity": l1, "l2_sensitivity": l2,
            "epsilon_total": rows[-1]["epsilon_total"] if rows else 0.0,
            "epsilon_isolated": rows[-1]["epsilon_isolated"] if rows else 0.0,
            "not_protected": "each client's weight (sample count): Flower's weight factor travels without noise",
            "per_round": rows}


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
