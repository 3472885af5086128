"""Library functions behind ``fedsec flower attack|audit``: run the app in Flower's simulation engine
with the recorder wrapped in, then hand the recorded run (``attacks.recorded.RecordedRun``) to the same
harnesses as the native commands (the library's ``attacks.harness.attack_recorded``, written by
``fedsec.jobs.attack.write_attack``; ``fedsec.jobs.audit.audit_recorded``).

The app's declaration (``fedsec.flower.declaration``) supplies what the harness needs and cannot
observe: the model at its initial weights, the pooled data set, the protocol the app follows, the local
SGD settings. Run-config keys the harness sets itself (a key the user sets with ``run_config`` wins):

* the declared ``rounds-key``: an attack stops the app after the last attacked round (Flower round
  max + 1) unless ``AttackSettings.train_rounds`` says otherwise;
* the declared ``victim-keys``: with ``victim_batch`` B >= 1 the attacked rounds run in the textbook
  setting, for every node of those rounds (the targets are chosen after the run, from the nodes that
  answered); an app that declares no victim keys can only be attacked on its real local training
  (``victim_batch=0``).

Targets are chosen as in ``fedsec attack`` (``choose_targets``: seeded, from the clients recorded in the
round); the attack seed defaults to 0 (fedsec cannot know which run-config key is the app's seed).
Every check on flags, app, declaration and applicability runs before the simulation; the declaration
is held to the recorded traffic before anything is written.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import torch

from attacks.harness import attack_recorded
from attacks.recorded import RecordedRun
from fedecouple.devices import device_record
from fedecouple.errors import UserError
from fedecouple.methods.base import upload_kinds

from ..invocation import Request
from ..jobs.attack import AttackSettings, write_attack
from ..jobs.audit import audit_recorded, gather_evidence
from ..recording import choose_targets
from .app import read_app
from .declaration import Declaration, load_declaration
from .simulation import FlowerRun, simulate


def default_out(command: str, app_dir: str | Path, attack: str | None = None) -> str:
    name = Path(app_dir).resolve().name
    return f"runs/flower-{command}-{attack}-{name}" if attack else f"runs/flower-{command}-{name}"


def plan(app_dir: str | Path, run_config: dict | None, rounds: int | None = None, rounds_required: bool = False,
         victim: tuple[int, int, Iterable[int]] | None = None) -> tuple[dict, Declaration]:
    """The run-config overrides for a run of ``app_dir``: the user's ``run_config`` plus ``rounds`` Flower
    rounds and the victim setting (batch, steps, fedsec rounds), through the declared keys; and the
    declaration under them. Without a declared rounds-key, ``rounds`` is an error when
    ``rounds_required`` and ignored otherwise (the app runs its own number of rounds)."""
    app = read_app(app_dir)
    overrides = dict(run_config or {})
    declaration = load_declaration(app, app.run_config(overrides))
    if rounds is not None:
        if declaration.rounds_key is not None:
            overrides.setdefault(declaration.rounds_key, int(rounds))
        elif rounds_required:
            raise UserError(f"{app.directory / 'pyproject.toml'} [tool.fedsec] names no rounds-key, so fedsec cannot "
                            f"set the number of rounds; set it with --run-config or declare rounds-key")
    if victim is not None and victim[0] > 0:
        keys = declaration.victim_keys
        if keys is None:
            raise UserError(f"{app.directory / 'pyproject.toml'} [tool.fedsec] declares no victim-keys, so the app "
                            f"cannot run the textbook setting; pass --victim-batch 0 to attack its real local training")
        batch, steps, victim_rounds = victim
        for key, value in ((keys["batch"], int(batch)), (keys["steps"], int(steps)),
                           (keys["rounds"], ",".join(str(r + 1) for r in victim_rounds))):
            overrides.setdefault(key, value)
    return overrides, load_declaration(app, app.run_config(overrides))


def recorded_run(run: FlowerRun, device: str = "cpu") -> RecordedRun:
    """A recorded Flower run as the attack and audit harnesses take it (attacks run in this process, the
    gradient attacks on ``device``; the app's own training runs wherever the app puts it)."""
    declaration = run.declaration
    return RecordedRun(recorder=run.recorder, ground_truth=run.ground_truth, dataset=declaration.dataset,
                       method=declaration.method, make_model=declaration.make_model, train=declaration.train,
                       label=run.label, device=device)


def run_facts(run: FlowerRun) -> dict:
    """What the summaries record about the Flower run."""
    import flwr

    return {"flower": {"app": str(run.app.directory), "run_config": run.run_config, "nodes": run.nodes,
                       "rounds": len(run.rounds()), "declaration": run.declaration.source,
                       "clients": {str(c): info for c, info in run.clients.items()},
                       "simulation_seconds": round(run.seconds, 2), "flwr": flwr.__version__}}


def attack_app(app_dir: str | Path, settings: AttackSettings, *, nodes: int | None = None,
               run_config: dict | None = None, out: str | Path | None = None, ray_cpus: int | None = None,
               quiet: bool = True, progress: bool = True, interceptors: Iterable = (), device: str = "cpu",
               outcomes: list | None = None, simulated: FlowerRun | None = None) -> dict:
    """Run the app up to the last attacked round, attack ``settings.targets`` recorded clients per attacked
    round, score, write ``attack.csv``, ``summary.json``, ``reconstructions.png`` into ``out``; returns the
    summary (the ``AttackOutcome`` appended to ``outcomes`` when given). ``interceptors`` act on the replies
    before the app's strategy aggregates them. ``simulated``: a run of the app that recorded every round
    (an audit's); an attack on the clients' real local training attacks it instead of running the app again
    (the same seeds give the same uploads), one in the victim setting still runs its own."""
    from .secagg import is_secure_app

    if settings.spec.round_level and is_secure_app(app_dir):  # the server holds only sums: attack those
        return attack_secure_app(app_dir, settings, nodes=nodes, run_config=run_config, out=out, ray_cpus=ray_cpus,
                                 quiet=quiet, progress=progress, device=device, outcomes=outcomes)
    start = time.perf_counter()
    settings = settings.resolved(seed=0)
    overrides, declaration = plan(app_dir, run_config, rounds=settings.rounds_to_train,
                                  rounds_required=settings.train_rounds is not None,
                                  victim=(settings.victim_batch, settings.victim_steps, settings.rounds))
    reason = settings.spec.not_applicable(declaration.method.name,
                                          upload_kinds(declaration.method, declaration.make_model()))
    if reason is None and settings.spec.malicious:
        reason = (f"{settings.spec.name} is a malicious-server attack: it needs a server that crafts the downloads, "
                  f"and a Flower app's server is the app's own (fedsec records it, it does not replace it); run it in "
                  f"fedsec's engine: fedsec attack {settings.spec.name} --method {declaration.method.name}")
    if reason is not None:
        raise UserError(reason)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        reuse = (simulated is not None and not settings.victim_batch and not interceptors
                 and all(simulated.participants(r) for r in settings.rounds))
        run = simulated if reuse else simulate(app_dir, nodes=nodes, run_config=overrides,
                                               record_rounds=settings.rounds, threads=settings.threads,
                                               ray_cpus=ray_cpus, quiet=quiet, interceptors=interceptors)
        missing = [r for r in settings.rounds if not run.participants(r)]
        if missing:
            raise UserError(f"no upload was recorded in round {missing[0]} (Flower round {missing[0] + 1}): the app "
                            f"ran {len(run.rounds())} round(s); raise its number of rounds or lower --attack-rounds")
        targets = choose_targets(run.participants, settings)
        args = settings.split()
        outcome = attack_recorded(recorded_run(run, device), args.spec, targets, args.threat, args.budget,
                                  seed=args.seed, batched=args.batched, victim=args.victim, threads=args.threads,
                                  progress=progress)
    finally:
        torch.set_num_threads(previous_threads)
    if outcomes is not None:
        outcomes.append(outcome)
    return write_attack(out, settings, targets, outcome, {**run_facts(run), **device_record(device)}, start,
                        notes=run.notes)


def audit_app(app_dir: str | Path, *, nodes: int | None = None, run_config: dict | None = None,
              rounds: int | None = None, evidence: bool = True, evidence_iterations: int = 300,
              out: str | Path, ray_cpus: int | None = None, threads: int = 1, quiet: bool = True,
              progress: bool = True, device: str = "cpu") -> dict:
    """Run the app, recording every round, and audit every upload its server received; writes
    ``audit.csv``, ``findings.json``, ``audit.md``, ``summary.json`` into ``out`` (and, with ``evidence``,
    each evidence attack's outputs under ``out/evidence/<attack>/``: an attack on the real local training
    attacks this run, one in the victim setting runs the app in it)."""
    start = time.perf_counter()
    overrides, declaration = plan(app_dir, run_config, rounds=rounds, rounds_required=rounds is not None)
    run = simulate(app_dir, nodes=nodes, run_config=overrides, threads=threads, ray_cpus=ray_cpus, quiet=quiet)
    recorded = recorded_run(run)
    measured: dict[str, dict] = {}
    if evidence and next(run.recorder.uploads(), None) is not None:
        measured = gather_evidence(declaration.method.name, recorded.upload_kinds(), lambda name: attack_app(
            app_dir, AttackSettings(attack=name, iterations=evidence_iterations, threads=threads), nodes=nodes,
            run_config=run_config, out=Path(out) / "evidence" / name, ray_cpus=ray_cpus, quiet=quiet,
            progress=progress, device=device, simulated=run))
    context = {"dataset": declaration.dataset.name, "clients": run.nodes, **run_facts(run), **device_record(device)}
    return audit_recorded(recorded, out, len(run.rounds()), measured, context, start)


# ------------------------------------------------------------------------------------------------
# an app under Flower's SecAgg+ (``fedsec.flower.secagg`` records it): what its honest server holds


def audit_secure_app(app_dir, *, nodes: int | None = None, run_config: dict | None = None, rounds: int | None = None,
                     evidence: bool = True, out=None, ray_cpus: int | None = None, threads: int = 1,
                     quiet: bool = True, progress: bool = True, device: str = "cpu") -> dict:
    """Run an app under Flower's SecAgg+, recording every round, and audit what its server received:
    ``fedsec.jobs.audit.audit_recorded``'s rows and traffic (the fields a masked upload carries unmasked of
    kind ``clear``), the findings of ``secagg.secure_findings`` and, with ``evidence``, ``sum-labels`` on every
    round. Writes audit.csv, findings.json, audit.md, summary.json into ``out`` (None: nothing written)."""
    from reports.audit import SEVERITIES

    from ..jobs.audit import sum_label_evidence, write_audit
    from .secagg import CLEAR, protocol_line, secure_findings

    start = time.perf_counter()
    overrides, declaration = plan(app_dir, run_config, rounds=rounds, rounds_required=rounds is not None)
    run = simulate(app_dir, nodes=nodes, run_config=overrides, threads=threads, ray_cpus=ray_cpus, quiet=quiet)
    if run.recorder.secure is None:
        raise UserError(f"{app_dir}: the ClientApp runs Flower's secure-aggregation mod but the ServerApp ran no "
                        f"SecAggPlusWorkflow; run the fit rounds with "
                        f"DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))")
    recorded = recorded_run(run, device)
    context = {"dataset": declaration.dataset.name, "clients": run.nodes, **run_facts(run), **device_record(device)}
    base = audit_recorded(recorded, None, len(run.rounds()), {}, context, start)
    rows = base["rows"]
    rows.loc[rows["field"] != "masked", "kind"] = CLEAR
    label, brief = sum_label_evidence(recorded, run.rounds(), progress) if evidence else (None, None)
    findings = [f for f in base["findings"] if f["code"] != "SECURE_AGGREGATION"] + secure_findings(run.recorder)
    findings = sorted(findings + ([label] if label else []), key=lambda f: SEVERITIES.index(f["severity"]))
    clear = sorted({n for up in run.recorder.uploads() for n in up.tensors if n != "masked"})
    summary = {**base["summary"], "secure_aggregation": protocol_line(run.recorder.secure, run.nodes, clear),
               "findings_by_severity": {s: sum(f["severity"] == s for f in findings) for s in SEVERITIES},
               "evidence": {"labels": brief} if brief else {}, "seconds": round(time.perf_counter() - start, 2)}
    if out is not None:
        write_audit(Path(out), rows, findings, summary)
    return {"summary": summary, "findings": findings, "rows": rows}


def attack_secure_app(app_dir, settings, *, nodes: int | None = None, run_config: dict | None = None, out=None,
                      ray_cpus: int | None = None, quiet: bool = True, progress: bool = True,
                      device: str = "cpu", outcomes: list | None = None) -> dict:
    """Run an app under Flower's SecAgg+ up to the last attacked round, recording every round, and run
    the round-level attack of ``settings`` (an ``AttackSettings`` naming an attack of kind
    ``"aggregate"``, e.g. sum-labels) on the attacked rounds' sums (``attacks.harness.rounds``); writes
    attack.csv and summary.json into ``out`` as ``write_attack`` does; returns the summary.
    The library path of ``fedsec flower attack`` for such an app."""
    from attacks.harness import attack_rounds

    from .secagg import refusal

    start = time.perf_counter()
    settings = settings.resolved(seed=0)
    if not settings.spec.round_level:
        raise UserError(refusal(app_dir, settings.spec.name))
    overrides, _ = plan(app_dir, run_config, rounds=settings.rounds_to_train,
                        rounds_required=settings.train_rounds is not None,
                        victim=(settings.victim_batch, settings.victim_steps, settings.rounds))
    previous = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        run = simulate(app_dir, nodes=nodes, run_config=overrides, threads=settings.threads, ray_cpus=ray_cpus,
                       quiet=quiet)  # every round recorded: a multi-round attack reads the earlier sums
        missing = [r for r in settings.rounds if r not in run.recorder.aggregates]
        if missing:
            raise UserError(f"round {missing[0]} (Flower round {missing[0] + 1}) was not run: the app ran "
                            f"{len(run.recorder.aggregates)} round(s); raise its number of rounds or lower "
                            f"--attack-rounds")
        args = settings.split()
        outcome = attack_rounds(recorded_run(run, device), args.spec, list(settings.rounds), args.threat, args.budget,
                                seed=args.seed, victim=args.victim, threads=args.threads, progress=progress)
    finally:
        torch.set_num_threads(previous)
    targets = {r: list(run.recorder.aggregates[r].survivors) for r in settings.rounds}
    if outcomes is not None:
        outcomes.append(outcome)
    return write_attack(out, settings, targets, outcome, {**run_facts(run), **device_record(device)}, start,
                        notes=run.notes)


# ------------------------------------------------------------------------------------------------
# a SecAgg+ server that deviates from the protocol (``fedsec.flower.malicious_workflow``)

from . import SECAGG_DEFENSES  # noqa: E402  (the client mods of ``secagg_defences``)
RECOVERY_COLUMNS = ["round", "client", "node_id", "attack", "defense", "num_shares", "threshold", "holders",
                    "sybil_neighbours", "sybil_fraction", "seed_shares", "key_shares", "recovered", "relative_error",
                    "max_error", "bound", "within_bound", "clipped_values", "delta_relative_error", "round_completed",
                    "refusals", "reason"]


def server_attacks() -> dict[str, str]:
    from .malicious_workflow import SERVER_ATTACKS

    return dict(SERVER_ATTACKS)


def _app_defenses(client_app) -> tuple[list, bool]:
    """The app's own mods, and whether one of them runs the signed rounds (the server must then run them)."""
    from .secagg_defences import SignedConsistency

    mods = list(getattr(client_app, "_mods", ()))
    return mods, any(isinstance(m, SignedConsistency) for m in mods)


def _defense_mods(defense: str, folder: Path) -> list:
    from .secagg_defences import KeyDirectory, SignedConsistency, UnmaskListCheck

    if defense == "unmask-check":
        return [UnmaskListCheck()]
    if defense == "signed-consistency":
        return [SignedConsistency(KeyDirectory(folder / "keys"))]
    return []


def _recovery_rows(workflow, run: FlowerRun, tap: dict, defense: str) -> tuple[list[dict], dict]:
    """One row per target of every attacked round, and (round, client) → (num_examples, recovered arrays)."""
    import numpy as np

    from .malicious_workflow import decode_update, max_error, relative_error, update_bound

    client_of = {int(info["node_id"]): int(cid) for cid, info in run.clients.items()}
    rows, recovered = [], {}
    for report in workflow.reports:
        fedsec_round = report.flower_round - 1
        for target, outcome in sorted(report.targets.items()):
            client = client_of.get(target)
            row = {"round": fedsec_round, "client": client, "node_id": target, "attack": report.attack,
                   "defense": defense, "num_shares": report.num_shares, "threshold": report.threshold,
                   "holders": outcome.holders, "sybil_neighbours": outcome.sybil_neighbours,
                   "sybil_fraction": outcome.sybil_neighbours / max(outcome.holders - 1, 1),
                   "seed_shares": outcome.seed_shares, "key_shares": outcome.key_shares,
                   "recovered": outcome.vector is not None, "relative_error": None, "max_error": None, "bound": None,
                   "within_bound": None, "clipped_values": None, "delta_relative_error": None,
                   "round_completed": report.completed,
                   "refusals": len(report.refused), "reason": outcome.reason}
            if outcome.vector is not None:
                weight, arrays = decode_update(outcome.vector, workflow.clipping_range, workflow.quantization_range)
                bound = update_bound(workflow.clipping_range, workflow.quantization_range, weight)
                row["bound"] = bound
                truth = tap.get((report.flower_round, target))
                if truth is not None:
                    count, true_arrays = truth
                    w = weight / workflow.quantization_range
                    inside = [np.abs(np.asarray(a, np.float64) * w) <= workflow.clipping_range for a in true_arrays]
                    clipped = int(sum((~m).sum() for m in inside))
                    worst = max(float(np.max(np.abs(r - np.asarray(t, np.float64))[m], initial=0.0))
                                for r, t, m in zip(arrays, true_arrays, inside))
                    row.update(relative_error=relative_error(arrays, true_arrays),
                               max_error=max_error(arrays, true_arrays), within_bound=bool(worst <= bound),
                               clipped_values=clipped)
                    exchange = run.recorder.get(fedsec_round, client) if client is not None else None
                    if exchange is not None and exchange.download is not None:
                        # what a gradient attack reads: the change from the download, where the rounding weighs most
                        sent = [exchange.download.tensors[n].double().numpy()
                                for n in run.declaration.model_parameters()]
                        row["delta_relative_error"] = relative_error([r - s for r, s in zip(arrays, sent)],
                                                                     [np.asarray(t, np.float64) - s
                                                                      for t, s in zip(true_arrays, sent)])
                if client is not None:
                    recovered[fedsec_round, client] = (outcome.num_examples, arrays, truth)
            rows.append(row)
    return rows, recovered


def _plain_run(run: FlowerRun, updates: dict, device: str) -> RecordedRun:
    """The run as a server without SecAgg+ would have recorded it, for the (round, client)s of ``updates``
    ((round, client) → (num_examples, arrays)): each one's download as sent and its update in the clear."""
    import numpy as np

    from fedecouple.channel import Recorder, Upload

    from .convert import SAMPLE_COUNT

    names = list(run.declaration.model_parameters())
    recorder = Recorder()
    for (round, client), (count, arrays) in sorted(updates.items()):
        exchange = run.recorder.get(round, client)
        recorder.on_download(exchange.download)
        tensors = {name: torch.from_numpy(np.asarray(a, dtype=np.float32).copy()) for name, a in zip(names, arrays)}
        tensors[SAMPLE_COUNT] = torch.tensor(int(count))
        recorder.on_upload(Upload(round, client, tensors, meta={"flower_round": round + 1}))
    declaration = run.declaration
    return RecordedRun(recorder=recorder, ground_truth=run.ground_truth, dataset=declaration.dataset,
                       method=declaration.method, make_model=declaration.make_model, train=declaration.train,
                       label=run.label, device=device)


def _image_attack(run: FlowerRun, recovered: dict, settings: AttackSettings, out: Path | None, start: float,
                  device: str, progress: bool) -> dict:
    """The image attack of ``settings`` on the unmasked updates and, paired, on the same nodes' true updates."""
    from attacks.metrics import paired_difference

    from ..recording import pick_targets

    by_round: dict[int, list[int]] = {}
    for round, client in recovered:
        by_round.setdefault(round, []).append(client)
    targets = {r: pick_targets(sorted(cs), settings.targets, settings.seed, r) for r, cs in sorted(by_round.items())}
    chosen = [(r, c) for r, cs in targets.items() for c in cs]
    unmasked = {key: (recovered[key][0], recovered[key][1]) for key in chosen}
    plain = {key: (recovered[key][2][0], recovered[key][2][1]) for key in chosen if recovered[key][2] is not None}
    args = settings.split()
    context = {**run_facts(run), **device_record(device)}
    outcomes = {}
    for name, updates in (("unmasked-update", unmasked), ("plain-update", plain)):
        outcome = attack_recorded(_plain_run(run, updates, device), args.spec, targets, args.threat, args.budget,
                                  seed=args.seed, batched=args.batched, victim=args.victim, threads=args.threads,
                                  progress=progress)
        summary = write_attack(None if out is None else out / name, settings, targets, outcome, context, start)
        outcomes[name] = (outcome, summary)
    paired = paired_difference(outcomes["unmasked-update"][0].rows, outcomes["plain-update"][0].rows, seed=args.seed)
    brief = lambda s: {k: s.get(k) for k in ("mean_psnr", "mean_psnr_ci", "mean_prior_psnr", "max_psnr",  # noqa: E731
                                             "n_images", "n_targets", "interval_resamples")}
    return {"attack": settings.attack, "targets": {str(r): cs for r, cs in targets.items()},
            "unmasked_update": brief(outcomes["unmasked-update"][1]),
            "plain_update": brief(outcomes["plain-update"][1]),
            "paired_psnr_difference": paired}


def _server_attack_setup(app_dir, attack: str, settings: AttackSettings, image_attack: bool, defense: str,
                         sybils: int, nodes: int | None) -> tuple[AttackSettings, int]:
    """The checks made before a SecAgg+ server attack runs (one-line errors): (its resolved settings, the
    nodes it simulates)."""
    from .app import read_app
    from .malicious_workflow import SERVER_ATTACKS
    from .secagg import is_secure_app

    if attack not in SERVER_ATTACKS:
        raise UserError(f"unknown SecAgg+ server attack {attack!r}; choose one of: {', '.join(SERVER_ATTACKS)}")
    if defense not in SECAGG_DEFENSES:
        raise UserError(f"unknown --client-defense {defense!r}; choose one of: {', '.join(SECAGG_DEFENSES)}")
    if not is_secure_app(app_dir):
        raise UserError(f"{attack} attacks Flower's SecAgg+, but {app_dir}'s ClientApp runs no secaggplus_mod; its "
                        f"server sees each upload: run a per-client attack, e.g. fedsec flower attack ig {app_dir}")
    if attack == "sybil":
        settings = replace(settings, rounds=tuple(range(int(sybils) + 1)))
    settings = settings.resolved(seed=0)
    spec = settings.spec
    if image_attack and (spec.round_level or spec.malicious or not spec.rebuilds_images):
        raise UserError(f"--image-attack {spec.name}: the image attack on an unmasked update must rebuild images from "
                        f"one node's upload (e.g. ig or dlg)")
    app = read_app(app_dir)
    count = app.num_supernodes if nodes is None else int(nodes)
    if attack == "sybil" and (count is None or count < int(sybils) + 2):
        raise UserError(f"sybil needs at least --sybils + 2 = {int(sybils) + 2} nodes (the sybils, the target and one "
                        f"honest node), got {count}; raise --nodes or lower --sybils")
    return settings, count


def attack_secagg_server(app_dir: str | Path, attack: str, settings: AttackSettings, *, image_attack: bool = True,
                         defense: str = "none", sybils: int = 2, nodes: int | None = None,
                         run_config: dict | None = None, out: str | Path | None = None, ray_cpus: int | None = None,
                         quiet: bool = True, progress: bool = True, device: str = "cpu") -> dict:
    """Run an app under Flower's SecAgg+ with ``MaliciousSecAggPlusWorkflow`` following ``attack`` in place
    of its workflow, its nodes behind the client ``defense`` (``SECAGG_DEFENSES``); compare each unmasked
    update with the node's true update; with ``image_attack``, run ``settings.attack`` on the unmasked
    updates and on the true ones (paired). ``settings``: the attacked rounds (``sybil``: rounds 0 to
    ``sybils``, round r with r sybil nodes next to the target), the targets per round, the image attack's
    budget and victim setting. Writes recovery.csv and summary.json (and the image attacks' outputs under
    unmasked-update/ and plain-update/) into ``out``; returns the summary."""
    import tempfile

    import pandas as pd

    from .. import io
    from .app import read_app
    from .malicious_workflow import AttackPlan, MaliciousSecAggPlusWorkflow, PlaintextTap, SybilMod, read_tap

    start = time.perf_counter()
    settings, count = _server_attack_setup(app_dir, attack, settings, image_attack, defense, sybils, nodes)
    app = read_app(app_dir)
    overrides, declaration = plan(app_dir, run_config, rounds=settings.rounds_to_train, rounds_required=True,
                                  victim=(settings.victim_batch, settings.victim_steps, settings.rounds))
    _, app_signed = _app_defenses(app.load("clientapp"))
    flower_rounds = tuple(r + 1 for r in settings.rounds)
    attack_plan = AttackPlan(attack, rounds=flower_rounds,
                             targets=1 if attack in ("sybil", "split-view") else settings.targets,
                             sybils={r + 1: r for r in settings.rounds} if attack == "sybil" else {},
                             seed=settings.seed)
    signed = True if (defense == "signed-consistency" or app_signed) else None
    made: list = []

    def swap(workflow):
        made.append(MaliciousSecAggPlusWorkflow.like(workflow, attack_plan, signed_rounds=signed))
        return made[-1]

    previous = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="fedsec-secagg-") as folder:
            folder = Path(folder)
            mods = ([SybilMod(range(count - int(sybils), count))] if attack == "sybil" else []) + \
                _defense_mods(defense, folder) + [PlaintextTap(folder / "tap")]
            run = simulate(app_dir, nodes=count, run_config=overrides, threads=settings.threads, ray_cpus=ray_cpus,
                           quiet=quiet, secagg_workflow=swap, client_mods=mods, expect_refusals=True)
            tap = read_tap(folder / "tap")
        if not made:
            raise UserError(f"{app_dir}: the ClientApp runs Flower's secure-aggregation mod but the ServerApp ran no "
                            f"SecAggPlusWorkflow; run the fit rounds with "
                            f"DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))")
        workflow = made[0]
        rows, recovered = _recovery_rows(workflow, run, tap, defense)
        images = None
        if image_attack and recovered:
            images = _image_attack(run, recovered, settings, None if out is None else Path(out), start, device,
                                   progress)
    finally:
        torch.set_num_threads(previous)
    summary = _server_attack_summary(attack, defense, workflow, run, rows, images, settings, sybils, start)
    if out is not None:
        out = Path(out)
        io.write_csv(out / "recovery.csv", pd.DataFrame(rows, columns=RECOVERY_COLUMNS))
        io.write_json(out / "summary.json", io.finite(summary))
    return summary


