"""The ``fedsec`` command line: a thin shell over library functions in ``fedsec`` and ``attacks``.
Flags become settings here; presets merge in ``fedsec.presets``; what a command prints is written by
``fedsec.console``."""
from __future__ import annotations

import sys
from pathlib import Path

import click

import attacks
from fedecouple.data import DATASETS, SCHEMES
from fedecouple.errors import UserError
from fedecouple.methods import METHODS
from fedecouple.models import ARCHITECTURES
from reports.tradeoff import VALUE_MEANING

from . import console, presets
from .flower.cli import flower  # the group imports Flower only when a command runs
from .options import (COUNT, NON_NEGATIVE, POSITIVE, SEED, LiveChoice, Number, device_option, pop_threat_model,
                      restarts_option, threat_model_options)
from .runner import RunConfig

HYPERPARAMETER_FLAGS = ("lam", "mu", "tau", "teacher", "center_reduction")
ABLATION_FLAGS = ("no_glf", "no_gfa", "no_gpc", "no_da")




class ListedOption(click.Option):
    """An option whose help ends with a list read when the help is shown (e.g. the registered attacks)."""

    def __init__(self, *args, listed=None, **kwargs):
        self._listed = listed
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx):
        record = super().get_help_record(ctx)
        if record is None or self._listed is None:
            return record
        return record[0], f"{record[1]} Choices: {', '.join(self._listed())}."


def attack_defaults() -> str:
    return ", ".join(f"{name} {spec.default_iterations}" for name, spec in attacks.ATTACKS.items())


