"""The commands' bodies, shared by the command line and the Python API (``fedsec.api``): each takes a
``Request`` (its command's settings, converted and checked) and a ``Shell`` (who called; both in
``fedsec.invocation``), checks its output folder (``fedsec.resumable``: refused when it holds another configuration, read back
when it holds this one's finished results), runs the job behind the command (``fedsec.jobs``) and
returns a result (``fedsec.results``); ``run_command`` is the command line's entry into them.
Heavy modules are imported here, inside the functions, so ``fedsec --help`` never loads torch."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from fedecouple.errors import UserError

from .invocation import Request, Shell, federation, forget_if_forced, identity, workspace
from .options import THREAT_MODEL, deprecated, iterations_for
from .results import (AttackResult, AuditResult, CompareResult, DefendResult, MiaResult, ReportResult,
                      TrainResult)


def _csv(path: Path):
    import pandas as pd

    return pd.read_csv(path) if path.is_file() else None


def _finish(request: Request, out: Path | None, command: str, resolved: dict, folder=None) -> None:
    """Write the run's config.toml (``command``: its name, e.g. ``flower attack``), then (last: the results
    are complete) its folder's record."""
    if out is None:
        return
    from .config_file import write_config

    order = request.order  # the file lists the settings in the help's order
    write_config(out, command, {k: resolved[k] for k in sorted(resolved, key=lambda k: (k not in order,
                                                                                       k in order and order.index(k)))})
    if folder is not None:
        folder.done()


# ------------------------------------------------------------------------------------------------
# train


def train_body(request: Request, shell: Shell) -> TrainResult:
    from . import console  # here, not at the top: keeps the console's import cost with the run, not the help
    from .resumable import TrainRun, differences, refuse
    from .runner import load_run_config, prepare, train as run_train

    p = request.params
    if p["resume"] is not None:
        config, out, resolved = load_run_config(p["resume"]), Path(p["resume"]), None
        status = "partial"
    else:
        config, resolved = federation(request, p)
        out = shell.out(p["out"], lambda: f"runs/train-{config.method}")
        status = "new"
        if out is not None:
            run = TrainRun(out, config)
            status = "new" if p["force"] else run.status()  # --force: trained again, files replaced
            if status == "other":
                record = run.record()
                refuse(out, differences(run.stored_identity(record) if record else None, config.result_key()))
    if status == "done":
        summary = _read_summary(out)
        return TrainResult(summary, _csv(out / "metrics.csv"), out, [_train_line(config, summary, out) +
                                                                     " (finished earlier: read back)",
                                                                     *console.train_protocol_lines(summary, out)])
    prep = prepare(config)  # fail on bad input before writing anything
    if p["show_partition"]:
        click.echo(prep.partition.summary(prep.dataset.labels.numpy()))
    metrics: list = []
    summary = run_train(config, out, resume=status == "partial", on_round=_round_bar(config, shell),
                        metrics=metrics)
    import pandas as pd

    rows = pd.DataFrame(metrics, columns=["round", "client", "accuracy", "loss"])
    if resolved is not None:
        _finish(request, out, "train", resolved)
    return TrainResult(summary, rows, out, [_train_line(config, summary, out),
                                            *console.train_protocol_lines(summary, out)])


def _read_summary(out: Path) -> dict:
    from . import io

    return io.read_json(out / "summary.json")


def _round_bar(config, shell: Shell):
    from tqdm import tqdm

    bar = tqdm(total=config.federation.rounds, desc=f"{config.method} rounds", unit="round", file=sys.stderr,
               disable=not shell.progress)

    def on_round(r, summary):
        bar.n = r + 1
        bar.set_postfix(acc=f"{summary['mean_accuracy']:.3f}")
        bar.refresh()
        if bar.n >= bar.total:
            bar.close()

    return on_round


def _train_line(config, summary: dict, out) -> str:
    return (f"{config.method} on {config.data.dataset} ({config.data.partition}, {config.data.clients} clients, "
            f"{summary['rounds']} rounds): mean accuracy {summary['mean_accuracy']:.4f} "
            f"± {summary['std_accuracy']:.4f}" + (f"  → {out}" if out else ""))


# ------------------------------------------------------------------------------------------------
# attack


