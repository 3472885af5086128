"""``fedsec report``'s stages: plan them, find them done (or in an earlier run), run them.

Each stage is a ``fedsec.resumable.ResumableStage`` in ``out/<method>/<stage>/``: complete when its
``done.json`` (written last) holds the stage's identity — its config and settings, without the
settings that never change a result (``fedsec.runner.RESULT_NEUTRAL``) — and its result files exist.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from fedecouple.errors import UserError

from ... import estimate, runner
from ...resumable import ResumableStage, TrainRun, marked_folders
from ...runner import RunConfig
from ...field_names import for_cli
from ...versions import provenance
from ...recording import TrainingCache, recording_federation, training_key
from ..attack import AttackSettings, check_applicable, run_attack
from ..audit import run_audit
from ..compare import method_config
from .settings import cell_setting

# the files each kind of stage must hold, besides its done.json, to count as complete
REQUIRED = {"train": ("summary.json", "metrics.csv"), "audit": ("summary.json", "findings.json"),
            "attack": ("summary.json", "attack.csv"), "mia": ("summary.json", "mia.csv")}


@dataclass(frozen=True)
class Stage:
    method: str
    name: str  # train | audit | attack-<cell> | mia
    attack: str | None  # the cell (ig, ig@real) of an attack stage
    config: RunConfig
    identity: dict
    path: Path
    mia: object = None  # the MiaSettings of a membership-inference stage
    attack_settings: AttackSettings | None = None  # the cell's, shared by its stages (one per method)

    @property
    def kind(self) -> str:
        return "attack" if self.attack else self.name

    @property
    def resumable(self) -> ResumableStage:
        return ResumableStage(self.path, self.identity, REQUIRED[self.kind])


def stage_identity(kind: str, config: RunConfig, settings=None) -> dict:
    """What a stage's result depends on (stored in its done.json; a stage is reused only when equal)."""
    if kind == "mia":
        return json.loads(json.dumps({"stage": "mia", "config": config.result_key(), "settings": asdict(settings)},
                                     sort_keys=True, default=list))
    if kind == "attack":
        # an attack stage trains max(attack rounds) + 1 rounds whatever --rounds says
        config = config.updated(rounds=max(settings.rounds) + 1)
        return json.loads(json.dumps({"stage": "attack", "attack": settings.attack, "config": config.result_key(),
                                      "settings": asdict(settings)}, sort_keys=True))
    return {"stage": kind, "config": config.result_key()}


def plan(base: RunConfig, methods: list[str], cells: dict[str, AttackSettings], out: Path, mia=None,
         malicious: Iterable = ()) -> list[Stage]:
    """Every stage, method by method: train, audit, one per cell (``ReportSettings.attack_plan``; a
    sized real-training cell ``<attack>@real-n<N>`` on a federation of clients of N training images), one
    per malicious-server cell (``ReportSettings.malicious_cells``: its own federation of clients of
    ``size`` training images), mia. A round-level cell (an attack on the sum, ``AttackSpec.round_level``) runs
    on the method's federation under secure aggregation (``secure_config``): the report's "with secure
    aggregation" columns; a method that cannot run under it gets the refusal as the cell's reason."""
    stages = []
    for m in methods:
        cfg = method_config(base, m, base.federation.seed)
        stages.append(Stage(m, "train", None, cfg, stage_identity("train", cfg), out / m / "train"))
        stages.append(Stage(m, "audit", None, cfg, stage_identity("audit", cfg), out / m / "audit"))
        for a, settings in cells.items():
            size = cell_setting(a)[1]  # a real-training cell on clients of ``size`` images: its own federation
            cell_cfg = cfg if size is None else sized_config(cfg, size)
            if settings.spec.round_level:
                cell_cfg = secure_config(cell_cfg)
            stages.append(Stage(m, f"attack-{a}", a, cell_cfg, stage_identity("attack", cell_cfg, settings),
                                out / m / f"attack-{a}", attack_settings=settings))
        for cell in malicious:
            sized = sized_config(cfg, cell.size)
            stages.append(Stage(m, f"attack-{cell.key}", cell.key, sized, stage_identity("attack", sized, cell.settings),
                                out / m / f"attack-{cell.key}", attack_settings=cell.settings))
        if mia is not None:
            stages.append(Stage(m, "mia", None, cfg, stage_identity("mia", cfg, mia), out / m / "mia", mia))
    return stages