def train_options(func):
    """The flags shared by every command that trains a federation."""
    options = [
        click.option("--method", default="fedecouple", show_default=True,
                     help=f"Federated method: {', '.join(METHODS)}."),
        click.option("--dataset", default="mnist5k", show_default=True,
                     help=f"Data set: {', '.join(DATASETS)}. mnist5k and digits are embedded; the others are read from --data-dir."),
        click.option("--data-dir", type=click.Path(file_okay=False), default=None,
                     help="Folder holding a local copy of an on-disk data set (torchvision layout; CINIC-10: train/ valid/ test/)."),
        click.option("--download/--no-download", default=False, show_default=True,
                     help="Let torchvision download the data set into --data-dir (needs network; never the default)."),
        click.option("--partition", type=click.Choice(SCHEMES), default="pathological", show_default=True,
                     help="Label skew: iid, pathological (K classes per client), weak (paper's s %), dirichlet (beta)."),
        click.option("--classes-per-client", type=COUNT, default=3, show_default=True,
                     help="K for pathological; number of dominant classes for weak."),
        click.option("--s", "s", type=Number(float, 0, 100), default=20.0, show_default=True,
                     help="weak: percent of each client's data drawn uniformly over all classes (0-100)."),
        click.option("--samples-per-client", type=COUNT, default=None,
                     help="weak: samples per client, train+test [default: min(600, 80% of an equal share)]; elsewhere a cap on training images."),
        click.option("--train-images", type=COUNT, default=None,
                     help="Every client trains on exactly this many images (a seeded sample of its training split; "
                          "any partition; a client holding fewer is an error) [all]."),
        click.option("--beta", type=POSITIVE, default=0.1, show_default=True, help="dirichlet: concentration (> 0)."),
        click.option("--clients", type=COUNT, default=10, show_default=True, help="Number of clients N."),
        click.option("--rounds", type=COUNT, default=3, show_default=True, help="Communication rounds."),
        click.option("--local-epochs", type=COUNT, default=1, show_default=True,
                     help="Local epochs (FedeCouple: E_cl = E_fe, its GLF epoch on top; FedRep/FedPAC: base epochs)."),
        click.option("--join-ratio", type=Number(float, 0, 1, low_open=True), default=1.0, show_default=True, help="Fraction rho of clients per round."),
        click.option("--lr", type=POSITIVE, default=0.05, show_default=True, help="SGD learning rate (the paper gives none)."),
        click.option("--batch-size", type=COUNT, default=10, show_default=True, help="Mini-batch size."),
        click.option("--seed", type=SEED, default=0, show_default=True, help="Seed for partition, init and training."),
        click.option("--arch", default=None, help=f"Model: {', '.join(ARCHITECTURES)} [default: by image size]."),
        click.option("--model", default=None, metavar="PACKAGE.MODULE:FACTORY",
                     help="Your own model instead of --arch: a function of no arguments returning a "
                          "fedecouple.models.SplitModel (extractor.*, classifier.* parameters; images in [0, 1]) at "
                          "its initial weights; checked against the data set before training."),
        device_option,
        click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads [default: torch's; fedsec attack: 1]."),
        click.option("--backend", type=click.Choice(["sequential", "ray"]), default="sequential", show_default=True,
                     help="Where client updates run: in this process, or as Ray tasks (pip install 'fedsec[ray]'). "
                          "Same seed and --threads give the same numbers under both."),
        click.option("--ray-address", default=None,
                     help="--backend ray: join this Ray cluster (e.g. ray://head:10001 or auto) "
                          "[default: start Ray locally with this machine's cores]."),
        click.option("--preset", type=click.Choice(["paper", "audit"]), default=None,
                     help="paper: 20 clients, 5 local epochs, 200 rounds, lambda 0.8, mu 2, tau 2. audit: 20 clients, "
                          "20 rounds; report and attack add the audit's attack plan (see their --help). Explicit "
                          "flags win."),
        click.option("--lam", type=NON_NEGATIVE, default=None,
                     help="lambda: FedeCouple KD weight [0.8]; FedPAC/FedProto prototype weight [their papers' 1.0]."),
        click.option("--mu", type=NON_NEGATIVE, default=None, help="FedeCouple centre-loss weight mu [2.0]."),
        click.option("--tau", type=POSITIVE, default=None, help="FedeCouple distillation temperature tau [2.0]."),
        click.option("--teacher", type=click.Choice(["adapted", "fixed"]), default=None,
                     help="FedeCouple teacher classifier: adapted locally (the method) or fixed."),
        click.option("--center-reduction", type=click.Choice(["mean", "sum"]), default=None,
                     help="FedeCouple centre loss: mean over elements [default] or per-sample sum (literal eq. 8)."),
        click.option("--no-glf", is_flag=True, help="Ablation: skip the frozen-global-classifier epoch (GLF)."),
        click.option("--no-gfa", is_flag=True, help="Ablation: drop the anchor centre loss (GFA)."),
        click.option("--no-gpc", is_flag=True, help="Ablation: no knowledge distillation to the personal classifier (GPC)."),
        click.option("--no-da", is_flag=True, help="Ablation: no data augmentation (DA)."),
        click.option("--hp", "extra_hp", multiple=True, metavar="NAME=VALUE",
                     help="Any other method hyperparameter, e.g. --hp finetune_epochs=2 (ft-fedavg, default 1), "
                          "--hp head_epochs=9 (fedrep [local epochs], fedpac [1]) (repeatable)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def statistics_dp_options(func):
    """The DP statistics mechanism's flags, shared by ``defend --defense dp`` and ``mia --dp``."""
    for option in reversed([
        click.option("--stat-noise-multiplier", type=NON_NEGATIVE, default=None,
                     help="dp: noise multiplier of the mechanism for whole-data statistics (anchors, prototypes, h, "
                          "V, class counts) [the DP-SGD noise multiplier]."),
        click.option("--stat-clip", type=POSITIVE, default=None,
                     help="dp: bound on each sample's feature norm in those statistics [--max-grad-norm]."),
        click.option("--counts", type=click.Choice(["noised", "withheld"]), default="noised", show_default=True,
                     help="dp: class counts in the upload: noised, or withheld (the server weights prototypes "
                          "equally)."),
    ]):
        func = option(func)
    return func


def config_from_options(ctx: click.Context, **opts) -> RunConfig:
    """Turn parsed train options into a RunConfig, applying ``--preset`` under explicit flags."""
    hp = {k: opts.pop(k) for k in HYPERPARAMETER_FLAGS if opts.get(k) is not None}
    for flag in ABLATION_FLAGS:
        if opts.pop(flag, False):
            hp[flag[3:]] = False
    for item in opts.pop("extra_hp", ()):
        if "=" not in item:
            raise UserError(f"--hp expects NAME=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        hp[key.strip().replace("-", "_")] = _parse_value(value.strip())
    for k in HYPERPARAMETER_FLAGS:
        opts.pop(k, None)
    presets.merge_federation(opts.pop("preset", None), opts, hp, lambda name: explicit(ctx, name))
    return RunConfig.of(**opts, hyperparameters=hp)


def explicit(ctx: click.Context, name: str) -> bool:
    """Whether the user gave ``--name`` on the command line (presets never override those)."""
    return ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="fedsec")
def cli():
    """fedsec: what does each client of a personalised federated learning method send to the
    server, and what can a curious server rebuild from it?"""


@cli.command()
@train_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Run directory: config.json, metrics.csv, summary.json, partition.csv, checkpoint.pt.")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), default=None,
              help="Continue the interrupted run in this directory (its config.json wins over other flags).")
@click.option("--show-partition", is_flag=True, help="Print class counts per client before training.")
@click.pass_context
def train(ctx, out, resume_dir, show_partition, **opts):
    """Train a federation and report the mean per-client test accuracy.

    Example: fedsec train --method fedecouple --partition pathological --clients 10 --rounds 3 --out runs/fc
    """
    from tqdm import tqdm

    from .runner import load_run_config, prepare, train as run_train

    if resume_dir is not None:
        config, out = load_run_config(resume_dir), resume_dir
    else:
        config = config_from_options(ctx, **opts)
    prep = prepare(config)  # fail on bad input before writing anything
    if show_partition:
        click.echo(prep.partition.summary(prep.dataset.labels.numpy()))
    bar = tqdm(total=config.federation.rounds, desc=f"{config.method} rounds", unit="round", file=sys.stderr)

    def on_round(r, summary):
        bar.n = r + 1
        bar.set_postfix(acc=f"{summary['mean_accuracy']:.3f}")
        bar.refresh()

    summary = run_train(config, out, resume=resume_dir is not None, on_round=on_round)
    bar.close()
    click.echo(f"{config.method} on {config.data.dataset} ({config.data.partition}, {config.data.clients} clients, "
               f"{summary['rounds']} rounds): mean accuracy {summary['mean_accuracy']:.4f} "
               f"± {summary['std_accuracy']:.4f}" + (f"  → {out}" if out else ""))


@cli.command()
@train_options
@click.option("--methods", default=",".join(METHODS), show_default=True,
              help="Comma-separated methods to compare (replaces --method).")
@click.option("--seeds", default="0,1,2", show_default=True,
              help="Comma-separated seeds; each seed fixes partition, initial model and training (replaces --seed).")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Folder for <method>/seed<k>/ run directories, accuracy.csv and accuracy.md; rerun to resume.")
@click.pass_context
def compare(ctx, methods, seeds, out, **opts):
    """Train several methods on the same partitions and seeds; write accuracy.csv and accuracy.md.

    Each method gets only the hyperparameters it takes (e.g. --lam reaches fedecouple, fedpac and
    fedproto). Finished runs are skipped, interrupted ones resumed.

    Example: fedsec compare --methods fedecouple,fedavg,local --seeds 0,1,2 --clients 20 --rounds 5 --out runs/cmp
    """
    from .compare import compare as run_compare, parse_methods, parse_seeds

    for flag in ("method", "seed"):
        if explicit(ctx, flag):
            raise UserError(f"compare takes --{flag}s, not --{flag}")
    method_list, seed_list = parse_methods(methods), parse_seeds(seeds)
    opts["method"] = None  # set per run; also keeps --preset's FedeCouple values (= its defaults) from other methods
    base = config_from_options(ctx, **opts)
    frame = run_compare(base, method_list, seed_list, out)
    click.echo((Path(out) / "accuracy.md").read_text(encoding="utf-8").rstrip())
    click.echo(f"{len(frame)} runs → {out}/accuracy.csv, {out}/accuracy.md")


@cli.command()
@click.argument("attack", type=LiveChoice(attacks.names))
@train_options
@click.option("--attack-rounds", default=None, metavar="R,R,...",
              help="Comma-separated rounds whose uploads are attacked (0 = the first round, at the initial weights). "
                   "Training stops after the last one unless --rounds is given. [0; fish: 1, the first round "
                   "with an earlier upload to read]")
@click.option("--targets", type=COUNT, default=8, show_default=True,
              help="Clients attacked per attacked round (seeded choice); 8 one-image targets give an interval.")
@click.option("--iterations", type=COUNT, default=None,
              help=f"Optimiser steps per reconstruction [each attack's default: {attack_defaults()}; dlg/idlg count "
                   f"L-BFGS steps of up to 20 evaluations, ig Adam steps].")
@restarts_option
@click.option("--victim-batch", type=Number(int, 0), default=None,
              help="B: attacked clients train on B of their images in the attacked round, and B images are rebuilt "
                   "[1 for the gradient attacks; 0 (= the method's real local training) for the others].")
@click.option("--victim-steps", type=COUNT, default=1, show_default=True, help="T: local steps per phase in the victim setting.")
@click.option("--images", type=COUNT, default=None,
              help="Images rebuilt per target [--victim-batch; 1 with --victim-batch 0]; e.g. 2 for a method that "
                   "trains on each image and an augmented copy.")
@click.option("--attack-seed", type=SEED, default=None, help="Seed for target choice and attack starts [--seed].")
@click.option("--craft", default=None,
              help="Malicious-server attacks (trap, binning): the download the server crafts for the attacked clients: "
                   "binning (every row of the first linear layer one direction, biases at public quantiles; exact "
                   "inputs) or plain (trap: Boenisch et al.'s random trap rows) [the attack's first: binning]. "
                   "fish crafts only fishing (the classifier; needs --attack-rounds 1 or later).")
@click.option("--download-check", is_flag=True, default=False,
              help="Every client tests each download before training and refuses one that looks crafted "
                   "(fedsec.defenses.download_check); summary.json's download_check gives detections on the attacked "
                   "downloads and false alarms on all others.")
@threat_model_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder: attack.csv, summary.json, reconstructions.png [runs/attack-<attack>-<method>].")
@click.pass_context
def attack(ctx, attack, attack_rounds, targets, iterations, restarts, victim_batch, victim_steps, images, attack_seed,
           craft, download_check, out, **opts):
    """Train, intercept what the server sees, attack it, and score the result against what the client trained on.

    Example: fedsec attack dlg --method fedecouple   (round 0, 8 clients, one image each, one local step)

    A malicious server: trap/binning craft the first linear layer; fish (classifier fishing) crafts the
    classifier from the client's earlier upload, so it attacks round 1 by default and refuses round 0.

    Training runs up to the last attacked round (max of --attack-rounds, + 1) unless --rounds is given;
    torch runs one thread unless --threads is given.

    --preset audit: 20 clients, attack rounds 0 and 19, the audit's plan for this attack: gradient
    attacks on 2 clients' real local training (every image they trained on; 100 steps, one start;
    with --train-images 10 the report's <attack>@real-n10 cell: 4 clients, 500 steps), or with an explicit
    --victim-batch B the textbook setting (16 clients). Explicit flags win.
    """
    from .attack import AttackSettings, default_out, parse_rounds, run_attack
    from .runner import shared_datasets

    train_rounds = opts["rounds"] if explicit(ctx, "rounds") else None
    if attack_rounds is None:  # the attack's first round: 0, or 1 where it reads an earlier upload
        attack_rounds = str(attacks.get(attack).first_round)
    if opts.get("preset") == "audit":  # the audit's plan for this attack, under explicit flags
        planned = presets.attack_plan(attack, {"attack_rounds": attack_rounds, "targets": targets,
                                               "iterations": iterations, "restarts": restarts,
                                               "victim_batch": victim_batch}, lambda name: explicit(ctx, name),
                                        train_images=opts.get("train_images"))
        attack_rounds, targets, iterations, restarts, victim_batch = (
            planned[k] for k in ("attack_rounds", "targets", "iterations", "restarts", "victim_batch"))
    threat = pop_threat_model(opts)
    config = config_from_options(ctx, **opts)
    settings = AttackSettings(attack=attack, rounds=tuple(parse_rounds(attack_rounds)), targets=targets,
                              iterations=iterations, restarts=restarts, images=images, victim_batch=victim_batch,
                              victim_steps=victim_steps, seed=attack_seed, train_rounds=train_rounds, craft=craft,
                              download_check=download_check, **threat)
    out = out or default_out(attack, config.method)
    with shared_datasets():  # the estimate and the attack read the data set once
        click.echo(f"estimated time: {attack_estimate(config, settings)} (fedsec.estimate)", err=True)
        summary = run_attack(config, settings, out=out)
    for line in console.attack_lines(summary, out):
        click.echo(line)


def attack_estimate(config: RunConfig, settings) -> str:
    """``fedsec.estimate``'s guess for one attack run (training included); bad input raises here."""
    from . import estimate
    from .attack import check_applicable
    from .runner import prepare

    resolved = settings.resolved(config.federation.seed, config.execution.threads)
    prep = prepare(config)
    check_applicable(resolved.spec, prep)  # what does not apply fails before any estimate
    work = estimate.attack_work(config.method, config.data.clients, estimate.training_images(prep), resolved,
                                resolved.rounds_to_train)
    return estimate.describe(estimate.seconds(work))


@cli.command()
@train_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [default: runs/audit-<method>]: audit.csv, summary.json, findings.json, audit.md, evidence/.")
@click.option("--evidence/--no-evidence", default=True, show_default=True,
              help="Measure each finding's evidence with the matching attack (the first registered gradient, image "
                   "and label attack that applies: DLG, proto, labels) on the same config.")
@click.option("--evidence-iterations", type=COUNT, default=300, show_default=True,
              help="Optimisation steps for each evidence attack, and for inverting the uploads towards a private "
                   "value (e.g. FedeCouple's anchors).")
@click.pass_context
def audit(ctx, out, evidence, evidence_iterations, **opts):
    """Inspect every upload of a training run: what leaves each client, and what it gives away.

    Example: fedsec audit --method fedpac --out runs/audit-fedpac
    """
    from .audit import run_audit

    config = config_from_options(ctx, **opts)
    if evidence_iterations < 1:
        raise UserError(f"--evidence-iterations must be at least 1, got {evidence_iterations}")
    out = out or f"runs/audit-{config.method}"
    result = run_audit(config, out, evidence=evidence, evidence_iterations=evidence_iterations)
    for line in console.audit_lines(config.method, result, out):
        click.echo(line)


@cli.command()
@train_options
@click.option("--methods", default="fedecouple,fedper,fedpac,fedproto", show_default=True,
              help="Comma-separated methods to compare (replaces --method).")
@click.option("--attacks", default="dlg,ig,proto,labels", show_default=True, cls=ListedOption, listed=attacks.names,
              help="Comma-separated attacks. Where one does not apply to a method (e.g. dlg on fedproto) it is "
                   "recorded as not applicable. A malicious server's attacks (trap, binning) fill the report's "
                   "\"Malicious server\" section (see --malicious-sizes).")
@click.option("--attack-rounds", default="0", show_default=True,
              help="Rounds whose uploads are attacked (0 = the first, at the initial weights).")
@click.option("--targets", type=COUNT, default=2, show_default=True, help="Clients attacked per attacked round.")
@click.option("--iterations", default=None, metavar="N|ATTACK=N,...",
              help=f"Optimiser steps per reconstruction, for every attack (N) or per attack (dlg=300,ig=1000) "
                   f"[each attack's default: {attack_defaults()}].")
@click.option("--malicious-sizes", default=None, metavar="N,N,...",
              help="Malicious-server attacks (trap, binning, ...): the clients' numbers of training images the "
                   "report's \"Malicious server\" section measures, each with the client-side download check off "
                   "and on; an error without such an attack in --attacks [10,50].")
@click.option("--real-sizes", default=None, metavar="N,N,...",
              help="Gradient attacks on the clients' real local training, one cell per client size N "
                   "(<attack>@real-nN, each a federation of clients of exactly N training images: leakage falls "
                   "with N); without --preset audit these are the gradient attacks' only cells; an error without "
                   "a gradient attack in --attacks [--preset audit: 4,10,50].")
@click.option("--mia/--no-mia", default=False, show_default=True,
              help="Add a membership-inference stage per method (`fedsec mia` with its defaults: 4 shadow "
                   "federations per method, so about five times the training).")
@click.option("--reuse", multiple=True, type=click.Path(), metavar="DIR",
              help="Earlier report (or `fedsec train`) folder whose finished stages with the same configuration are "
                   "copied instead of recomputed (repeatable).")
@click.option("--jobs", type=COUNT, default=None,
              help="Processes that run the methods' stages side by side (one method per process at a time). Each "
                   "stage computes on --threads threads (unset: torch's default shared out over the processes; "
                   "attacks: 1), so the numbers are those of --jobs 1 with the same --threads; memory grows with "
                   "each process (about 2 GB for --preset audit) [1; --preset audit: 2].")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Folder: <method>/<stage>/ stage folders, report.md, report.html, results.csv, summary.csv, "
                   "plots; rerun with the same --out to resume.")
@click.pass_context
def report(ctx, methods, attacks, attack_rounds, targets, iterations, malicious_sizes, real_sizes, mia, reuse, jobs, out,
           **opts):
    """Train, audit and attack several methods on the same partition and seeds; write one comparison.

    For each method: train (accuracy), audit (what is uploaded, findings), then each attack. Outputs
    in --out: report.md, a self-contained report.html, results.csv (one row per method x attack x
    round x client x image), summary.csv (one row per method, with intervals and shares recovered),
    by_round.csv, findings.csv, psnr_by_method.png, accuracy_vs_leakage.png (and leakage_by_round.png
    with several attack rounds). Each stage writes <out>/<method>/<stage>/ and a done.json last, so an
    interrupted report resumes where it stopped. The time estimate is printed before it starts.

    The defaults (10 clients, 3 rounds; 2 clients attacked in round 0, `fedsec attack`'s step budgets)
    take about 6-7 minutes on mnist5k; the attacks dominate, IG most. Scale up with the train flags
    (--clients, --rounds, --local-epochs: training grows linearly) and the attack budget (--targets,
    --iterations, --attack-rounds 0,9: the train stage's recorded federation serves the audit and the
    attacks on real local training; an attack in the textbook setting trains its own), e.g.
    --clients 20 --rounds 20 --targets 5 --iterations 1000.

    Example: fedsec report --methods fedecouple,fedper,fedpac,fedproto --out runs/report

    --preset audit: 20 clients, 20 rounds; attacks ig, fedavg-leak, proto and labels at round 0 and
    round 19; ig@textbook (16 clients, one step on 2 images each); the attack built for real local
    training in three cells, fedavg-leak@real-n4, -n10 and -n50 (8 clients of 4, 4 of 10 and 2 of 50
    training images, each size its own federation; every image they trained on; the report's "Leakage
    vs client size"); proto on 11 clients, labels on all 20: at least 32 images per image cell, each
    with its interval and share recovered. One start per reconstruction, 500 steps (textbook, n4, n10)
    and 100 (n50). Explicit flags win (--iterations fedavg-leak@real=300 for every size,
    fedavg-leak@real-n10=300 for one; --attacks, --attack-rounds, --targets; --attacks without
    fedavg-leak gives ig its real-training cells back). The report prints its time estimate before it
    starts.

    Malicious-server attacks (--attacks trap, binning, ...) get their own section instead of a headline
    column: per method, clients of each --malicious-sizes N training images, the download check off and
    on: the share of the attacked clients' images rebuilt (>= 30 dB, >= prior + 6 dB) with 95 %
    intervals, the crafted and honest downloads the check refused (malicious.csv, malicious_by_size.png).
    The audit preset adds trap on 4 clients of 10 and of 50 images at round 0, and runs the methods in
    2 processes (--jobs 2: on 2 cores each trains on one thread, as --jobs 1 --threads 1 would).
    """
    from . import report as rep

    for flag in ("method",):
        if explicit(ctx, flag):
            raise UserError(f"report takes --{flag}s, not --{flag}")
    method_list = rep.parse_methods(methods)
    attack_list, settings = presets.report_plan(opts.get("preset"), attacks, attack_rounds, targets, iterations,
                                                lambda name: explicit(ctx, name), malicious_sizes, real_sizes)
    opts["method"] = None  # set per method; keeps --preset's FedeCouple values from other methods
    base = config_from_options(ctx, **opts)
    mia_settings = None
    if mia:
        from .mia import MiaSettings

        mia_settings = MiaSettings()
    jobs = jobs or (presets.AUDIT_JOBS if opts.get("preset") == "audit" else 1)
    result = rep.build_report(base, method_list, out, attacks=attack_list, settings=settings, reuse=reuse,
                              command=console.command_line("report"), mia=mia_settings, jobs=jobs)
    click.echo(rep.headline_markdown(result["summary"], result["cells"], method_list))
    click.echo(f"→ {Path(out) / 'report.html'}, {Path(out) / 'report.md'}, {Path(out) / 'summary.csv'}, "
               f"{Path(out) / 'results.csv'}" + (f", {Path(out) / 'malicious.csv'} (the \"Malicious server\" section)"
                                                  if len(result["malicious"]) else ""))
    if result["failed"]:
        click.echo(f"{len(result['failed'])} stage(s) failed (marked in the report); rerun the same command to retry "
                   "them", err=True)
        sys.exit(1)


@cli.command()
@train_options
@click.option("--defense", type=click.Choice(list(VALUE_MEANING)), required=True,
              help="dp: DP-SGD (Opacus) in every client's local training and a Gaussian mechanism for its "
                   "whole-data statistics; download-check: every client tests each download and refuses a crafted "
                   "one (use --attacks trap); the others filter each upload's update before it leaves the client.")
@click.option("--values", required=True,
              help="Comma-separated values, one sweep point each. dp: noise multiplier; noise: variance of the noise "
                   "on the gradient -delta/lr (DLG paper's unit); clip: L2 bound on the update; prune: percent of the "
                   "update zeroed; quantize: bits; exclude: a field kind (prototype, class_counts, statistic, ...) or "
                   "a field-name pattern (prototype.*); download-check: on.")
@click.option("--attacks", "attack_list", default="dlg,ig,labels", show_default=True, cls=ListedOption,
              listed=lambda: attacks.names() + ["mia"],
              help="Comma-separated attacks run against each value (mia: membership inference on the personal "
                   "models with two shadow federations; --defense dp only).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also run the method without any defense (the first row).")
@click.option("--max-grad-norm", type=POSITIVE, default=1.0, show_default=True, help="dp: per-sample clipping bound C.")
@click.option("--delta", type=Number(float, 0, 1, low_open=True, high_open=True), default=1e-5, show_default=True, help="dp: delta of the reported epsilon.")
@click.option("--accountant", type=click.Choice(["rdp", "prv"]), default="rdp", show_default=True,
              help="dp: Opacus accountant (one per client, kept across rounds).")
@statistics_dp_options
@click.option("--targets", type=COUNT, default=2, show_default=True, help="Clients attacked in round 0.")
@click.option("--iterations", type=COUNT, default=None, help="Optimiser steps per reconstruction [each attack's default].")
@click.option("--victim-batch", type=Number(int, 0), default=1, show_default=True,
              help="DLG/IG: images each attacked client trains on in round 0 (and that are rebuilt).")
@click.option("--victim-steps", type=COUNT, default=1, show_default=True, help="DLG/IG: local steps of the attacked clients.")
@click.option("--attack-seed", type=SEED, default=None, help="Seed for target choice and attack starts [--seed].")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Folder: one subfolder per value (done.json when complete), tradeoff.csv, tradeoff.png, "
                   "tradeoff.md; rerun to resume.")