def attack_settings(request: Request, p: dict):
    """(RunConfig, AttackSettings, resolved flags) of ``fedsec attack``: the audit preset's plan under
    the given flags."""
    import attacks

    from . import presets
    from .jobs.attack import AttackSettings, parse_rounds

    attack = p["attack"]
    attack_rounds = p["attack_rounds"] or str(attacks.get(attack).first_round)
    plan = {"attack_rounds": attack_rounds, "targets": p["targets"], "iterations": iterations_for(p["iterations"], attack),
            "restarts": p["restarts"], "victim_batch": p["victim_batch"]}
    if p["preset"] == "audit":
        plan = presets.attack_plan(attack, plan, request.explicit, train_images=p["train_images"])
    config, resolved = federation(request, p)
    settings = AttackSettings(attack=attack, rounds=tuple(parse_rounds(plan["attack_rounds"])), targets=plan["targets"],
                              iterations=plan["iterations"], restarts=plan["restarts"], images=p["images"],
                              victim_batch=plan["victim_batch"], victim_steps=p["victim_steps"], seed=p["attack_seed"],
                              train_rounds=p["rounds"], craft=p["craft"], download_check=p["download_check"],
                              consistency_check=p["consistency_check"],
                              **{k: p[k] for k in THREAT_MODEL})
    done = settings.resolved(config.federation.seed, config.execution.threads)  # every check, before anything runs
    resolved.update(rounds=p["rounds"], attack_rounds=",".join(map(str, done.rounds)), targets=done.targets,
                    iterations=done.iterations, restarts=done.restarts, victim_batch=done.victim_batch,
                    attack_seed=done.seed, craft=done.craft, threads=done.threads,
                    consistency_check=p["consistency_check"] or None)  # off: folders written before it match
    return config, settings, resolved


def attack_body(request: Request, shell: Shell) -> AttackResult:
    from . import console
    from .jobs.attack import default_out, run_attack
    from .resumable import RunFolder
    from .runner import shared_datasets

    p = request.params
    config, settings, resolved = attack_settings(request, p)
    out = shell.out(p["out"], lambda: default_out(settings.attack, config.method))
    folder = None if out is None else RunFolder(out, identity(resolved), required=("attack.csv", "summary.json"))
    if folder is not None and folder.claim(p["force"]) == "done":
        summary = _read_summary(out)
        return AttackResult(summary, _csv(out / "attack.csv"), out,
                            [*console.attack_lines(summary, out), "  (finished earlier with this configuration: "
                                                                  "read back; --force recomputes it)"])
    outcomes: list = []
    with shared_datasets():  # the estimate and the attack read the data set once
        shell.echo(f"estimated time: {attack_estimate(config, settings)} (fedsec.estimate)")
        summary = run_attack(config, settings, out=out, progress=shell.progress, outcomes=outcomes)
    _finish(request, out, "attack", resolved, folder)
    return attack_result(summary, outcomes, out)


def attack_estimate(config, settings) -> str:
    """``fedsec.estimate``'s guess for one attack run (training included); bad input raises here."""
    from . import estimate
    from .jobs.attack import check_applicable
    from .runner import prepare

    resolved = settings.resolved(config.federation.seed, config.execution.threads)
    prep = prepare(config)
    check_applicable(resolved.spec, prep)  # what does not apply fails before any estimate
    work = estimate.attack_work(config.method, config.data.clients, estimate.training_images(prep), resolved,
                                resolved.rounds_to_train)
    return estimate.describe(estimate.seconds(work), config.federation.device)


def attack_result(summary: dict, outcomes: list, out: Path | None, prefix: str = "") -> AttackResult:
    import pandas as pd
    import torch

    from . import console

    outcome = outcomes[-1]
    panels = outcome.panels
    truth = torch.stack([t[0].detach().cpu() for t in panels]) if panels else None
    rebuilt = torch.stack([t[1].detach().cpu() for t in panels]) if panels else None
    return AttackResult(summary, pd.DataFrame(outcome.rows, columns=outcome.columns), out,
                        console.attack_lines(summary, out, prefix=prefix), rebuilt, truth)


# ------------------------------------------------------------------------------------------------
# audit


