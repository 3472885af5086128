"""The ``fedsec`` commands' parameters: every flag, its form, default and help, declared once.

Both the command line (``fedsec.cli``) and the Python API (``fedsec.api``) parse through this tree: a
keyword of ``fedsec.attack(...)`` is the flag of ``fedsec attack`` of the same name, converted and
checked by the same parameter (the same one-line errors; ``command_of`` finds a command by name). Each
command runs its body through ``fedsec.bodies.run_command``.
Nothing here imports torch, so ``fedsec --help`` starts fast: the choices come from ``fedsec.catalog``.
"""
from __future__ import annotations

import click

from . import catalog
from .bodies import run_command
from .flower_commands import flower  # the group imports Flower only when a command runs
from .invocation import SECURE_DP
from .options import (ATTACK, ATTACK_ROUNDS, ATTACK_SEED, COUNT, EVIDENCE, EVIDENCE_ITERATIONS, IMAGES, ITERATIONS,
                      MODE_OPTION, NON_NEGATIVE, POSITIVE, RESTARTS, SEED, TARGETS, VICTIM_BATCH, VICTIM_STEPS,
                      AttackListCommand, CountOrFraction, DeclaredChoice, Number,
                      device_option, hide, run_options, threat_model_options)


class Listed(click.Option):
    """An option whose help ends with a list read when the help is shown (e.g. the registered attacks)."""

    def __init__(self, *args, listed=None, **kwargs):
        self._listed = listed
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx):
        record = super().get_help_record(ctx)
        if record is None or self._listed is None:
            return record
        return record[0], f"{record[1]} Choices: {', '.join(self._listed())}."


SECURE = catalog.SECURE_AGGREGATION  # the protocol's defaults (Flower SecAgg+'s)


SECURE_AGGREGATION_OPTIONS = [  # the protocol (fedecouple.secure_aggregation), as Flower's SecAggPlusWorkflow takes it
    click.option("--dropout", type=Number(float, 0, 1, high_open=True), default=0.0, show_default=True,
                 help="Each round, each client drops out before uploading with this probability (seeded)."),
    click.option("--secure-aggregation", is_flag=True, default=False,
                 help="The server holds only the sum of each round's uploads (SecAgg+ as Flower's SecAggPlusWorkflow "
                      "runs it); a method whose server reads uploads one by one refuses."),
    click.option("--sa-clipping-range", type=POSITIVE, default=SECURE["clipping_range"], show_default=True,
                 help="--secure-aggregation: values beyond +-this are clipped before quantising (and counted)."),
    click.option("--sa-quantization-range", type=Number(int, 2), default=SECURE["quantization_range"],
                 show_default=True, help="--secure-aggregation: the clipping range is quantised to integers 0..this."),
    click.option("--sa-modulus", type=Number(int, 3), default=SECURE["modulus"], show_default=True,
                 help="--secure-aggregation: masks are uniform over 0..this-1, sums taken modulo it."),
    click.option("--sa-num-shares", type=CountOrFraction(3), default=SECURE["num_shares"], show_default=True,
                 help="--secure-aggregation: Flower's num_shares: each client's secrets go to this many share-holders "
                      "(itself and its ring neighbours, SecAgg+), an integer, or a fraction of the round's clients "
                      "(1.0: every pair, as SecAgg)."),
    click.option("--sa-threshold", type=CountOrFraction(2), default=SECURE["reconstruction_threshold"],
                 show_default=True,
                 help="--secure-aggregation: Flower's reconstruction_threshold: the surviving share-holders every "
                      "client's neighbourhood needs, an integer, or a fraction of the shares (at least 2); below it "
                      "the round is aborted."),
    click.option("--sa-max-weight", type=POSITIVE, default=SECURE["max_weight"], show_default=True,
                 help="--secure-aggregation: the largest sample count a client's weighted values are scaled for."),
    click.option("--sa-clear-fields", type=click.Choice(catalog.SECURE_AGGREGATION_CLEAR_FIELDS),
                 default=SECURE["clear_fields"], show_default=True,
                 help="--secure-aggregation: flower: each upload's sample count and training metrics reach the "
                      "server in the clear beside the masked sum, as in Flower's SecAgg+; hidden: nothing does."),
    click.option("--sa-dp-epsilon", type=POSITIVE, default=SECURE_DP["sa_dp_epsilon"],
                 help="--secure-aggregation: distributed differential privacy: each client adds Skellam noise to its "
                      "quantised values before masking, calibrated once so the run's sums spend this epsilon in all "
                      "(no amplification by sampling) [off]."),
    click.option("--sa-dp-delta", type=Number(float, 0, 1, low_open=True, high_open=True),
                 default=SECURE_DP["sa_dp_delta"], show_default=True,
                 help="--sa-dp-epsilon: the delta of the run's (epsilon, delta)."),
    click.option("--sa-dp-clip", type=POSITIVE, default=SECURE_DP["sa_dp_clip"], show_default=True,
                 help="--sa-dp-epsilon: each client's (weighted) values are clipped to this L2 norm before quantising."),
]