@click.pass_context
def defend(ctx, defense, values, attack_list, baseline, max_grad_norm, delta, accountant, stat_noise_multiplier,
           stat_clip, counts, targets, iterations, victim_batch, victim_steps, attack_seed, out, **opts):
    """Measure what a defense costs and what it buys: accuracy, epsilon and attack success per value.

    Example: fedsec defend --method fedper --defense dp --values 0.5,1,2 --attacks dlg,ig --rounds 3 --out runs/dp-fedper
    """
    from .defend import DefendSettings, defend as run_defend

    config = config_from_options(ctx, **opts)
    settings = DefendSettings(defense=defense, values=values, attacks=attack_list, baseline=baseline,
                              max_grad_norm=max_grad_norm, delta=delta, accountant=accountant, targets=targets,
                              iterations=iterations, victim_batch=victim_batch, victim_steps=victim_steps,
                              attack_seed=attack_seed, stat_noise_multiplier=stat_noise_multiplier,
                              stat_clip=stat_clip, counts=counts)

    from reports.tradeoff import value_line

    frame = run_defend(config, settings, out, on_value=lambda row: click.echo("  " + value_line(row)),
                       command=console.command_line("defend"))
    click.echo(f"{len(frame)} values → {out}/tradeoff.csv, {out}/tradeoff.md, {out}/tradeoff.png")