def audit_body(request: Request, shell: Shell) -> AuditResult:
    from . import console
    from .jobs.audit import run_audit
    from .resumable import RunFolder

    p = request.params
    config, resolved = federation(request, p)
    out = shell.out(p["out"], lambda: f"runs/audit-{config.method}")
    folder = None if out is None else RunFolder(out, identity(resolved), required=("audit.csv", "summary.json",
                                                                                    "findings.json"))
    if folder is not None and folder.claim(p["force"]) == "done":
        from . import io

        result = {"summary": _read_summary(out), "findings": io.read_json(out / "findings.json")}
        return AuditResult(result["summary"], _csv(out / "audit.csv"), out,
                           console.audit_lines(config.method, result, out) + ["  (finished earlier with this "
                                                                              "configuration: read back)"],
                           result["findings"])
    from .runner import prepare

    prepare(config)  # bad input fails before anything is written
    result = run_audit(config, out, evidence=p["evidence"], evidence_iterations=p["evidence_iterations"],
                       progress=shell.progress)
    _finish(request, out, "audit", resolved, folder)
    return AuditResult(result["summary"], result.get("rows"), out, console.audit_lines(config.method, result, out),
                       result["findings"])


# ------------------------------------------------------------------------------------------------
# compare, report, defend, mia: commands of many stages, each with its own resumable stages


def compare_body(request: Request, shell: Shell) -> CompareResult:
    from .jobs.compare import compare as run_compare, parse_methods, parse_seeds

    p = dict(request.params)
    for flag in ("method", "seed"):
        if request.explicit(flag):
            raise UserError(f"compare takes --{flag}s, not --{flag}")
    method_list, seed_list = parse_methods(p["methods"]), parse_seeds(p["seeds"])
    p["method"] = None  # set per run; also keeps --preset's FedeCouple values (= its defaults) from other methods
    base, resolved = federation(request, p)
    out = shell.out(p["out"], lambda: "runs/compare")
    forget_if_forced(out, p["force"])
    with workspace(out) as folder:
        frame = run_compare(base, method_list, seed_list, folder, progress=shell.progress)
        markdown = (folder / "accuracy.md").read_text(encoding="utf-8").rstrip()
        _finish(request, out, "compare", {**resolved, "method": None, "seed": None})
    where = [f"{len(frame)} runs → {out}/accuracy.csv, {out}/accuracy.md"] if out else [f"{len(frame)} runs"]
    return CompareResult({"runs": len(frame)}, frame, out, [markdown, *where])


def report_body(request: Request, shell: Shell) -> ReportResult:
    from . import console
    from .jobs import report as rep

    p = dict(request.params)
    if request.explicit("method"):
        raise UserError("report takes --methods, not --method")
    from . import presets

    method_list = rep.parse_methods(presets.report_methods(p["preset"], p["methods"], request.explicit))
    attack_list, settings = report_settings(request, p)
    p["method"] = None  # set per method; keeps --preset's FedeCouple values from other methods
    base, resolved = federation(request, p)
    mia_settings = None
    if p["mia"]:
        from .jobs.mia import MiaSettings

        mia_settings = MiaSettings()
    jobs = p["jobs"] or (2 if p["preset"] == "audit" else 1)
    out = shell.out(p["out"], lambda: "runs/report")
    forget_if_forced(out, p["force"])
    with workspace(out) as folder:
        result = rep.build_report(base, method_list, folder, attacks=attack_list, settings=settings, reuse=p["reuse"],
                                  command=console.command_line("report") if shell.cli else None, mia=mia_settings,
                                  jobs=jobs, progress=shell.progress)
        rows, table = _csv(folder / "results.csv"), _csv(folder / "summary.csv")
        _finish(request, out, "report", {**resolved, "method": None})
    lines = [rep.headline_markdown(result["summary"], result["cells"], method_list)]
    if out is not None:
        lines.append(f"→ {out / 'report.html'}, {out / 'report.md'}, {out / 'summary.csv'}, {out / 'results.csv'}"
                     + (f", {out / 'malicious.csv'} (the \"Malicious server\" section)"
                        if len(result["malicious"]) else ""))
    return ReportResult({"methods": method_list, "cells": result["cells"]}, rows, out, lines, table, result["failed"])


def report_settings(request: Request, p: dict):
    """(attacks, ``ReportSettings``): the flags (and ``--preset audit``'s plan under them), with the
    restarts, the victim batch and the forward model applied to every attack."""
    from dataclasses import replace

    from . import presets

    iterations = p["iterations"]
    attack_list, settings = presets.report_plan(p["preset"], p["attacks"], p["attack_rounds"] or "0", p["targets"],
                                                None if iterations is None else str(iterations),
                                                request.explicit, p["malicious_sizes"],
                                                p["real_sizes"])
    if p["restarts"] is not None:
        settings = replace(settings, restarts=p["restarts"])
    if p["victim_batch"] is not None:  # B >= 1: the gradient attacks' textbook batch; 0: their real training
        settings = (replace(settings, textbook_batch=p["victim_batch"]) if p["victim_batch"] > 0 else
                    replace(settings, victim_settings=settings.victim_settings or ("real",)))
    return attack_list, replace(settings, mode=p["mode"])