def train_options(func):
    """The flags shared by every command that trains a federation."""
    options = [
        click.option("--method", default="fedecouple", show_default=True,
                     help=f"Federated method: {', '.join(catalog.METHODS)}."),
        click.option("--dataset", default="mnist5k", show_default=True,
                     help=f"Data set: {', '.join(catalog.DATASETS)}. {', '.join(catalog.EMBEDDED_DATASETS)} are "
                          "embedded; the others are read from --data-dir."),
        click.option("--data-dir", type=click.Path(file_okay=False), default=None,
                     help="Folder holding a local copy of an on-disk data set (torchvision layout; CINIC-10: train/ valid/ test/)."),
        click.option("--download/--no-download", default=False, show_default=True,
                     help="Let torchvision download the data set into --data-dir (needs network; never the default)."),
        click.option("--partition", type=click.Choice(catalog.PARTITIONS), default="pathological", show_default=True,
                     help="Label skew: iid, pathological (K classes per client), weak (the paper's s %), dirichlet (beta)."),
        click.option("--classes-per-client", type=COUNT, default=3, show_default=True,
                     help="K for pathological; number of dominant classes for weak."),
        click.option("--uniform-share", type=Number(float, 0, 100), default=20.0, show_default=True,
                     help="weak: percent of each client's data drawn uniformly over all classes (the paper's s, 0-100)."),
        click.option("--s", "s", type=Number(float, 0, 100), default=None, hidden=True,
                     help="Deprecated: --uniform-share."),
        click.option("--train-images", type=COUNT, default=None,
                     help="Every client trains on exactly this many images (a seeded sample of its training split; "
                          "any partition; a client holding fewer is an error) [all]."),
        click.option("--samples-per-client", type=COUNT, default=None, hidden=True,
                     help="Deprecated: --train-images (weak: samples per client, train+test; elsewhere at most N "
                          "training images)."),
        click.option("--beta", type=POSITIVE, default=0.1, show_default=True, help="dirichlet: concentration (> 0)."),
        click.option("--clients", type=COUNT, default=10, show_default=True, help="Number of clients N."),
        click.option("--rounds", type=COUNT, default=None,
                     help="Communication rounds [3; --preset: its rounds; attack: up to the last attacked round]."),
        click.option("--local-epochs", type=COUNT, default=1, show_default=True,
                     help="Local epochs (FedeCouple: E_cl = E_fe, its GLF epoch on top; FedRep/FedPAC: base epochs)."),
        click.option("--join-ratio", type=Number(float, 0, 1, low_open=True), default=1.0, show_default=True,
                     help="Fraction rho of clients per round."),
        click.option("--lr", type=POSITIVE, default=0.05, show_default=True, help="SGD learning rate (the paper gives none)."),
        click.option("--batch-size", type=COUNT, default=10, show_default=True, help="Mini-batch size."),
        click.option("--seed", type=SEED, default=0, show_default=True, help="Seed for partition, init and training."),
        click.option("--arch", default=None, help=f"Model: {', '.join(catalog.ARCHITECTURES)} [default: by image size]."),
        click.option("--model", default=None, metavar="PACKAGE.MODULE:FACTORY",
                     help="Your own model instead of --arch: a function of no arguments returning a "
                          "fedecouple.models.SplitModel (extractor.*, classifier.* parameters; images in [0, 1]) at "
                          "its initial weights; checked against the data set before training."),
        device_option,
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch CPU threads [torch's default; attack, and the attacks of report and defend: 1]."),
        click.option("--backend", type=click.Choice(["sequential", "ray"]), default="sequential", show_default=True,
                     help="Where client updates run: in this process, or as Ray tasks (needs Ray: pip install -e '.[ray]' from a checkout). "
                          "Same seed and --threads give the same numbers under both."),
        click.option("--ray-address", default=None,
                     help="--backend ray: join this Ray cluster (e.g. ray://head:10001 or auto) "
                          "[default: start Ray locally with this machine's cores]."),
        click.option("--preset", type=click.Choice(["paper", "audit"]), default=None,
                     help="paper: 20 clients, 5 local epochs, 200 rounds, lambda 0.8, mu 2, tau 2. audit: 20 clients, "
                          "20 rounds; report and attack add the audit's attack plan (see their --help). Explicit "
                          "flags (and a --config file's settings) win."),
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
        click.option("--hp", "hp", multiple=True, metavar="NAME=VALUE",
                     help="Any other method hyperparameter, e.g. --hp finetune_epochs=2 (ft-fedavg, default 1), "
                          "--hp head_epochs=9 (fedrep [local epochs], fedpac [1]); fedpac's SGD: head_lr [0.1], "
                          "momentum [0.5], weight_decay [5e-4] (repeatable)."),
    ] + SECURE_AGGREGATION_OPTIONS
    for option in reversed(options):
        func = option(func)
    return func


def statistics_dp_options(func):
    """The DP statistics mechanism's flags, shared by ``defend --defense dp`` and ``mia --dp``."""
    for option in reversed([
        click.option("--max-grad-norm", type=POSITIVE, default=1.0, show_default=True,
                     help="DP-SGD: per-sample clipping bound C."),
        click.option("--stat-noise-multiplier", type=NON_NEGATIVE, default=None,
                     help="DP: noise multiplier of the mechanism for whole-data statistics (anchors, prototypes, h, "
                          "V, class counts) [the DP-SGD noise multiplier]."),
        click.option("--stat-clip", type=POSITIVE, default=None,
                     help="DP: bound on each sample's feature norm in those statistics [--max-grad-norm]."),
        click.option("--counts", type=click.Choice(["noised", "withheld"]), default="noised", show_default=True,
                     help="DP: class counts in the upload: noised, or withheld (the server weights prototypes "
                          "equally)."),
        click.option("--delta", type=Number(float, 0, 1, low_open=True, high_open=True), default=1e-5,
                     show_default=True, help="DP: delta of the accounted epsilon (mia: and of the empirical one)."),
    ]):
        func = option(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="fedsec")
def cli():
    """fedsec: what does each client of a personalised federated learning method send to the
    server, and what can a curious server rebuild from it?

    Every command takes --config FILE (TOML; flags override it), writes the config.toml it ran
    with into its --out folder, and refuses a folder holding results of another configuration
    unless --force is given. The same commands are Python functions: import fedsec; fedsec.attack("dlg").
    """


@cli.command(short_help="Train a federation; report the mean per-client test accuracy.")
@train_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Run folder [runs/train-<method>]: config.toml, config.json, metrics.csv, summary.json, "
                   "partition.csv, checkpoint.pt; rerun with the same configuration to resume.")
