"""Run a Flower app in Flower's simulation engine with fedsec's recorder and ground-truth hook wrapped in.

``simulate(app_dir, ...)`` reads the app (``fedsec.flower.app``) and its declaration
(``fedsec.flower.declaration``), then runs the app's own ServerApp and ClientApp, unmodified, with
``flwr.simulation.run_simulation`` on Ray, offline:

* server side: while the ServerApp runs, the strategy it starts (``strategy.start(...)``, Flower's round
  loop) is wrapped in a ``RecordingStrategy`` (``recording.wrapping_started_strategies``);
* client side: the ClientApp runs behind ``GroundTruthMod`` (outermost, so it sees the app's final
  reply without touching it), which writes what the app reports to ``log_batch`` into a temporary
  directory, joined back to (round, client) after the run;
* run config: ``run_simulation`` hands apps an empty run config; both apps get the app's
  ``[tool.flwr.app.config]`` with the overrides applied, as ``flwr run --run-config`` would give them;
* the app's ServerApp starts once every simulated node is registered (``_audit_server_app``), so each
  round's sampling sees the whole federation;
* Flower's telemetry is switched off for the run (an audit makes no network calls) and its log kept to
  errors unless ``quiet=False``; Ray gets ``ray_cpus`` CPUs and each ClientApp one CPU and
  ``threads`` torch threads.

Under Flower's secure aggregation (a legacy app whose ``DefaultWorkflow`` runs ``SecAggPlusWorkflow``)
the recording point is the workflow's grid instead (``secagg.recording_secagg_workflows``): the
recorder holds what that server holds, each node's masked vector and the round's unmasked sum
(``recorder.secure`` and ``recorder.aggregates`` set as fedsec's engine sets them under
``--secure-aggregation``).

What this cannot see: anything outside the strategy's (or the SecAgg+ workflow's) messages, and the
real network transport (TLS, gRPC, message sizes on the wire, timing), which is not simulated.
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator

import torch
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fedecouple.backends import local_cpus
from fedecouple.channel import Recorder
from fedecouple.engine import GroundTruth
from fedecouple.errors import UserError

from .app import FlowerApp, read_app
from .declaration import Declaration, check_traffic, load_declaration
from .groundtruth import GroundTruthMod, batches_of, read_records
from .recording import RecordingStrategy, check_message_api, wrapping_started_strategies
from .secagg import SecAggRecording, check_secure_traffic, recording_secagg_workflows


@dataclass
class FlowerRun:
    """A finished simulation of a Flower app, as recorded."""

    app: FlowerApp
    run_config: dict
    declaration: Declaration
    recorder: Recorder
    ground_truth: GroundTruth  # harness-only: which pool images each (round, client) trained on
    clients: dict[int, dict]  # client id → {"node_id", "partition_id"} (see _name_clients_by_partition)
    nodes: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    # replies carrying an error ({"round", "client", "node_id", "reason"}), kept when ``simulate`` was
    # told to expect refusals (a deviating server's run); otherwise a failure is an error
    failures: list[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"flower:{self.app.name}"

    def rounds(self) -> list[int]:
        return sorted({r for r, _ in self.recorder.exchanges})

    def participants(self, round: int) -> list[int]:
        """Clients whose upload of ``round`` was recorded."""
        return sorted(c for (r, c), ex in self.recorder.exchanges.items() if r == round and ex.upload is not None)


def _rebuild_client_app(app_dir: str | None, payload: bytes) -> "AuditClientApp":
    """An ``AuditClientApp`` unpickled in a Ray worker, with its app's directory put on sys.path first: a
    Ray instance kept across simulations (``shared_ray``) fixed its workers' import path when it started,
    possibly for another app, and the app's ClientApp is pickled by reference to the app's modules."""
    if app_dir is not None and app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    import cloudpickle

    cls, state = cloudpickle.loads(payload)
    app = cls.__new__(cls)
    app.__dict__.update(state)
    return app


class AuditClientApp(ClientApp):
    """The app's ClientApp behind ``mod`` (outermost), then ``mods`` (outermost first), run with the
    audit's run config and torch threads. Pickled so that unpickling puts ``app_dir`` (the app's
    directory) on sys.path before it loads the app's modules."""

    def __init__(self, app: ClientApp, mod: GroundTruthMod, run_config: dict, threads: int = 1,
                 mods: Iterable = (), app_dir: str | Path | None = None) -> None:
        super().__init__()
        self.app, self.mod, self.run_config, self.threads = app, mod, dict(run_config), int(threads)
        self.mods = list(mods)
        self.app_dir = None if app_dir is None else str(app_dir)

    def __reduce__(self):
        import cloudpickle

        # the state travels as bytes so that nothing of the app is unpickled before the path is set
        return _rebuild_client_app, (self.app_dir, cloudpickle.dumps((type(self), self.__dict__)))

    def _inner(self, message, context):
        call = self.app
        for mod in reversed(self.mods):
            call = (lambda m, inner: lambda msg, ctx: m(msg, ctx, inner))(mod, call)
        return call(message, context)

    def __call__(self, message, context):
        torch.set_num_threads(self.threads)
        given = context.run_config
        # the simulation engine checks that a node's run config is unchanged after each message
        context.run_config = dict(self.run_config)
        try:
            return self.mod(message, context, self._inner if self.mods else self.app)
        finally:
            context.run_config = given