def secure_config(config: RunConfig) -> RunConfig:
    """``config`` under secure aggregation (the protocol's parameters as the report was given them)."""
    return config if config.secure.secure_aggregation else config.updated(secure_aggregation=True)


def sized_config(config: RunConfig, size: int) -> RunConfig:
    """``config`` with every client training on exactly ``size`` images (``--train-images``; outside
    ``weak``, where ``--samples-per-client`` counts train + test, the cap it replaces is dropped)."""
    keep_cap = config.data.partition == "weak"
    return config.updated(train_images=int(size), samples_per_client=config.data.samples_per_client if keep_cap else None)


# ----------------------------------------------------------------------------------------------
# reuse of earlier runs
# ----------------------------------------------------------------------------------------------
def check_reuse_dirs(dirs: Iterable[str | Path]) -> list[Path]:
    out = []
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            raise UserError(f"--reuse {d}: not a directory")
        try:
            next(iter(os.scandir(p)), None)
        except OSError as exc:
            raise UserError(f"--reuse {d}: cannot read it ({exc.strerror or exc})") from None
        out.append(p)
    return out


def find_reusable(stage: Stage, done_dirs: list[Path], train_dirs: list[Path]) -> Path | None:
    """A folder below ``--reuse`` holding this stage complete (or, for ``train``, a ``fedsec train`` run)."""
    found = stage.resumable.find_complete(done_dirs)
    if found is None and stage.kind == "train":
        found = next((d for d in train_dirs if TrainRun(d, stage.config).status() == "done"), None)
    return found