@click.option("--resume", "resume", type=click.Path(file_okay=False), default=None,
              help="Continue the interrupted run in this folder (its config.json wins over other flags).")
@click.option("--show-partition", is_flag=True, help="Print class counts per client before training.")
@run_options
@click.pass_context
def train(ctx, **_):
    """Train a federation and report the mean per-client test accuracy.

    Example: fedsec train --method fedecouple --partition pathological --clients 10 --rounds 3 --out runs/fc
    """
    run_command(ctx)


@cli.command(short_help="Train several methods on the same partitions and seeds; tabulate their accuracy.")
@hide("method", "seed")
@train_options
@click.option("--methods", default=",".join(catalog.METHODS), show_default=True,
              help="Comma-separated methods to compare (replaces --method).")
@click.option("--seeds", default="0,1,2", show_default=True,
              help="Comma-separated seeds; each seed fixes partition, initial model and training (replaces --seed).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder [runs/compare]: <method>/seed<k>/ run folders, accuracy.csv, accuracy.md, config.toml; "
                   "rerun to resume.")
@run_options
@click.pass_context
def compare(ctx, **_):
    """Train several methods on the same partitions and seeds; write accuracy.csv and accuracy.md.

    Each method gets only the hyperparameters it takes (e.g. --lam reaches fedecouple, fedpac and
    fedproto). Finished runs are skipped, interrupted ones resumed.

    Example: fedsec compare --methods fedecouple,fedavg,local --seeds 0,1,2 --clients 20 --rounds 5 --out runs/cmp
    """
    run_command(ctx)