def defend_body(request: Request, shell: Shell) -> DefendResult:
    from reports.tradeoff import value_line

    from . import console
    from .jobs.defend import DefendSettings, defend as run_defend

    p = request.params
    config, resolved = federation(request, p)
    settings = DefendSettings(defense=p["defense"], values=p["values"], attacks=p["attacks"], baseline=p["baseline"],
                              max_grad_norm=p["max_grad_norm"], delta=p["delta"], accountant=p["accountant"],
                              targets=p["targets"], iterations=p["iterations"], victim_batch=p["victim_batch"] or 1,
                              victim_steps=p["victim_steps"], attack_seed=p["attack_seed"],
                              stat_noise_multiplier=p["stat_noise_multiplier"], stat_clip=p["stat_clip"],
                              counts=p["counts"], attack_rounds=p["attack_rounds"])
    out = shell.out(p["out"], lambda: f"runs/defend-{p['defense']}-{config.method}")
    forget_if_forced(out, p["force"])
    lines: list[str] = []
    with workspace(out) as folder:
        frame = run_defend(config, settings, folder, progress=shell.progress,
                           on_value=lambda row: (shell.echo if not shell.cli else click.echo)("  " + value_line(row)),
                           command=console.command_line("defend") if shell.cli else None)
        _finish(request, out, "defend", resolved)
    if out is not None:
        lines.append(f"{len(frame)} values → {out}/tradeoff.csv, {out}/tradeoff.md, {out}/tradeoff.png")
    return DefendResult({"values": len(frame)}, frame, out, lines)


def mia_body(request: Request, shell: Shell) -> MiaResult:
    from . import console
    from .jobs.mia import MiaSettings, parse_attacks, parse_offline_a, run_mia

    p = request.params
    settings = MiaSettings(attacks=parse_attacks(p["attacks"]), reference_runs=p["reference_runs"], gamma=p["gamma"],
                           temperature=p["temperature"], offline_a=parse_offline_a(p["offline_a"]), dp_noise=p["dp"],
                           max_grad_norm=p["max_grad_norm"], stat_noise_multiplier=p["stat_noise_multiplier"],
                           stat_clip=p["stat_clip"], counts=p["counts"], delta=p["delta"], bootstrap=p["bootstrap"],
                           exposed=p["exposed"])
    if p["offline_a"].strip().lower() == "tune" and p["reference_runs"] < 4 and request.explicit("offline_a"):
        raise UserError("--offline-a tune needs --reference-runs >= 4 (a reference pair plus another pair); "
                        "give a number instead, e.g. --offline-a 0.3")
    config, resolved = federation(request, p)
    out = shell.out(p["out"], lambda: f"runs/mia-{config.method}")
    forget_if_forced(out, p["force"])
    with workspace(out) as folder:
        summary = run_mia(config, settings, folder, progress=shell.progress,
                          echo=shell.echo if not shell.cli else click.echo,
                          command=console.command_line("mia") if shell.cli else None)
        rows = _csv(folder / "mia.csv")
        _finish(request, out, "mia", resolved)
    return MiaResult(summary, rows, out, console.mia_lines(config.method, summary, out) if out else [])


# ------------------------------------------------------------------------------------------------
# flower attack, flower audit