def _server_attack_summary(attack, defense, workflow, run, rows, images, settings, sybils, start) -> dict:
    import numpy as np

    errors = [r["relative_error"] for r in rows if r["relative_error"] is not None]
    deltas = [r["delta_relative_error"] for r in rows if r["delta_relative_error"] is not None]
    refused = {str(r.flower_round - 1): {str(n): why for n, why in r.refused.items()} for r in workflow.reports}
    summary = {"attack": attack, "defense": defense, "run": run.label,
               "protocol": {"num_shares": workflow.reports[0].num_shares if workflow.reports else None,
                            "threshold": workflow.reports[0].threshold if workflow.reports else None,
                            "clipping_range": workflow.clipping_range,
                            "quantization_range": workflow.quantization_range, "modulus": workflow.modulus_range,
                            "max_weight": workflow.max_weight, "signed_rounds": workflow.signed_rounds},
               "attack_rounds": [r.flower_round - 1 for r in workflow.reports],
               "targets": len(rows), "recovered": sum(bool(r["recovered"]) for r in rows),
               "relative_error": {"median": float(np.median(errors)) if errors else None,
                                  "max": float(max(errors)) if errors else None},
               "delta_relative_error": {"median": float(np.median(deltas)) if deltas else None,
                                        "max": float(max(deltas)) if deltas else None},
               "within_bound": all(r["within_bound"] for r in rows if r["recovered"]) if errors else None,
               "rounds_completed": [r.flower_round - 1 for r in workflow.reports if r.completed],
               "refusals": refused}
    if attack == "sybil":
        leakage = [{"round": r["round"], "sybil_neighbours": r["sybil_neighbours"],
                    "sybil_fraction": r["sybil_fraction"], "threshold": r["threshold"],
                    "unmasked": bool(r["recovered"])} for r in rows]
        unmasked = [x["sybil_neighbours"] for x in leakage if x["unmasked"]]
        summary["sybils"] = int(sybils)
        summary["leakage"] = leakage
        summary["unmasked_from_sybil_neighbours"] = min(unmasked) if unmasked else None
    if images is not None:
        summary["image_attack"] = images
    summary.update({**run_facts(run), "failures": run.failures[:20], "notes": run.notes,
                    "settings": {"attack_rounds": list(settings.rounds), "targets": settings.targets,
                                 "image_attack": settings.attack, "iterations": settings.iterations,
                                 "victim_batch": settings.victim_batch, "seed": settings.seed},
                    "seconds": round(time.perf_counter() - start, 2)})
    return summary