NODES_TIMEOUT = 120.0  # seconds the ServerApp waits for the simulated nodes to register


def _audit_server_app(app: ServerApp, run_config: dict, nodes: int) -> ServerApp:
    """The app's ServerApp, started once all ``nodes`` nodes are registered and given the run config.

    The simulation engine starts the ServerApp's thread before it registers the nodes, and Flower's
    strategies sample from the nodes connected at that moment (waiting only for their
    ``min_available_nodes``): on a busy machine a round could otherwise go out to fewer nodes than
    the federation has, differently from run to run."""
    audit = ServerApp()

    @audit.main()
    def main(grid, context) -> None:
        deadline = time.monotonic() + NODES_TIMEOUT
        while len(list(grid.get_node_ids())) < nodes:
            if time.monotonic() > deadline:
                raise UserError(f"only {len(list(grid.get_node_ids()))} of {nodes} simulated nodes registered within "
                                f"{NODES_TIMEOUT:g} s; lower --nodes")
            time.sleep(0.05)
        context.run_config = dict(run_config)
        app(grid, context)

    return audit


_ENVIRONMENT = {"FLWR_TELEMETRY_ENABLED": "0"}


@contextmanager
def _offline_and_quiet(quiet: bool) -> Iterator[None]:
    """Flower telemetry off (here and in the Ray workers, which inherit the environment); Flower's log
    kept to errors when ``quiet``."""
    from flwr.supercore import telemetry
    from flwr.supercore.logger import FLOWER_LOGGER

    saved_env = {k: os.environ.get(k) for k in _ENVIRONMENT}
    saved_flag, saved_level = telemetry.FLWR_TELEMETRY_ENABLED, FLOWER_LOGGER.level
    os.environ.update(_ENVIRONMENT)
    telemetry.FLWR_TELEMETRY_ENABLED = "0"
    if quiet:
        FLOWER_LOGGER.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            if quiet:  # ray.init's notice about a future default for GPU visibility
                warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            yield
    finally:
        telemetry.FLWR_TELEMETRY_ENABLED = saved_flag
        FLOWER_LOGGER.setLevel(saved_level)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _check_apps(app: FlowerApp, server_app, client_app) -> None:
    if not isinstance(server_app, ServerApp):
        raise UserError(f"{app.serverapp} is a {type(server_app).__name__}, not a flwr.serverapp.ServerApp")
    if not isinstance(client_app, ClientApp):
        raise UserError(f"{app.clientapp} is a {type(client_app).__name__}, not a flwr.clientapp.ClientApp")
    if getattr(server_app, "_main", None) is None:
        # the compatibility mode: ServerApp(server_fn=...) running a legacy flwr.server.strategy.Strategy
        raise UserError(f"{app.serverapp} uses Flower's legacy server_fn/ServerAppComponents API "
                        f"(flwr.server.strategy, configure_fit), not a Message-API strategy; start a "
                        f"flwr.serverapp.strategy.Strategy from @app.main()")


# inside ``reused_simulations()``: (app, run config, nodes, threads, Ray CPUs) → [(recorded rounds, run)]
_reused: dict | None = None


@contextmanager
def reused_simulations() -> Iterator[None]:
    """Inside this block, a simulation asked for again with the same app, nodes, run config, threads and
    Ray CPUs, and no interceptors, is not run again when an earlier one recorded every round asked for
    (all its rounds, or a superset of those asked): its recorded run is handed out once more, restricted
    to the rounds asked for (``_restricted``). Attacks and audits only read a recorded run, so callers
    that attack one app many ways in one process (a sweep, the test suite) pay Ray's start-up once per
    distinct simulation."""
    global _reused
    outer = _reused
    _reused = {} if outer is None else outer
    try:
        yield
    finally:
        _reused = outer


