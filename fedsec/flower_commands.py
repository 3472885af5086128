"""``fedsec flower attack|audit APP_DIR``: the command group over ``fedsec.flower.harness``, a branch of
``fedsec.commands``' tree (flags only; the bodies are ``fedsec.bodies``', shared with the native commands: the
output folder's check, config.toml).

Importing this module does not import Flower (nor torch); each command checks for Flower first (one-line
error naming the extra), so ``fedsec --help`` works without Flower installed.
"""
from __future__ import annotations

import click

from .bodies import run_command
from .invocation import Request
from .flower import SECAGG_DEFENSES
from .options import (ATTACK_ROUNDS, ATTACK_SEED, COUNT, EVIDENCE, EVIDENCE_ITERATIONS, IMAGES, ITERATIONS, RESTARTS,
                      SEED, TARGETS, VICTIM_BATCH, VICTIM_STEPS, AttackListCommand, device_option, run_options,
                      threat_model_options)


def app_options(func):
    """Flags shared by the commands that run a Flower app."""
    options = [
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


@click.group(short_help="Audit a Flower app: run it with fedsec's recorder, then attack or audit it.")
def flower():
    """Audit a Flower app: run it in Flower's simulation engine with fedsec's recorder and ground-truth
    hook wrapped in, then attack or audit what its server received.

    The app describes itself to fedsec in its pyproject.toml ([tool.fedsec]: model, data set, protocol,
    local SGD settings; the documentation's "Auditing a Flower app" page). Needs Flower (from a checkout: pip install -e '.[flower]').
    """


class FlowerAttackCommand(AttackListCommand):
    """``flower attack``'s help: every registered attack with its one-line summary, then the attacks of a
    SecAgg+ server that deviates from the protocol."""

    def format_help_text(self, ctx, formatter):
        from .flower import SECAGG_SERVER_ATTACKS

        super().format_help_text(ctx, formatter)
        with formatter.section("SecAgg+ server attacks (an app under secaggplus_mod, in simulation)"):
            formatter.write_dl(list(SECAGG_SERVER_ATTACKS.items()))


SERVER_OPTIONS = ("client_defense", "image_attack", "sybils")  # taken only by the SecAgg+ server attacks


def _refuse_server_options(ctx: click.Context) -> None:
    """A one-line error when an option of the SecAgg+ server attacks is given to another attack."""
    from click.core import ParameterSource

    from fedecouple.errors import UserError

    defaults = {p.name: p.default for p in ctx.command.params}
    given = [n for n in SERVER_OPTIONS if ctx.params.get(n) != defaults[n] and ctx.get_parameter_source(n) in
             (ParameterSource.COMMANDLINE, ParameterSource.DEFAULT_MAP)]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise UserError(f"{flags}: only the SecAgg+ server attacks take {'it' if len(given) == 1 else 'them'} "
                        f"(unmask-dropout, split-view, sybil, key-substitution)")


@flower.command(cls=FlowerAttackCommand, short_help="Run a Flower app and attack what its server received.")
@click.argument("attack", required=False, metavar="ATTACK")
@click.argument("app_dir", required=False, type=click.Path(file_okay=False), metavar="APP_DIR")
@click.option("--attack", "attack_option", default=None, hidden=True,
              help="Deprecated: the attack is the first argument, as for fedsec attack.")
@app_options
@ATTACK_ROUNDS
@click.option("--rounds", type=COUNT, default=None,
              help="Flower rounds to run (set through the app's declared rounds-key) [the last attacked round + 1].")
@TARGETS
@ITERATIONS
@RESTARTS
@VICTIM_BATCH
@VICTIM_STEPS
@IMAGES
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Seed for what fedsec draws (the targets; the attack starts unless --attack-seed is given); the "
                   "app's own training seed is its run-config's.")
@ATTACK_SEED
@threat_model_options
@click.option("--client-defense", type=click.Choice(SECAGG_DEFENSES), default="none", show_default=True,
              help="SecAgg+ server attacks: the client mod every node runs before secaggplus_mod: unmask-check "
                   "(refuses inconsistent unmask lists), signed-consistency (keys and survivor list signed, "
                   "as in Practical Secure Aggregation for Privacy-Preserving Machine Learning); the app's own "
                   "mods run as well.")
@click.option("--image-attack", default="ig", show_default=True, metavar="ATTACK|none",
              help="SecAgg+ server attacks: the image attack run on each unmasked update and, paired, on the node's "
                   "true update; none skips it.")
@click.option("--sybils", type=click.IntRange(min=1), default=2, show_default=True,
              help="sybil: the server's own nodes among the federation (the last partitions); round r places r of "
                   "them next to the target, rounds 0 to N.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [runs/flower-attack-<attack>-<app>]: attack.csv, summary.json, reconstructions.png, "
                   "config.toml (SecAgg+ server attacks: recovery.csv, summary.json, unmasked-update/, plain-update/).")
@run_options
@click.pass_context
def attack(ctx, **_):
    """Run APP_DIR in Flower's simulation engine and attack what its server received.

    Example: fedsec flower attack ig examples/flower_mnist   (round 0, one image, one step)

    On an app under Flower's SecAgg+, the SecAgg+ server attacks run the app's ServerApp with a server that
    deviates from the protocol in place of its SecAggPlusWorkflow (simulation only: to audit one's own
    deployment), compare each update it unmasks with the node's true one, and run an image attack on it.
    Example: fedsec flower attack unmask-dropout examples/flower_secagg
    """
    from .flower import SECAGG_SERVER_ATTACKS, require_flwr

    if ctx.params.get("attack") in SECAGG_SERVER_ATTACKS:
        require_flwr()
        from .flower.harness import server_attack_command

        server_attack_command(Request.of_click(ctx))
        return
    _refuse_server_options(ctx)
    for name in SERVER_OPTIONS:  # not settings of the other attacks: kept out of their config.toml and folder record
        ctx.params.pop(name, None)
    require_flwr()
    from .flower.secagg import check_attack_command

    check_attack_command(Request.of_click(ctx))  # an app under SecAgg+: its server holds only sums (fedsec flower audit)
    run_command(ctx)


@flower.command(short_help="Run a Flower app and audit every upload its server received.")
@click.argument("app_dir", type=click.Path(file_okay=False))
@app_options
@click.option("--rounds", type=COUNT, default=None,
              help="Flower rounds to run (set through the app's declared rounds-key) [the app's].")
@EVIDENCE
@EVIDENCE_ITERATIONS
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [runs/flower-audit-<app>]: audit.csv, findings.json, summary.json, audit.md, "
                   "evidence/, config.toml.")
@run_options
@click.pass_context
def audit(ctx, **_):
    """Run APP_DIR in Flower's simulation engine and audit every upload its server received.

    Example: fedsec flower audit examples/flower_mnist

    An app under Flower's secure aggregation (its ClientApp behind secaggplus_mod, its server running
    SecAggPlusWorkflow) is audited for what that server holds: each round's sum, and the fields SecAgg+
    leaves in the clear; and for what a server that deviates from the protocol can do against the app's
    client mods under the installed Flower (demonstrated in this process). Example: fedsec flower audit
    examples/flower_secagg
    """
    from .flower import require_flwr

    require_flwr()
    from .flower.harness import secure_audit_command

    if not secure_audit_command(Request.of_click(ctx)):
        run_command(ctx)