@cli.command()
@train_options
@click.option("--attacks", "attack_list", default="loss,entropy,population,rmia,lira,update", show_default=True,
              help="Comma-separated attacks: loss, entropy (modified entropy), population (Attack-P), rmia (offline), "
                   "lira (online, global variance), update (the server's test on each upload; FedMIA-style).")
@click.option("--reference-runs", type=int, default=4, show_default=True,
              help="Shadow federations, in complementary pairs (even, >= 2): each client trains on a seeded half of "
                   "its records in one run of a pair and on the other half in the other.")
@click.option("--gamma", type=POSITIVE, default=2.0, show_default=True, help="rmia: likelihood-ratio threshold gamma.")
@click.option("--temperature", type=POSITIVE, default=2.0, show_default=True, help="rmia: softmax temperature.")
@click.option("--offline-a", default="tune", show_default=True,
              help="rmia: offline a in [0, 1], or 'tune' (on reference pair 0; needs --reference-runs >= 4, "
                   "else 0.3).")
@click.option("--dp", "dp_noise", type=NON_NEGATIVE, default=None,
              help="Train target and reference runs with DP at this noise multiplier (DP-SGD, and for methods that "
                   "release statistics the statistics mechanism at --stat-noise-multiplier, by default the same); "
                   "the summary then shows the accountant's epsilon next to the empirical lower bound.")