# inside ``shared_ray()``: {"init": the init arguments of the Ray instance the block keeps, None if none}
_shared_ray: dict | None = None


def _ray_backend():
    """Flower's Ray backend class, if it is as ``shared_ray`` expects (Flower 1.42: ``init_ray`` starts Ray
    unless it runs, ``build`` starts the actor pool, ``terminate`` stops it, then Ray); None otherwise."""
    try:
        from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    except ImportError:
        return None
    if not all(callable(RayBackend.__dict__.get(name)) for name in ("init_ray", "build", "terminate")):
        return None
    return RayBackend


@contextmanager
def shared_ray() -> Iterator[None]:
    """Inside this block, Flower simulations share one Ray instance and its ClientApp actors: at the end
    of a simulation Flower's Ray backend keeps its idle actor pool instead of stopping it and Ray, and
    the next simulation with the same client resources takes that pool (Flower then skips ``ray.init``
    and the actors' start-up, which imports torch and the app in a fresh worker: seconds each). An actor
    runs whatever ClientApp a message comes with, so a kept pool serves any app; an app's modules stay
    imported in it under their names, as they do in this process. Ray (and its actors) is restarted
    when a simulation asks for other init arguments (CPUs, logging) or after a simulation failed, and
    shut down when the block ends. Re-entrant; where Flower's backend is not as expected, a no-op. For
    callers that run many simulations in one process (the test suite); the command line does not use it."""
    global _shared_ray
    backend = _ray_backend()
    if _shared_ray is not None or backend is None:
        yield
        return
    import ray

    init_ray, build, terminate = (backend.__dict__[name] for name in ("init_ray", "build", "terminate"))
    # "init": the init arguments of the Ray instance kept; "pool": the idle actor pool kept, or None
    state = {"init": None, "pool": None}

    def init_once(self, backend_config) -> None:
        wanted = copy.deepcopy(backend_config.get(getattr(self, "init_args_key", "init_args")))
        if ray.is_initialized() and (state["init"] is None or state["init"] != wanted):
            ray.shutdown()  # a Ray instance started elsewhere, or with other arguments
        if not ray.is_initialized():  # stopped here or by someone else: its actors went with it
            state["init"], state["pool"] = None, None
        init_ray(self, backend_config)
        state["init"] = wanted

    def build_once(self, app_fn) -> None:
        kept, state["pool"] = state["pool"], None
        if kept is not None and kept.client_resources == self.client_resources and not self.actor_kwargs:
            self.pool, self.app_fn = kept, app_fn
            return
        if kept is not None:
            kept.terminate_all_actors()
        build(self, app_fn)

    def keep_actors(self) -> None:  # Flower's terminate, less its ray.shutdown(), the idle pool kept
        pool = getattr(self, "pool", None)
        if not pool:
            return
        # every actor back in the pool, no result outstanding (a pool without that record is not kept)
        idle = getattr(pool, "_future_to_actor", True) == {} and len(pool.pool) == pool.num_actors
        if idle and state["pool"] is None and not self.actor_kwargs:
            state["pool"] = pool
        else:
            pool.terminate_all_actors()
        self.pool = None

    backend.init_ray, backend.build, backend.terminate = init_once, build_once, keep_actors
    _shared_ray = state
    try:
        yield
    finally:
        backend.init_ray, backend.build, backend.terminate = init_ray, build, terminate
        _shared_ray = None
        if state["init"] is not None and ray.is_initialized():
            ray.shutdown()


def _restart_shared_ray() -> None:
    """After a failed simulation, the next one starts a fresh Ray instance and actors (their state is unknown)."""
    if _shared_ray is not None and _shared_ray["init"] is not None:
        import ray

        ray.shutdown()
        _shared_ray["init"], _shared_ray["pool"] = None, None