def server_attack_lines(summary: dict, out) -> list[str]:
    """What ``fedsec flower attack <SecAgg+ server attack>`` prints."""
    defense = summary["defense"]
    against = "no client defense" if defense == "none" else f"client defense {defense}"
    error = summary["relative_error"]
    head = (f"{summary['run']}: {summary['attack']} ({against}): the server unmasked {summary['recovered']} of "
            f"{summary['targets']} targeted upload(s) in round(s) {', '.join(map(str, summary['attack_rounds']))}")
    if error["median"] is not None:
        bound = "within" if summary["within_bound"] else "NOT within"
        head += (f"; relative error vs the true update: median {error['median']:.2g}, max {error['max']:.2g} "
                 f"({bound} the quantisation bound)")
        delta = summary.get("delta_relative_error") or {}
        if delta.get("median") is not None:
            head += f", of its change from the download: median {delta['median']:.2g}"
    lines = [head + f" → {out}"]
    refusals = sum(len(v) for v in summary["refusals"].values())
    if refusals:
        completed = summary["rounds_completed"]
        lines.append(f"  {refusals} node(s) refused to answer; round(s) completed: "
                     f"{', '.join(map(str, completed)) if completed else 'none (SecAgg+ halted)'}")
    for item in summary.get("leakage", []):
        lines.append(f"  round {item['round']}: {item['sybil_neighbours']} sybil neighbour(s) of the target "
                     f"({item['sybil_fraction']:.0%} of its neighbours), threshold {item['threshold']}: "
                     + ("unmasked" if item["unmasked"] else "not unmasked"))
    images = summary.get("image_attack")
    if images:
        def psnr(s):
            ci = s.get("mean_psnr_ci")
            return (f"{s['mean_psnr']:.1f} dB" + (f" [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "")
                    if s.get("mean_psnr") is not None else "n/a")

        paired = images["paired_psnr_difference"]
        diff, ci = paired.get("mean_difference"), paired.get("ci")
        difference = "n/a" if diff is None else f"{diff:+.2f} dB" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")
        lines.append(f"  {images['attack']} on the unmasked updates: mean PSNR {psnr(images['unmasked_update'])}; on "
                     f"the plain updates: {psnr(images['plain_update'])}; paired difference {difference} over "
                     f"{paired.get('n_pairs', 0)} image(s)")
    return lines


def server_attack_command(request: Request) -> None:
    """``fedsec flower attack <SecAgg+ server attack> APP_DIR``: the run above in the command's output folder
    (its folder record and config.toml as every command), its lines printed."""
    import click

    from .. import io
    from ..config_file import write_config
    from ..invocation import identity
    from ..jobs.attack import parse_rounds
    from ..options import THREAT_MODEL, iterations_for
    from ..resumable import RunFolder
    from .app import parse_run_config

    p = dict(request.params)
    attack, app_dir = p["attack"], p["app_dir"]
    if app_dir is None:
        raise UserError(f"fedsec flower attack {attack} needs APP_DIR, e.g. fedsec flower attack {attack} "
                        f"examples/flower_secagg")
    if attack == "sybil" and p.get("attack_rounds"):
        raise UserError("sybil attacks rounds 0 to --sybils (round r with r sybil neighbours); drop --attack-rounds")
    image = p["image_attack"] if p["image_attack"] not in (None, "none") else "ig"  # "ig" only sets the budget
    rounds = p["attack_rounds"] or "0"
    settings = AttackSettings(attack=image, rounds=tuple(parse_rounds(rounds)), targets=p["targets"],
                              iterations=iterations_for(p["iterations"], image), restarts=p["restarts"],
                              images=p["images"], victim_batch=p["victim_batch"], victim_steps=p["victim_steps"],
                              seed=p["seed"] if p["attack_seed"] is None else p["attack_seed"],
                              train_rounds=p["rounds"],
                              threads=p["threads"], **{k: p[k] for k in THREAT_MODEL})
    done = settings.resolved(seed=0)
    resolved = {**p, "attack_option": None, "attack_rounds": rounds,
                "iterations": done.iterations, "restarts": done.restarts, "victim_batch": done.victim_batch,
                "attack_seed": done.seed}
    out = Path(p["out"] or default_out("attack", app_dir, attack))
    folder = RunFolder(out, identity({**resolved, "app_dir": Path(app_dir).resolve().name}),
                       required=("recovery.csv", "summary.json"))
    if folder.claim(p["force"]) == "done":
        summary = io.read_json(out / "summary.json")
    else:
        summary = attack_secagg_server(app_dir, attack, settings, image_attack=p["image_attack"] != "none",
                                       defense=p["client_defense"], sybils=p["sybils"], nodes=p["nodes"],
                                       run_config=parse_run_config(p["run_config"]), out=out, ray_cpus=p["ray_cpus"],
                                       quiet=not p["flower_log"], device=p["device"])
        write_config(out, "flower attack", resolved)
        folder.done()
    for line in server_attack_lines(summary, out):
        click.echo(line)


# ------------------------------------------------------------------------------------------------
# ``fedsec flower audit`` of a SecAgg+ app: what a server that deviates from the protocol can do


def _demonstration_mods(mods: list, folder: Path) -> list:
    """The app's mods for an in-process demonstration: a ``SignedConsistency`` gets a fresh, temporary key
    directory (the demonstration's nodes are not the app's)."""
    from .secagg_defences import KeyDirectory, SignedConsistency

    return [SignedConsistency(KeyDirectory(folder), quorum=m.quorum) if isinstance(m, SignedConsistency) else m
            for m in mods]


def demonstrate(attack: str, mods: list, *, signed: bool, nodes: int = 4, num_shares: int = 3,
                threshold: int = 2) -> dict:
    """One round of ``attack`` in this process (``malicious_workflow.run_in_process``) against nodes that run
    ``mods`` around a fixed update: what the deviating server got, measured."""
    import tempfile

    from .malicious_workflow import (AttackPlan, MaliciousSecAggPlusWorkflow, decode_update, max_error,
                                     relative_error, run_in_process, update_bound)

    workflow = MaliciousSecAggPlusWorkflow(num_shares, threshold, plan=AttackPlan(attack, rounds=(1,), targets=1),
                                           signed_rounds=signed, max_weight=100.0)
    with tempfile.TemporaryDirectory(prefix="fedsec-demo-") as folder:
        done = run_in_process(workflow, lambda i: _demonstration_mods(mods, Path(folder)), nodes=nodes)
    report = workflow.reports[0]
    (target, outcome), = report.targets.items()
    result = {"attack": attack, "nodes": nodes, "num_shares": num_shares, "threshold": threshold,
              "recovered": outcome.vector is not None, "round_completed": report.completed,
              "refused": len(report.refused), "seconds": round(done.seconds, 2)}
    if outcome.vector is not None:
        weight, arrays = decode_update(outcome.vector, workflow.clipping_range, workflow.quantization_range)
        result.update(relative_error=relative_error(arrays, done.updates[target]),
                      max_error=max_error(arrays, done.updates[target]),
                      bound=update_bound(workflow.clipping_range, workflow.quantization_range, weight))
    else:
        result["why_not"] = outcome.reason or next(iter(report.refused.values()), "")[:200]
    return result


def secagg_protocol_findings(app_dir, evidence: bool = True) -> list[dict]:
    """What a server that deviates from SecAgg+ can do against the app's own client mods under the installed
    Flower: the unmask request answered for a node listed both as surviving and as dropped, the relayed
    public keys taken on trust (both demonstrated in this process when ``evidence``: one round, 4 nodes,
    the app's mods around a fixed update), and the 32-bit mask seed (read from the installed source and
    measured)."""
    import flwr

    from .app import read_app
    from .malicious_workflow import mask_seed_evidence

    version = flwr.__version__
    mods, signed = _app_defenses(read_app(app_dir).load("clientapp"))
    names = [getattr(m, "__name__", type(m).__name__) for m in mods]
    findings = []
    for attack, what in (("unmask-dropout", "a node listed to its neighbours both as surviving and as dropped"),
                         ("key-substitution", "public keys the server relays in place of a node's neighbours'")):
        unmasking = attack == "unmask-dropout"
        if evidence:
            try:
                shown = demonstrate(attack, mods, signed=signed)
            except Exception as exc:  # noqa: BLE001 - the app's mods may need what a demonstration lacks
                shown = {"attack": attack, "recovered": None, "why_not": f"{type(exc).__name__}: {exc}"[:200]}
        else:
            shown = {"attack": attack, "recovered": None, "why_not": "not demonstrated (--no-evidence)"}
        evidence_of = {"flwr": version, "client_mods": names, "demonstration": shown}
        if shown.get("recovered") is False:
            findings.append({"severity": "info",
                             "code": "UNMASK_REQUEST_CHECKED" if unmasking else "RELAYED_KEYS_AUTHENTICATED",
                             "finding": f"The app's client mods ({', '.join(names)}) refused the deviating server's "
                                        f"{attack} ({what}): it unmasked nothing in a round run in this process "
                                        f"({shown.get('why_not', '')[:160]}).",
                             "evidence": evidence_of})
            continue
        measured = (f"demonstrated in a round run in this process: the target's update recovered with relative error "
                    f"{shown['relative_error']:.1e}, within the quantisation bound"
                    if shown.get("recovered") else f"not demonstrated: {shown.get('why_not', '')}")
        sentence = {"unmask-dropout": f"Under Flower {version}, the app's client mods ({', '.join(names)}) answer "
                                      f"an unmask request for {what} with both of its secrets (its self-mask-seed "
                                      f"share and its secret-key share): a server that asks so unmasks that node's "
                                      f"upload; {measured}. Fix: fedsec.flower.secagg_defences.UnmaskListCheck or "
                                      f"SignedConsistency before secaggplus_mod.",
                    "key-substitution": f"Under Flower {version}, nothing authenticates the {what.split(' in ')[0]}: "
                                        f"a server that substitutes its own keys for a node's neighbours' reads the "
                                        f"shares the node sends them and knows its pairwise masks, and unmasks its "
                                        f"upload with every unmask request honest; {measured}. Fix: "
                                        f"fedsec.flower.secagg_defences.SignedConsistency (keys signed under a PKI)."}
        findings.append({"severity": "high",
                         "code": "UNMASK_REQUEST_NOT_CHECKED" if unmasking else "RELAYED_KEYS_NOT_AUTHENTICATED",
                         "finding": sentence[attack], "evidence": evidence_of})
    seed = mask_seed_evidence(20000 if evidence else 2000)
    findings.append({"severity": "medium", "code": "MASK_SEED_32_BIT",
                     "finding": f"Flower {version}'s mask generator ({seed['function']}) folds every 32-byte seed "
                                f"to 32 bits (the XOR of its words): each self and pairwise mask is one of 2**32 "
                                f"sequences (different seeds with the same fold gave the same mask). A server that "
                                f"knows a node's pairwise masks (its secret key, e.g. from its neighbours' key shares) "
                                f"finds its self mask by trying every seed: {seed['core_hours_for_every_seed']:g} "
                                f"core-hour(s) on this machine ({seed['seeds_per_second_one_core']:,} seeds/s on one "
                                f"core).",
                     "evidence": {"flwr": version, **seed}})
    return findings


def secure_audit_command(request: Request) -> bool:
    """``fedsec flower audit`` when the app runs Flower's secure aggregation: ``audit_secure_app``
    (what an honest server held) plus ``secagg_protocol_findings`` (what a deviating one can do), in the
    command's output folder (its folder record and config.toml as every command), its lines printed.
    False, doing nothing, for any other app."""
    import click

    from reports.audit import SEVERITIES

    from .. import console, io
    from ..config_file import write_config
    from ..invocation import identity
    from ..jobs.audit import write_audit
    from ..resumable import RunFolder
    from .app import parse_run_config
    from .secagg import is_secure_app

    p = dict(request.params)
    if not is_secure_app(p["app_dir"]):
        return False
    out = Path(p["out"] or default_out("audit", p["app_dir"]))
    folder = RunFolder(out, identity({**p, "app_dir": Path(p["app_dir"]).resolve().name}),
                       required=("audit.csv", "summary.json", "findings.json"))
    if folder.claim(p["force"]) == "done":
        result = {"summary": io.read_json(out / "summary.json"), "findings": io.read_json(out / "findings.json")}
    else:
        result = audit_secure_app(p["app_dir"], nodes=p["nodes"], run_config=parse_run_config(p["run_config"]),
                                  rounds=p["rounds"], evidence=p["evidence"], out=None, ray_cpus=p["ray_cpus"],
                                  threads=p["threads"], quiet=not p["flower_log"], device=p["device"])
        findings = sorted(result["findings"] + secagg_protocol_findings(p["app_dir"], p["evidence"]),
                          key=lambda f: SEVERITIES.index(f["severity"]))
        summary = {**result["summary"], "findings_by_severity": {s: sum(f["severity"] == s for f in findings)
                                                                 for s in SEVERITIES}}
        write_audit(out, result["rows"], findings, summary)
        result = {"summary": summary, "findings": findings}
        write_config(out, "flower audit", p)
        folder.done()
    name = f"{result['summary']['run']} ({result['summary']['method']})"
    for line in console.audit_lines(name, result, out):
        click.echo(line)
    return True