@cli.command(cls=AttackListCommand, short_help="Attack what the server received; score it against the truth.")
@click.argument("attack", type=ATTACK)
@train_options
@ATTACK_ROUNDS
@TARGETS
@ITERATIONS
@RESTARTS
@VICTIM_BATCH
@VICTIM_STEPS
@IMAGES
@ATTACK_SEED
@click.option("--craft", default=None,
              help="Malicious-server attacks (trap, binning): the download the server crafts for the attacked clients: "
                   "binning (every row of the first linear layer one direction, biases at public quantiles; exact "
                   "inputs) or plain (trap: Boenisch et al.'s random trap rows) [the attack's first: binning]. "
                   "fish crafts only fishing (the classifier; needs --attack-rounds 1 or later).")
@click.option("--download-check", is_flag=True, default=False,
              help="Every client tests each download before training and refuses one that looks crafted "
                   "(defenses.download_check); summary.json's download_check gives detections on the attacked "
                   "downloads and false alarms on all others.")
@click.option("--consistency-check", is_flag=True, default=False,
              help="With --secure-aggregation: every client compares a digest of its download with its protocol "
                   "neighbours' and withholds its upload on a mismatch (defenses.consistency_check, against model "
                   "inconsistency); summary.json's consistency_check gives detections and false alarms per round.")
@threat_model_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [runs/attack-<attack>-<method>]: attack.csv, summary.json, reconstructions.png, "
                   "config.toml.")
@run_options
@click.pass_context
def attack(ctx, **_):
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
    run_command(ctx)


@cli.command(short_help="Inspect every upload of a training run: what leaves each client, what it gives away.")
@train_options
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [runs/audit-<method>]: audit.csv, summary.json, findings.json, audit.md, evidence/, "
                   "config.toml.")
@EVIDENCE
@EVIDENCE_ITERATIONS
@run_options
@click.pass_context
def audit(ctx, **_):
    """Inspect every upload of a training run: what leaves each client, and what it gives away.

    Example: fedsec audit --method fedpac --out runs/audit-fedpac
    """
    run_command(ctx)


@cli.command(short_help="Train, audit and attack several methods; write one comparison report.")
@hide("method")
@train_options
@click.option("--methods", default=",".join(catalog.REPORT_METHODS), show_default=True,
              help="Comma-separated methods to compare (replaces --method).")
