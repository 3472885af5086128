"""The ``fedsec`` command line: a thin shell over library functions in ``fedsec`` and ``attacks``."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from fedecouple.data import DATASETS, SCHEMES
from fedecouple.errors import UserError
from fedecouple.methods import METHODS

from .runner import PAPER_PRESET, RunConfig

HYPERPARAMETER_FLAGS = ("lam", "mu", "tau", "teacher", "center_reduction")
ABLATION_FLAGS = ("no_glf", "no_gfa", "no_gpc", "no_da")


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
        click.option("--classes-per-client", type=int, default=3, show_default=True,
                     help="K for pathological; number of dominant classes for weak."),
        click.option("--s", "s", type=float, default=20.0, show_default=True,
                     help="weak: percent of each client's data drawn uniformly over all classes (0-100)."),
        click.option("--samples-per-client", type=int, default=None,
                     help="weak: samples per client, train+test [default: min(600, 80% of an equal share)]."),
        click.option("--beta", type=float, default=0.1, show_default=True, help="dirichlet: concentration (> 0)."),
        click.option("--clients", type=int, default=10, show_default=True, help="Number of clients N."),
        click.option("--rounds", type=int, default=3, show_default=True, help="Communication rounds."),
        click.option("--local-epochs", type=int, default=1, show_default=True,
                     help="Local epochs (FedeCouple: E_cl = E_fe, its GLF epoch on top; FedRep/FedPAC: base epochs)."),
        click.option("--join-ratio", type=float, default=1.0, show_default=True, help="Fraction rho of clients per round."),
        click.option("--lr", type=float, default=0.05, show_default=True, help="SGD learning rate (the paper gives none)."),
        click.option("--batch-size", type=int, default=10, show_default=True, help="Mini-batch size."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed for partition, init and training."),
        click.option("--arch", default=None, help="Model: cnn32, cnn28, digits [default: by image size]."),
        click.option("--threads", type=int, default=None, help="torch CPU threads [default: torch's]."),
        click.option("--preset", type=click.Choice(["paper"]), default=None,
                     help="paper: 20 clients, 5 local epochs, 200 rounds, lambda 0.8, mu 2, tau 2 (explicit flags win)."),
        click.option("--lam", type=float, default=None,
                     help="lambda: FedeCouple KD weight [0.8]; FedPAC/FedProto prototype weight [their papers' 1.0]."),
        click.option("--mu", type=float, default=None, help="FedeCouple centre-loss weight mu [2.0]."),
        click.option("--tau", type=float, default=None, help="FedeCouple distillation temperature tau [2.0]."),
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
    preset = opts.pop("preset", None)
    if preset == "paper":
        for key, value in PAPER_PRESET.items():
            if key == "hyperparameters":
                for hk, hv in value.items():
                    if opts["method"] == "fedecouple":
                        hp.setdefault(hk, hv)
            elif ctx.get_parameter_source(key) != click.core.ParameterSource.COMMANDLINE:
                opts[key] = value
    known = {k: v for k, v in opts.items() if k in RunConfig.__dataclass_fields__}
    return RunConfig(**known, hyperparameters=hp)


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
    bar = tqdm(total=config.rounds, desc=f"{config.method} rounds", unit="round", file=sys.stderr)

    def on_round(r, summary):
        bar.n = r + 1
        bar.set_postfix(acc=f"{summary['mean_accuracy']:.3f}")
        bar.refresh()

    summary = run_train(config, out, resume=resume_dir is not None, on_round=on_round)
    bar.close()
    click.echo(f"{config.method} on {config.dataset} ({config.partition}, {config.clients} clients, "
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
        if ctx.get_parameter_source(flag) == click.core.ParameterSource.COMMANDLINE:
            raise UserError(f"compare takes --{flag}s, not --{flag}")
    method_list, seed_list = parse_methods(methods), parse_seeds(seeds)
    opts["method"] = None  # set per run; also keeps --preset's FedeCouple values (= its defaults) from other methods
    base = config_from_options(ctx, **opts)
    frame = run_compare(base, method_list, seed_list, out)
    click.echo((Path(out) / "accuracy.md").read_text(encoding="utf-8").rstrip())
    click.echo(f"{len(frame)} runs → {out}/accuracy.csv, {out}/accuracy.md")


def main(argv=None) -> None:
    """Entry point: user errors become one line on stderr and exit status 2, never a traceback."""
    try:
        cli.main(args=argv, prog_name="fedsec", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.exceptions.ClickException as exc:
        exc.show()
        sys.exit(2)
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted; completed rounds are checkpointed (use --resume where supported)", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