def simulate(app_dir: str | Path, *, nodes: int | None = None, run_config: dict | None = None,
             interceptors: Iterable = (), record_rounds: Iterable[int] | None = None, threads: int = 1,
             ray_cpus: int | None = None, quiet: bool = True, secagg_workflow=None, client_mods: Iterable = (),
             expect_refusals: bool = False) -> FlowerRun:
    """Run the app at ``app_dir`` in Flower's simulation engine with ``nodes`` nodes (default: the node
    count of its default federation) and ``run_config`` overrides; record rounds ``record_rounds``
    (fedsec numbering, default all) and the ground truth of the same rounds. ``interceptors`` act on
    every reply before the app's strategy aggregates it (refused for an app under Flower's SecAgg+,
    whose replies are masked).

    For a deviating SecAgg+ server (``fedsec.flower.malicious_workflow``): ``secagg_workflow`` maps the
    app's ``SecAggPlusWorkflow`` object to the workflow its ServerApp runs instead (recorded the same
    way); ``client_mods`` run on every node around the app's ClientApp, inside the ground-truth mod;
    ``expect_refusals`` keeps the nodes' error replies in ``FlowerRun.failures`` instead of failing."""
    start = time.perf_counter()
    app = read_app(app_dir)
    config = app.run_config(run_config)
    nodes = app.num_supernodes if nodes is None else int(nodes)
    if nodes is None:
        raise UserError(f"{app.directory / 'pyproject.toml'} declares no local simulation federation with "
                        f"options.num-supernodes; pass --nodes N")
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}")
    declaration = load_declaration(app, config)
    server_app, client_app = app.load("serverapp"), app.load("clientapp")
    _check_apps(app, server_app, client_app)
    rounds = None if record_rounds is None else sorted(set(record_rounds))
    interceptors = list(interceptors)
    key = (str(app.directory), repr(sorted(config.items())), nodes, int(threads), ray_cpus)
    client_mods = list(client_mods)
    reusable = not interceptors and secagg_workflow is None and not client_mods
    if _reused is not None and reusable:
        for recorded, earlier in _reused.get(key, ()):
            if recorded == rounds:
                return replace(earlier, notes=list(earlier.notes))
            if rounds is not None and (recorded is None or set(rounds) <= set(recorded)):
                return _restricted(earlier, rounds)
    recorder = Recorder(rounds=rounds)
    with tempfile.TemporaryDirectory(prefix="fedsec-flower-") as ground_truth_dir:
        strategies, records = _run(app, config, server_app, client_app, nodes, recorder, interceptors,
                                   ground_truth_dir, threads, ray_cpus, quiet, list(declaration.model_parameters()),
                                   secagg_workflow, client_mods)
    if not strategies:
        raise UserError(f"{app.serverapp} started no Message-API strategy (strategy.start(...)) and ran no "
                        f"SecAggPlusWorkflow, or its strategy overrides start(): fedsec records the rounds of "
                        f"flwr.serverapp.strategy.Strategy.start and of flwr.server.workflow.SecAggPlusWorkflow")
    if len(strategies) > 1:
        raise UserError(f"{app.serverapp} started {len(strategies)} strategies; fedsec records one federation per run")
    strategy = strategies[0]
    if isinstance(strategy, SecAggRecording):
        if interceptors:
            raise UserError("under Flower's SecAgg+ the server receives masked vectors only: fedsec's interceptors "
                            "(defenses, filters) cannot act on them; run without them")
        check_secure_traffic(recorder, len(declaration.model_parameters()))
    if strategy.failures and not expect_refusals:
        first = strategy.failures[0]
        reason = " ".join(first["reason"].split())
        raise UserError(f"the app's ClientApp failed on client {first['client']} in round {first['round']} "
                        f"({len(strategy.failures)} failure(s)): {reason[:300]}; run the app with `flwr run` to debug it")
    check_traffic(declaration, recorder)
    clients = _name_clients_by_partition(recorder, strategy.client_ids.nodes(), records)
    ground_truth = GroundTruth(rounds=rounds)
    for (round, client), exchange in sorted(recorder.exchanges.items()):
        record = None if exchange.upload is None else records.get(exchange.upload.meta.get("reply_to_message_id"))
        if record is not None:
            ground_truth.record(round, client, batches_of(record), None, record["training_set"])
    notes = _no_batches_note(ground_truth)
    run = FlowerRun(app, config, declaration, recorder, ground_truth, clients, nodes, time.perf_counter() - start,
                    notes, list(strategy.failures))
    if _reused is not None and reusable:
        _reused.setdefault(key, []).append((rounds, run))
    return replace(run, notes=list(notes))


def _no_batches_note(ground_truth: GroundTruth) -> list[str]:
    if any(ground_truth.batches.values()):
        return []
    return ["the app reported no training batches to fedsec.flower.log_batch: attacks cannot be scored"]