@click.option("--attacks", default=",".join(catalog.REPORT_ATTACKS), show_default=True, cls=Listed,
              listed=catalog.attack_names,
              help="Comma-separated attacks. Where one does not apply to a method (e.g. dlg on fedproto) it is "
                   "recorded as not applicable. A malicious server's attacks (trap, binning) fill the report's "
                   "\"Malicious server\" section (see --malicious-sizes). An attack on the sum (sum-labels, "
                   "sum-inversion, ...) runs on each method's federation under secure aggregation: the report's "
                   "\"with secure aggregation\" columns (a method that cannot run under it shows why).")
@ATTACK_ROUNDS
@TARGETS
@ITERATIONS
@RESTARTS
@VICTIM_BATCH
@MODE_OPTION
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
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder [runs/report]: <method>/<stage>/ stage folders, report.md, report.html, results.csv, "
                   "summary.csv, plots, config.toml; rerun with the same --out to resume.")
@run_options
@click.pass_context
def report(ctx, **_):
    """Train, audit and attack several methods on the same partition and seeds; write one comparison.

    For each method: train (accuracy), audit (what is uploaded, findings), then each attack. Outputs
    in --out: report.md, a self-contained report.html, results.csv (one row per method x attack x
    round x client x image), summary.csv (one row per method, with intervals and shares recovered),
    by_round.csv, findings.csv, psnr_by_method.png, accuracy_vs_leakage.png (and leakage_by_round.png
    with several attack rounds). Each stage writes <out>/<method>/<stage>/ and a done.json last, so an
    interrupted report resumes where it stopped. The time estimate is printed before it starts.

    The attacks dominate the time, IG most. Scale with the train flags (--clients, --rounds,
    --local-epochs: training grows linearly) and the attack budget (--targets, --iterations,
    --attack-rounds 0,9: the train stage's recorded federation serves the audit and the attacks on
    real local training; an attack in the textbook setting trains its own), e.g. --targets 2
    --iterations 100 for a quick look.

    Example: fedsec report --methods fedecouple,fedper,fedpac,fedproto --out runs/report

    --preset audit: 20 clients, 20 rounds; attacks ig, fedavg-leak, spear, proto and labels at round 0
    and round 19; ig@textbook (16 clients, one step on 2 images each); the attack built for real local
    training in three cells, fedavg-leak@real-n4, -n10 and -n50 (8 clients of 4, 4 of 10 and 2 of 50
    training images, each size its own federation; every image they trained on; the report's "Leakage
    vs client size"); spear@textbook (4 clients, one step on a batch of 8: the column "exact batch
    recovery"); proto on 11 clients, labels on all 20: at least 32 images per image cell, each with
    its interval and share recovered. One start per reconstruction, 500 steps (textbook, n4, n10)
    and 100 (n50). Explicit flags win (--iterations fedavg-leak@real=300 for every size,
    fedavg-leak@real-n10=300 for one; --attacks, --attack-rounds, --targets; --attacks without
    fedavg-leak gives ig its real-training cells back).

    Malicious-server attacks (--attacks trap, binning, ...) get their own section instead of a headline
    column: per method, clients of each --malicious-sizes N training images, the download check off and
    on: the share of the attacked clients' images rebuilt (>= 30 dB, >= prior + 6 dB) with 95 %
    intervals, the crafted and honest downloads the check refused (malicious.csv, malicious_by_size.png).
    The audit preset adds trap on 4 clients of 10 and of 50 images at round 0, and runs the methods in
    2 processes (--jobs 2: on 2 cores each trains on one thread, as --jobs 1 --threads 1 would).
    """
    run_command(ctx)


