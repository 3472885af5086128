"""``fedsec flower attack|audit APP_DIR``: the CLI group over ``fedsec.flower.harness`` (flags only).

Importing this module does not import Flower; each command checks for it first (one-line error naming
the extra), so ``fedsec --help`` works without Flower installed.
"""
from __future__ import annotations

import click

import attacks
from fedecouple.errors import UserError

from ..options import COUNT, SEED, LiveChoice, Number, device_option, restarts_option, threat_model_options


def app_options(func):
    """Flags shared by the commands that run a Flower app."""
    options = [
        click.argument("app_dir", type=click.Path(file_okay=False)),
        click.option("--nodes", type=COUNT, default=None,
                     help="Simulated nodes [the app's default federation: options.num-supernodes]."),
        click.option("--run-config", "run_config", multiple=True, metavar="'KEY=VALUE ...'",
                     help="Overrides of the app's [tool.flwr.app.config], as for `flwr run --run-config` "
                          "(TOML values: strings in quotes), e.g. \"strategy='fedper' num-server-rounds=2\" (repeatable)."),
        click.option("--ray-cpus", type=click.IntRange(min=1), default=None,
                     help="CPUs Ray may use; each ClientApp reserves one [this machine's cores]."),
        click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
                     help="torch threads in each ClientApp and in the attacks (1: bit-identical reruns)."),
        click.option("--flower-log/--no-flower-log", default=False, show_default=True,
                     help="Show Flower's and Ray's own log (errors only otherwise)."),
        device_option,  # where fedsec's gradient attacks compute; the app's own training is the app's
    ]
    for option in reversed(options):
        func = option(func)
    return func


@click.group()
def flower():
    """Audit a Flower app: run it in Flower's simulation engine with fedsec's recorder and ground-truth
    hook wrapped in, then attack or audit what its server received.

    The app describes itself to fedsec in its pyproject.toml ([tool.fedsec]: model, data set, protocol,
    local SGD settings; see the README, "Audit your Flower app"). Needs pip install 'fedsec[flower]'.
    """


@flower.command()
@app_options
@click.option("--attack", "attack_name", type=LiveChoice(attacks.names), required=True,
              help="Attack on the recorded uploads (it must apply to what the app uploads: dlg, idlg, ig, labels "
                   "for a model-sharing app).")
@click.option("--attack-rounds", default="0", show_default=True,
              help="Comma-separated rounds whose uploads are attacked (0 = Flower's round 1, at the initial weights). "
                   "The app stops after the last one unless --rounds is given.")
@click.option("--rounds", type=COUNT, default=None,
              help="Flower rounds to run (set through the app's declared rounds-key).")
@click.option("--targets", type=COUNT, default=2, show_default=True, help="Clients attacked per attacked round (seeded choice).")
@click.option("--iterations", type=COUNT, default=None, help="Optimiser steps per reconstruction [the attack's default].")
@restarts_option
@click.option("--victim-batch", type=Number(int, 0), default=None,
              help="B: in the attacked rounds every node trains on B of its images, through the app's declared "
                   "victim-keys [1 for the gradient attacks; 0 (= the app's real local training) for labels].")
@click.option("--victim-steps", type=COUNT, default=1, show_default=True, help="T: local steps in the victim setting.")
@click.option("--images", type=COUNT, default=None, help="Images rebuilt per target [--victim-batch, or 1].")
@click.option("--attack-seed", type=SEED, default=0, show_default=True, help="Seed for target choice and attack starts.")
@threat_model_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder: attack.csv, summary.json, reconstructions.png [runs/flower-attack-<attack>-<app>].")
def attack(app_dir, nodes, run_config, ray_cpus, threads, flower_log, device, attack_name, attack_rounds, rounds, targets,
           iterations, restarts, victim_batch, victim_steps, images, attack_seed, out, **threat):
    """Run APP_DIR in Flower's simulation engine and attack what its server received.

    Example: fedsec flower attack examples/flower_mnist --attack ig   (round 0, 2 nodes, one image, one step)
    """
    from . import require_flwr

    require_flwr()
    from ..attack import AttackSettings, parse_rounds
    from ..console import attack_lines
    from .app import parse_run_config
    from .harness import attack_app, default_out

    settings = AttackSettings(attack=attack_name, rounds=tuple(parse_rounds(attack_rounds)), targets=targets,
                              iterations=iterations, restarts=restarts, images=images, victim_batch=victim_batch,
                              victim_steps=victim_steps, seed=attack_seed, train_rounds=rounds, threads=threads,
                              **threat)
    out = out or default_out("attack", app_dir, attack_name)
    summary = attack_app(app_dir, settings, nodes=nodes, run_config=parse_run_config(run_config), out=out,
                         ray_cpus=ray_cpus, quiet=not flower_log, device=device)
    for line in attack_lines(summary, out, prefix=f"{summary['run']}: "):
        click.echo(line)


@flower.command()
@app_options
@click.option("--rounds", type=COUNT, default=None, help="Flower rounds to run (through the declared rounds-key) [the app's].")
@click.option("--evidence/--no-evidence", default=True, show_default=True,
              help="Measure the findings' evidence with the matching attacks, as `fedsec audit` does: each in "
                   "its own simulation (the gradient attack in the textbook setting, through the app's victim-keys).")
@click.option("--evidence-iterations", type=COUNT, default=300, show_default=True,
              help="Optimisation steps for each evidence attack.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder: audit.csv, findings.json, summary.json, audit.md [runs/flower-audit-<app>].")
def audit(app_dir, nodes, run_config, ray_cpus, threads, flower_log, device, rounds, evidence, evidence_iterations,
          out):
    """Run APP_DIR in Flower's simulation engine and audit every upload its server received.

    Example: fedsec flower audit examples/flower_mnist
    """
    from . import require_flwr

    require_flwr()
    from .app import parse_run_config
    from .harness import audit_app, default_out

    if evidence_iterations < 1:
        raise UserError(f"--evidence-iterations must be at least 1, got {evidence_iterations}")
    out = out or default_out("audit", app_dir)
    result = audit_app(app_dir, nodes=nodes, run_config=parse_run_config(run_config), rounds=rounds,
                       evidence=evidence, evidence_iterations=evidence_iterations, out=out, ray_cpus=ray_cpus,
                       threads=threads, quiet=not flower_log, device=device)
    from ..console import audit_lines

    for line in audit_lines(f"{result['summary']['run']} ({result['summary']['method']})", result, out):
        click.echo(line)
