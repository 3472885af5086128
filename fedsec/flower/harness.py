"""Library functions behind ``fedsec flower attack|audit``: run the app in Flower's simulation engine
with the recorder wrapped in, then hand the recorded run (``attacks.recorded.RecordedRun``) to the same
harnesses as the native commands (the library's ``attacks.harness.attack_recorded``, written by
``fedsec.attack.write_attack``; ``fedsec.audit.audit_recorded``).

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
from pathlib import Path
from typing import Iterable

import torch

from attacks.harness import attack_recorded
from attacks.recorded import RecordedRun
from fedecouple.devices import device_record
from fedecouple.errors import UserError

from ..attack import AttackSettings, choose_targets, write_attack
from ..audit import audit_recorded, gather_evidence
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
               quiet: bool = True, progress: bool = True, interceptors: Iterable = (), device: str = "cpu") -> dict:
    """Run the app up to the last attacked round, attack ``settings.targets`` recorded clients per attacked
    round, score, write ``attack.csv``, ``summary.json``, ``reconstructions.png`` into ``out``; returns the
    summary. ``interceptors`` act on the replies before the app's strategy aggregates them."""
    from .secagg import attack_secure_app, is_secure_app

    if settings.spec.round_level and is_secure_app(app_dir):  # the server holds only sums: attack those
        return attack_secure_app(app_dir, settings, nodes=nodes, run_config=run_config, out=out, ray_cpus=ray_cpus,
                                 quiet=quiet, progress=progress, device=device)
    start = time.perf_counter()
    settings = settings.resolved(seed=0)
    overrides, declaration = plan(app_dir, run_config, rounds=settings.rounds_to_train,
                                  rounds_required=settings.train_rounds is not None,
                                  victim=(settings.victim_batch, settings.victim_steps, settings.rounds))
    reason = settings.spec.not_applicable(declaration.method.name,
                                          declaration.method.upload_kinds(declaration.make_model()))
    if reason is None and settings.spec.malicious:
        reason = (f"{settings.spec.name} is a malicious-server attack: it needs a server that crafts the downloads, "
                  f"and a Flower app's server is the app's own (fedsec records it, it does not replace it); run it in "
                  f"fedsec's engine: fedsec attack {settings.spec.name} --method {declaration.method.name}")
    if reason is not None:
        raise UserError(reason)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        run = simulate(app_dir, nodes=nodes, run_config=overrides, record_rounds=settings.rounds,
                       threads=settings.threads, ray_cpus=ray_cpus, quiet=quiet, interceptors=interceptors)
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
    return write_attack(out, settings, targets, outcome, {**run_facts(run), **device_record(device)}, start,
                        notes=run.notes)


def audit_app(app_dir: str | Path, *, nodes: int | None = None, run_config: dict | None = None,
              rounds: int | None = None, evidence: bool = True, evidence_iterations: int = 300,
              out: str | Path, ray_cpus: int | None = None, threads: int = 1, quiet: bool = True,
              progress: bool = True, device: str = "cpu") -> dict:
    """Run the app, recording every round, and audit every upload its server received; writes
    ``audit.csv``, ``findings.json``, ``audit.md``, ``summary.json`` into ``out`` (and, with ``evidence``,
    each evidence attack's outputs under ``out/evidence/<attack>/``, from its own simulation)."""
    start = time.perf_counter()
    overrides, declaration = plan(app_dir, run_config, rounds=rounds, rounds_required=rounds is not None)
    run = simulate(app_dir, nodes=nodes, run_config=overrides, threads=threads, ray_cpus=ray_cpus, quiet=quiet)
    recorded = recorded_run(run)
    measured: dict[str, dict] = {}
    if evidence and next(run.recorder.uploads(), None) is not None:
        measured = gather_evidence(declaration.method.name, recorded.upload_kinds(), lambda name: attack_app(
            app_dir, AttackSettings(attack=name, iterations=evidence_iterations, threads=threads), nodes=nodes,
            run_config=run_config, out=Path(out) / "evidence" / name, ray_cpus=ray_cpus, quiet=quiet,
            progress=progress, device=device))
    context = {"dataset": declaration.dataset.name, "clients": run.nodes, **run_facts(run), **device_record(device)}
    return audit_recorded(recorded, out, len(run.rounds()), measured, context, start)