@cli.command(short_help="Measure what a defense costs (accuracy, epsilon) and buys (attack success).")
@train_options
@click.option("--defense", type=DeclaredChoice(lambda: catalog.DEFENSES), required=True,
              help="dp: DP-SGD (Opacus) in every client's local training and a Gaussian mechanism for its "
                   "whole-data statistics; download-check: every client tests each download and refuses a crafted "
                   "one (use --attacks trap); consistency-check: under --secure-aggregation every client compares a digest of "
                   "its download with its neighbours' and withholds its upload on a mismatch (use --attacks "
                   "inconsistency); the others filter each upload's update before it leaves the client.")
@click.option("--values", required=True,
              help="Comma-separated values, one sweep point each. dp: noise multiplier; noise: variance of the noise "
                   "on the gradient -delta/lr (DLG paper's unit); clip: L2 bound on the update; prune: percent of the "
                   "update zeroed; quantize: bits; exclude: a field kind (prototype, class_counts, statistic, ...) or "
                   "a field-name pattern (prototype.*); download-check: on.")
@click.option("--attacks", "attacks", default=",".join(catalog.DEFEND_ATTACKS), show_default=True, cls=Listed,
              listed=lambda: catalog.attack_names() + ["mia"],
              help="Comma-separated attacks run against each value (mia: membership inference on the personal "
                   "models with two shadow federations; --defense dp only).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also run the method without any defense (the first row).")
@click.option("--accountant", type=click.Choice(["rdp", "prv"]), default="rdp", show_default=True,
              help="dp: Opacus accountant (one per client, kept across rounds).")
@statistics_dp_options
@ATTACK_ROUNDS
@TARGETS
@ITERATIONS
@VICTIM_BATCH
@VICTIM_STEPS
@ATTACK_SEED
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder [runs/defend-<defense>-<method>]: one subfolder per value (done.json when complete), "
                   "tradeoff.csv, tradeoff.png, tradeoff.md, config.toml; rerun to resume.")
@run_options
@click.pass_context
def defend(ctx, **_):
    """Measure what a defense costs and what it buys: accuracy, epsilon and attack success per value.

    Example: fedsec defend --method fedper --defense dp --values 0.5,1,2 --attacks dlg,ig --rounds 3 --out runs/dp-fedper
    """
    run_command(ctx)


@cli.command(short_help="Membership inference: can a model tell which records a client trained on?")
@train_options
@click.option("--attacks", "attacks", default="loss,entropy,population,rmia,lira,update", show_default=True,
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
@click.option("--dp", "dp", type=NON_NEGATIVE, default=None,
              help="Train target and reference runs with DP at this noise multiplier (DP-SGD, and for methods that "
                   "release statistics the statistics mechanism at --stat-noise-multiplier, by default the same); "
                   "the summary then shows the accountant's epsilon next to the empirical lower bound.")
@statistics_dp_options
@click.option("--bootstrap", type=int, default=1000, show_default=True, help="Client-bootstrap resamples per interval.")
@click.option("--exposed", type=Number(int, 0), default=16, show_default=True,
              help="Most exposed member records to list and show.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output folder [runs/mia-<method>]: mia.csv, summary.json, mia.md, per_client_auc.csv, roc.png, "
                   "histograms.png, exposed.csv, exposed.png, runs/<run>/, config.toml (rerun to resume).")
@run_options
@click.pass_context
def mia(ctx, **_):
    """Membership inference audit: can a model (personal, global, or a client's upload) tell which
    records a client trained on? Trains the federation and --reference-runs shadow federations.

    Members are each client's training records, non-members its own held-out records (same label
    mix). Torch runs one thread unless --threads is given.

    Example: fedsec mia --method fedper --clients 20 --rounds 5 --reference-runs 4 --out runs/mia-fedper
    """
    run_command(ctx)


cli.add_command(flower)


def command_of(name: str) -> click.Command:
    """The command of the tree named ``name`` (``"attack"``, ``"flower audit"``)."""
    group = cli
    for part in name.split():
        group = group.commands[part]
    return group