@click.option("--max-grad-norm", type=POSITIVE, default=1.0, show_default=True, help="--dp: per-sample clipping bound C.")
@statistics_dp_options
@click.option("--delta", type=Number(float, 0, 1, low_open=True, high_open=True), default=1e-5, show_default=True,
              help="delta of the accounted and of the empirical epsilon.")
@click.option("--bootstrap", type=int, default=1000, show_default=True, help="Client-bootstrap resamples per interval.")
@click.option("--exposed", type=Number(int, 0), default=16, show_default=True, help="Most exposed member records to list and show.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [runs/mia-<method>]: mia.csv, summary.json, mia.md, per_client_auc.csv, roc.png, "
                   "histograms.png, exposed.csv, exposed.png, runs/<run>/ (rerun to resume).")
@click.pass_context
def mia(ctx, attack_list, reference_runs, gamma, temperature, offline_a, dp_noise, max_grad_norm, stat_noise_multiplier,
        stat_clip, counts, delta, bootstrap, exposed, out, **opts):
    """Membership inference audit: can a model (personal, global, or a client's upload) tell which
    records a client trained on? Trains the federation and --reference-runs shadow federations.

    Members are each client's training records, non-members its own held-out records (same label
    mix). Torch runs one thread unless --threads is given.

    Example: fedsec mia --method fedper --clients 20 --rounds 5 --reference-runs 4 --out runs/mia-fedper
    """
    from .mia import MiaSettings, parse_attacks, parse_offline_a, run_mia

    settings = MiaSettings(attacks=parse_attacks(attack_list), reference_runs=reference_runs, gamma=gamma,
                           temperature=temperature, offline_a=parse_offline_a(offline_a), dp_noise=dp_noise,
                           max_grad_norm=max_grad_norm, stat_noise_multiplier=stat_noise_multiplier,
                           stat_clip=stat_clip, counts=counts, delta=delta, bootstrap=bootstrap, exposed=exposed)
    if offline_a.strip().lower() == "tune" and reference_runs < 4 and \
            explicit(ctx, "offline_a"):
        raise UserError("--offline-a tune needs --reference-runs >= 4 (a reference pair plus another pair); "
                        "give a number instead, e.g. --offline-a 0.3")
    config = config_from_options(ctx, **opts)
    out = out or f"runs/mia-{config.method}"
    summary = run_mia(config, settings, out, echo=click.echo, command=console.command_line("mia"))
    for line in console.mia_lines(config.method, summary, out):
        click.echo(line)


cli.add_command(flower)


def main(argv=None) -> None:
    """Entry point: user errors become one line on stderr and exit status 2, never a traceback."""
    try:
        cli.main(args=argv, prog_name="fedsec", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.exceptions.ClickException as exc:  # a bad flag or choice: one line too, no usage block
        where = f" (see '{exc.ctx.command_path} --help')" if getattr(exc, "ctx", None) is not None else ""
        click.echo(f"error: {exc.format_message()}{where}", err=True)
        sys.exit(2)
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted; completed rounds are checkpointed (use --resume where supported)", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