def _restricted(run: FlowerRun, rounds: list[int]) -> FlowerRun:
    """``run`` as the same simulation recording only ``rounds`` records it. What the recorder keeps does
    not change what the app computes (it copies the messages it is shown), so a run of the same app,
    config, nodes and threads recorded with fewer rounds differs only in the exchanges and ground truth
    kept: the other rounds' are dropped here; what the recorder keeps of every round (each client's
    latest uploads, secure-aggregation records) and the run's failures stay as they are."""
    kept = set(rounds)
    recorder = copy.copy(run.recorder)
    recorder.rounds = kept
    recorder.exchanges = {k: ex for k, ex in run.recorder.exchanges.items() if k[0] in kept}
    truth = GroundTruth(rounds=kept)
    for name in ("batches", "private", "local_data"):
        setattr(truth, name, {k: v for k, v in getattr(run.ground_truth, name).items() if k[0] in kept})
    recorded = {cid for _, cid in recorder.exchanges}
    notes = [n for n in run.notes if n not in _no_batches_note(GroundTruth())] + _no_batches_note(truth)
    return replace(run, recorder=recorder, ground_truth=truth, notes=notes,
                   clients={c: info for c, info in run.clients.items() if c in recorded},
                   failures=list(run.failures))


def _name_clients_by_partition(recorder: Recorder, nodes: dict[int, int], records: dict[str, dict]) -> dict[int, dict]:
    """Rename the recorded clients from node-id ranks (``nodes``: rank → node id) to the nodes' partition
    ids, as the ground-truth records report them (simulation), so that client c is the node holding
    partition c, as client c of fedsec's engine, and the same seed picks the same targets in every run
    (Flower's node ids are random). The partition id only names a node: nothing an attack reads
    depends on it. Without partition ids (or if renaming would merge clients) the ranks stay.
    Returns client id → {"node_id", "partition_id"} for the clients recorded."""
    partition_of = {int(r["node_id"]): int(r["partition_id"]) for r in records.values()
                    if r["partition_id"] is not None}
    mapping = {cid: partition_of[node] for cid, node in nodes.items() if node in partition_of}
    node_of = dict(nodes)
    if mapping and len(set(mapping.values())) == len(mapping):
        try:
            recorder.relabel(mapping)
        except ValueError:  # a client without a partition id would take another's name
            pass
        else:
            node_of = {mapping[cid]: node for cid, node in nodes.items() if cid in mapping}
            for cid, node in nodes.items():  # nodes never recorded keep their rank where it is free
                node_of.setdefault(cid, node)
    recorded = sorted({cid for _, cid in recorder.exchanges})
    return {cid: {"node_id": node_of[cid], "partition_id": partition_of.get(node_of[cid])} for cid in recorded}


@contextmanager
def _swapping(secagg_workflow) -> Iterator[None]:
    """Inside the recording: the app's SecAgg+ workflow replaced, when a replacement is given."""
    if secagg_workflow is None:
        yield
        return
    from .malicious_workflow import swapping_secagg_workflows

    with swapping_secagg_workflows(secagg_workflow):
        yield


def _run(app: FlowerApp, config: dict, server_app, client_app, nodes: int, recorder: Recorder, interceptors: list,
         ground_truth_dir: str, threads: int, ray_cpus: int | None, quiet: bool, names: list[str],
         secagg_workflow=None, client_mods: list | None = None):
    from flwr.simulation import run_simulation

    def wrap(strategy) -> RecordingStrategy:
        check_message_api(strategy)
        return RecordingStrategy(strategy, recorder, interceptors)

    backend_config = {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {"num_cpus": int(ray_cpus or local_cpus()), "include_dashboard": False,
                      "log_to_driver": not quiet,
                      # Ray's default niceness 15 starves the ClientApps on a machine shared with other jobs
                      "_system_config": {"worker_niceness": 0}},
    }
    # Ray workers import the app's modules: they inherit this process's sys.path as PYTHONPATH
    if str(app.directory) not in sys.path:
        sys.path.insert(0, str(app.directory))
    audit_client = AuditClientApp(client_app, GroundTruthMod(ground_truth_dir), config, threads, client_mods or (),
                                  app_dir=app.directory)
    with _offline_and_quiet(quiet), wrapping_started_strategies(wrap) as strategies, \
            recording_secagg_workflows(lambda: SecAggRecording(recorder, names)) as secure, \
            _swapping(secagg_workflow):
        try:
            run_simulation(server_app=_audit_server_app(server_app, config, nodes), client_app=audit_client,
                           num_supernodes=nodes, backend_config=backend_config)
        except UserError:
            _restart_shared_ray()
            raise
        except Exception as exc:  # the app's ServerApp raised (e.g. a run-config value it rejects)
            _restart_shared_ray()
            reason = " ".join(str(exc).split())[:300]
            raise UserError(f"the app's ServerApp failed in Flower's simulation: {type(exc).__name__}: {reason}; "
                            f"check the app and its run config (--flower-log shows Flower's log)") from exc
    return [*strategies, *secure], read_records(ground_truth_dir)