def flower_attack_body(request: Request, shell: Shell) -> AttackResult:
    from .flower import require_flwr
    from .resumable import RunFolder

    p = dict(request.params)
    attack, app_dir = _flower_positionals(p)
    require_flwr()
    from .flower.app import parse_run_config
    from .flower.harness import attack_app, default_out
    from .jobs.attack import AttackSettings, parse_rounds

    import attacks

    rounds = p["attack_rounds"] or str(attacks.get(attack).first_round)
    settings = AttackSettings(attack=attack, rounds=tuple(parse_rounds(rounds)), targets=p["targets"],
                              iterations=iterations_for(p["iterations"], attack), restarts=p["restarts"],
                              images=p["images"], victim_batch=p["victim_batch"], victim_steps=p["victim_steps"],
                              seed=p["seed"] if p["attack_seed"] is None else p["attack_seed"], train_rounds=p["rounds"],
                              threads=p["threads"], **{k: p[k] for k in THREAT_MODEL})
    done = settings.resolved(seed=0)
    resolved = {**p, "attack": attack, "app_dir": str(app_dir), "attack_option": None, "attack_rounds": rounds,
                "iterations": done.iterations, "restarts": done.restarts, "victim_batch": done.victim_batch,
                "attack_seed": done.seed}
    out = shell.out(p["out"], lambda: default_out("attack", app_dir, attack))
    folder = None if out is None else RunFolder(out, identity({**resolved, "app_dir": Path(app_dir).resolve().name}),
                                                required=("attack.csv", "summary.json"))
    if folder is not None and folder.claim(p["force"]) == "done":
        from . import console

        summary = _read_summary(out)
        return AttackResult(summary, _csv(out / "attack.csv"), out,
                            console.attack_lines(summary, out, prefix=f"{summary['run']}: ") + ["  (finished earlier "
                                                                                                "with this configuration: read back)"])
    outcomes: list = []
    summary = attack_app(app_dir, settings, nodes=p["nodes"], run_config=parse_run_config(p["run_config"]),
                         out=out, ray_cpus=p["ray_cpus"], quiet=not p["flower_log"], device=p["device"],
                         progress=shell.progress, outcomes=outcomes)
    _finish(request, out, "flower attack", resolved, folder)
    return attack_result(summary, outcomes, out, prefix=f"{summary['run']}: ")


def _flower_positionals(p: dict) -> tuple[str, str]:
    """(attack, app folder); the older ``APP_DIR --attack ATTACK`` still works, with a warning."""
    from .options import ATTACK

    attack, app_dir = p["attack"], p["app_dir"]
    if p["attack_option"] is not None:
        deprecated("--attack", "the attack as the first argument: fedsec flower attack ATTACK APP_DIR")
        if app_dir is None:
            attack, app_dir = p["attack_option"], attack
        elif attack != p["attack_option"]:
            raise UserError(f"two attacks given ({attack} and --attack {p['attack_option']}); give one: "
                            f"fedsec flower attack ATTACK APP_DIR")
    if attack is None or app_dir is None:
        raise UserError("fedsec flower attack needs ATTACK and APP_DIR, e.g. fedsec flower attack ig "
                        "examples/flower_mnist")
    return ATTACK.convert(attack, None, None), app_dir


def flower_audit_body(request: Request, shell: Shell) -> AuditResult:
    from .flower import require_flwr
    from .resumable import RunFolder

    p = request.params
    require_flwr()
    from . import console
    from .flower.app import parse_run_config
    from .flower.harness import audit_app, default_out

    out = shell.out(p["out"], lambda: default_out("audit", p["app_dir"]))
    resolved = dict(p)
    folder = None if out is None else RunFolder(out, identity({**p, "app_dir": Path(p["app_dir"]).resolve().name}),
                                                required=("audit.csv", "summary.json", "findings.json"))
    if folder is not None and folder.claim(p["force"]) == "done":
        from . import io

        result = {"summary": _read_summary(out), "findings": io.read_json(out / "findings.json")}
    else:
        result = audit_app(p["app_dir"], nodes=p["nodes"], run_config=parse_run_config(p["run_config"]),
                           rounds=p["rounds"], evidence=p["evidence"], evidence_iterations=p["evidence_iterations"],
                           out=out, ray_cpus=p["ray_cpus"], threads=p["threads"], quiet=not p["flower_log"],
                           device=p["device"], progress=shell.progress)
        _finish(request, out, "flower audit", resolved, folder)
    name = f"{result['summary']['run']} ({result['summary']['method']})"
    return AuditResult(result["summary"], result.get("rows", _csv(out / "audit.csv") if out else None), out,
                       console.audit_lines(name, result, out), result["findings"])


BODIES = {"train": train_body, "compare": compare_body, "attack": attack_body, "audit": audit_body,
          "report": report_body, "defend": defend_body, "mia": mia_body, "flower attack": flower_attack_body,
          "flower audit": flower_audit_body}


def run_command(ctx: click.Context) -> None:
    """The command line's entry into a command's body: its parsed flags as a ``Request``; run it, print what
    it says."""
    request = Request.of_click(ctx)
    result = BODIES[request.command](request, Shell(cli=True, progress=True))
    for line in result.lines:
        click.echo(line)
    if isinstance(result, ReportResult) and result.failed:
        click.echo(f"{len(result.failed)} stage(s) failed (marked in the report); rerun the same command to retry "
                   "them", err=True)
        sys.exit(1)