# ----------------------------------------------------------------------------------------------
# running stages
# ----------------------------------------------------------------------------------------------
def run_stage(stage: Stage, trainings: TrainingCache | None = None) -> tuple[str, str | None]:
    """Run one stage into its folder; returns (status, reason). ``done.json`` is written last.
    ``trainings`` lets consecutive attack stages with the same training share one federation."""
    start = time.perf_counter()
    path = stage.path
    reason = None
    if stage.kind == "train":
        status = TrainRun(path, stage.config).status()
        if status == "other" or (status == "new" and path.exists()):
            shutil.rmtree(path)
        if status != "done" and (trainings is None or status == "partial"):
            runner.train(stage.config, path, resume=status == "partial")
        elif status != "done":
            _train_recorded_stage(stage, trainings)
    else:
        if path.exists():
            shutil.rmtree(path)  # an incomplete stage is redone from scratch
        if stage.kind == "audit":
            kept = trainings.get(training_key(stage.config)) if trainings is not None else None
            run_audit(stage.config, path, evidence=False, progress=False, recorded=None if kept is None else kept[1])
        elif stage.kind == "mia":
            from ..mia import run_mia

            run_mia(stage.config, stage.mia, path, progress=False, echo=lambda text: None)
        else:
            reason = _attack_stage(stage, trainings)
    status = "done" if reason is None else "not_applicable"
    reason = None if reason is None else reason.strip().rstrip(".")
    path.mkdir(parents=True, exist_ok=True)
    stage.resumable.finish({"status": status, "reason": reason, "seconds": round(time.perf_counter() - start, 2),
                            **provenance(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return status, reason


def _train_recorded_stage(stage: Stage, trainings: TrainingCache) -> None:
    """The train stage with the channel recording every round: the federation is kept in
    ``trainings`` for the method's audit and real-training attack stages (same ``training_key``)."""
    start = time.perf_counter()
    prep = runner.prepare(stage.config)
    fed, run, _ = recording_federation(prep)
    try:
        runner.train_federation(fed, prep, stage.path)
    except BaseException:
        fed.close()
        raise
    trainings.put(training_key(stage.config), (fed, run, round(time.perf_counter() - start, 2)))


def _attack_stage(stage: Stage, trainings: TrainingCache | None = None) -> str | None:
    """Run an attack stage; the reason it does not apply (known before training), or None."""
    settings = stage.attack_settings
    try:
        check_applicable(settings.spec, runner.prepare(stage.config))
        summary = run_attack(stage.config, settings, out=stage.path, progress=False, trainings=trainings)
    except UserError as exc:
        return for_cli(exc)
    if settings.download_check and summary.get("download_check"):
        return None  # the check's decisions are the result, even where it left nothing to score
    return summary.get("not_applicable")  # attacks.harness.nothing_scored


def run_stages(stages: list[Stage], reuse_dirs: list[Path], progress: bool,
               log: Callable[[str], None] | None, jobs: int = 1) -> tuple[list[dict], dict, float]:
    """Each stage: done earlier, copied from a reuse folder, or computed (a failure is recorded and
    the next stage runs). Returns (records, failures, seconds). ``jobs`` > 1: the methods' stage
    groups run in that many processes (``_run_in_processes``), each with an equal share of torch's
    threads; a stage computes what it computes in one process on the same thread count (its seeds are
    its own), so with ``--threads`` given the numbers do not depend on ``jobs``. The workers write
    their stage lines to stderr themselves (not through ``log``)."""
    from tqdm import tqdm

    bar = tqdm(total=len(stages), desc="report", unit="stage", disable=None if progress else True, file=sys.stderr,
               leave=False)  # the bar only on a terminal; the per-stage lines always

    def say(text: str) -> None:
        if log is not None:
            log(text)
        elif progress:
            tqdm.write(text, file=sys.stderr)

    done_dirs, train_dirs = marked_folders(reuse_dirs) if reuse_dirs else ([], [])
    todo = [st for st in stages if not st.resumable.complete() and find_reusable(st, done_dirs, train_dirs) is None]
    groups = method_groups(stages)
    workers = max(1, min(int(jobs), len(groups)))
    estimated = {}  # each stage still to compute: its share of its group's estimate
    for g in groups:
        pending = [st for _, st in g if st in todo]
        estimated.update({(st.method, st.name): sec for st, sec in zip(pending, stage_estimates(pending))})
    loads = [sum(estimated[(st.method, st.name)] for _, st in g if st in todo) for g in groups]
    if todo:
        wall = parallel_wall_seconds(loads, workers)
        device = todo[0].config.federation.device
        say(f"{len(todo)} of {len(stages)} stages to compute: {estimate.describe(wall, device)}"
            + (f", {workers} processes" if workers > 1 else "") + " (fedsec.estimate)")
    t0 = time.perf_counter()
    try:
        if workers > 1:
            records, failed = _run_in_processes(groups, loads, len(stages), done_dirs, train_dirs, workers, bar, say,
                                                progress)
        else:
            records, failed = [], {}
            for group in groups:
                done, failures = _run_group(group, len(stages), done_dirs, train_dirs, say, bar)
                records += done
                failed.update(failures)
    finally:
        bar.close()
    for record in records:  # the estimate beside the wall time, where the stage was computed now
        sec = estimated.get((record["method"], record["stage"]))
        record["estimated"] = None if sec is None or record.get("source") != "computed" else round(sec, 1)
    return records, failed, time.perf_counter() - t0


def method_groups(stages: list[Stage]) -> list[list[tuple[int, Stage]]]:
    """The stages (with their 1-based positions) in runs of one method: a method's stages run in a
    row, in one process, so that its train stage's recorded federation serves its later stages."""
    groups: list[list[tuple[int, Stage]]] = []
    for i, st in enumerate(stages, 1):
        if not groups or groups[-1][-1][1].method != st.method:
            groups.append([])
        groups[-1].append((i, st))
    return groups


def parallel_wall_seconds(loads: list[float], workers: int) -> float:
    """The wall time of ``loads`` run by ``workers`` processes taking the largest waiting load first
    (as ``_run_in_processes`` submits them)."""
    finish = [0.0] * max(1, workers)
    for load in sorted(loads, reverse=True):
        k = finish.index(min(finish))
        finish[k] += load
    return max(finish)


def process_threads(available: int, workers: int) -> int:
    """torch threads per worker process: the ``available`` ones shared out, at least one."""
    return max(1, int(available) // max(1, int(workers)))


def _run_group(group: list[tuple[int, Stage]], total: int, done_dirs, train_dirs, say,
               bar=None) -> tuple[list[dict], dict]:
    """One method's stages in a row, sharing one ``TrainingCache``; (records, failures). ``bar``: the
    progress bar to name each stage on and advance (None in a worker process)."""
    failed: dict[tuple[str, str], str] = {}
    records = []
    trainings = TrainingCache()
    try:
        for i, st in group:
            if bar is not None:
                bar.set_postfix_str(f"{st.method} {st.name}")
            label = f"[{i:>{len(str(total))}}/{total}] {st.method} {st.name}"
            records.append(_one_stage(st, label, done_dirs, train_dirs, failed, say, trainings))
            if bar is not None:
                bar.update(1)
    finally:
        trainings.close()
    return records, failed


def _group_in_process(group: list[tuple[int, Stage]], total: int, done_dirs, train_dirs, threads: int,
                      progress: bool) -> tuple[list[dict], dict]:
    """``_run_group`` in a worker process, torch on ``threads`` threads where a stage sets none (its
    --threads: the trainings; an attack sets its own): its stage lines (with ``progress``) go straight
    to stderr."""
    import torch

    def say(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    torch.set_num_threads(threads)
    with runner.shared_datasets():
        return _run_group(group, total, done_dirs, train_dirs, say)


def _run_in_processes(groups, loads: list[float], total: int, done_dirs, train_dirs, workers: int, bar, say,
                      progress: bool) -> tuple[list[dict], dict]:
    """The method groups in ``workers`` fresh (spawned) processes, the largest estimated load first;
    the records in the stages' order. Each process gets an equal share of torch's threads (at least
    one), so that the processes do not oversubscribe the cores: a stage without --threads computes
    as ``--jobs 1`` with that many threads would (thread counts change float rounding)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    threads = process_threads(torch.get_num_threads(), workers)
    order = sorted(range(len(groups)), key=lambda k: -loads[k])
    results: dict[int, tuple[list[dict], dict]] = {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_group_in_process, groups[k], total, done_dirs, train_dirs, threads, progress): k
                   for k in order}
        for future in as_completed(futures):
            k = futures[future]
            try:
                results[k] = future.result()
            except Exception as exc:  # noqa: BLE001 - the worker died: its stages are failures, rerun resumes
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                say(f"{groups[k][0][1].method}: its worker process failed ({reason}); rerun with the same --out")
                results[k] = ([{"method": st.method, "stage": st.name, "status": "failed", "seconds": None,
                                "source": "-"} for _, st in groups[k]],
                              {(st.method, st.name): reason for _, st in groups[k] if not st.resumable.complete()})
            bar.update(len(groups[k]))
    records, failed = [], {}
    for k in range(len(groups)):
        records += results[k][0]
        failed.update(results[k][1])
    return records, failed


def stage_estimates(stages: list[Stage]) -> list[float]:
    """Each stage's estimated seconds, in order (``fedsec.estimate``): a training shared between stages
    counts in the first that needs it; a stage that does not apply counts zero."""
    if not stages:
        return []
    images = estimate.training_images(runner.prepare(stages[0].config))
    trained: set[str] = set()
    out = []
    for st in stages:
        cfg = st.config
        a = st.attack_settings.resolved(cfg.federation.seed) if st.kind == "attack" else None
        if a is not None:
            try:
                check_applicable(a.spec, runner.prepare(cfg))
            except UserError:  # found before anything trains: costs nothing
                out.append(0.0)
                continue
        key = training_key(cfg) if a is None else training_key(cfg.updated(rounds=a.rounds_to_train), a)
        rounds = 0 if key in trained else (cfg.federation.rounds if a is None else a.rounds_to_train)
        trained.add(key)
        own = images if cfg.data.train_images is None else cfg.data.train_images * cfg.federation.train.local_epochs
        work = (estimate.StageWork(st.method, cfg.data.clients, rounds, own) if a is None
                else estimate.attack_work(st.method, cfg.data.clients, own, a, rounds))
        out.append(estimate.seconds(work))
    return out


def _one_stage(st: Stage, label: str, done_dirs, train_dirs, failed: dict, say,
               trainings: TrainingCache | None = None) -> dict:
    stage = st.resumable
    stage.clear_partial_copy()
    source = "computed"
    if stage.complete():
        source = "done earlier"
    elif (found := find_reusable(st, done_dirs, train_dirs)) is not None:
        stage.copy_from(found, {"status": "done", "seconds": None}, reused_from=str(found.resolve()))
        source = f"reused {found}"
    else:
        say(f"{label}: running ...")
        try:
            run_stage(st, trainings)
        except Exception as exc:  # noqa: BLE001 - recorded, reported, retried by the next run
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            failed[(st.method, st.name)] = reason
            say(f"{label}: FAILED ({reason}); rerun with the same --out to retry it")
            return {"method": st.method, "stage": st.name, "status": "failed", "seconds": None, "source": "-"}
    done = stage.record() or {}
    status, reason, secs = done.get("status", "?"), done.get("reason"), done.get("seconds")
    say(f"{label}: {status.replace('_', ' ')}" + (f" ({reason})" if reason else "")
        + (f" in {secs:.1f} s" if source == "computed" and secs is not None else f" [{source}]"))
    return {"method": st.method, "stage": st.name, "status": status.replace("_", " "), "seconds": secs,
            "source": source if not source.startswith("reused") else "reused"}
