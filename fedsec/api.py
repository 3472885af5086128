"""fedsec's Python API: one call per job, the same jobs as the command line.

    import fedsec
    r = fedsec.attack("dlg", method="fedecouple", targets=2, iterations=50)
    r.mean_psnr, r.rows.head(), r.reconstructions.shape

Each function takes the flags of its command as keywords (``--attack-rounds`` is ``attack_rounds``),
parsed and checked by the very parameters the command line uses (``fedsec.commands``), so a bad value
is the same one-line ``fedecouple.errors.UserError``. Keywords left out take the flag's default;
``config="run/config.toml"`` reads settings from a file (keywords override it). Two keywords are the
API's own: ``out=None`` (the default) keeps everything in memory and writes no file (report, defend,
mia and compare work in a temporary folder, removed when they return), and ``progress=False`` silences
the progress bars and messages. A folder given as ``out`` is treated as on the command line: a folder
holding results of another configuration is refused unless ``force=True``; one holding this
configuration's finished results is read back instead of recomputed; every run writes the
``config.toml`` it ran with.

Each returns a result: the summary's figures as attributes (``r.mean_psnr``; any other summary key
too), the per-target or per-row results as a pandas ``DataFrame`` (``r.rows``), images as tensors where
the job rebuilds them, the output folder (``r.out``, None in memory) and ``r.lines``, what the command
line prints.

Stability: the functions and result classes in ``fedsec.__all__`` and their keywords are the public
interface; keywords follow the command line's flags, so a flag renamed is a keyword renamed. A
deprecated flag or keyword keeps working for one release, with a ``FutureWarning`` naming its
replacement (the command line prints it as a ``warning:`` line), and is listed in the CHANGELOG.
Everything else (``fedsec.*`` modules, ``attacks``, ``fedecouple``) may change between releases.
"""
from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from fedecouple.errors import UserError

from . import catalog

__all__ = ["train", "attack", "audit", "report", "defend", "mia", "compare", "Result", "TrainResult",
           "AttackResult", "AuditResult", "ReportResult", "DefendResult", "MiaResult", "CompareResult"]

# settings that say where and how a run computes, never what it computes (``fedsec.runner.RESULT_NEUTRAL``)
NEUTRAL = ("out", "force", "config", "data_dir", "download", "threads", "backend", "ray_address", "ray_cpus",
           "flower_log", "show_partition", "resume", "reuse", "jobs")
TRAIN_KEYS = ("method", "dataset", "data_dir", "download", "partition", "classes_per_client", "train_images",
              "samples_per_client", "beta", "clients", "rounds", "local_epochs", "join_ratio", "lr", "batch_size",
              "seed", "arch", "model", "device", "threads", "backend", "ray_address", "dropout", "secure_aggregation",
              "sa_clipping_range", "sa_quantization_range", "sa_modulus", "sa_num_shares", "sa_threshold",
              "sa_max_weight", "sa_clear_fields")
# protocol settings left out of a folder's identity at their defaults (folders written before they existed)
QUIET_AT_DEFAULT = {"dropout": 0.0, "secure_aggregation": False,
                    **{f"sa_{'threshold' if k == 'reconstruction_threshold' else k}": v
                       for k, v in catalog.SECURE_AGGREGATION.items()}}
HYPERPARAMETER_FLAGS = ("lam", "mu", "tau", "teacher", "center_reduction")
ABLATION_FLAGS = ("no_glf", "no_gfa", "no_gpc", "no_da")
DEFAULT_ROUNDS = 3


# ------------------------------------------------------------------------------------------------
# results


@dataclass
class Result:
    """What a job gives back: ``summary`` (its figures, also readable as attributes), ``rows`` (a
    DataFrame), ``out`` (the folder written, None in memory) and ``lines`` (what the CLI prints)."""

    summary: dict
    rows: Any = None
    out: Path | None = None
    lines: list[str] = field(default_factory=list)

    def __getattr__(self, name: str):
        summary = self.__dict__.get("summary")
        if isinstance(summary, dict) and name in summary:
            return summary[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or summary figure {name!r}")

    def __str__(self) -> str:
        return "\n".join(self.lines)


@dataclass
class TrainResult(Result):
    """``rows``: metrics per round and client (round, client, accuracy, loss); ``mean_accuracy``,
    ``std_accuracy``, ``rounds`` from the summary."""


@dataclass
class AttackResult(Result):
    """``rows``: one per reconstructed image (or, for a label attack, per class); ``reconstructions``
    and ``ground_truth``: (n, C, H, W) tensors of the images shown in reconstructions.png (None for a
    label attack, and when the result was read back from a finished folder); ``mean_psnr``,
    ``mean_prior_psnr``, ``mean_ssim``, ``label_accuracy``, ... from the summary."""

    reconstructions: Any = None
    ground_truth: Any = None


@dataclass
class AuditResult(Result):
    """``rows``: one per uploaded field (audit.csv); ``findings``: the findings, most severe first."""

    findings: list = field(default_factory=list)


@dataclass
class ReportResult(Result):
    """``rows``: results.csv (one per method, attack, round, client, image); ``table``: summary.csv
    (one row per method); ``failed``: the stages that failed."""

    table: Any = None
    failed: list = field(default_factory=list)


@dataclass
class DefendResult(Result):
    """``rows``: the trade-off table, one row per value (tradeoff.csv)."""


@dataclass
class MiaResult(Result):
    """``rows``: per record and attack scores (mia.csv); AUCs and TPRs in ``summary['targets']``."""


@dataclass
class CompareResult(Result):
    """``rows``: one row per method and seed (method, seed, mean_accuracy, std_accuracy)."""


# ------------------------------------------------------------------------------------------------
# the public functions: keywords are the flags of the command of the same name


def train(*, progress: bool = True, **options) -> TrainResult:
    """``fedsec train``: train a federation; ``rows`` are its metrics per round and client."""
    return _call("train", options, progress)


def attack(attack: str | None = None, *, progress: bool = True, **options) -> AttackResult:
    """``fedsec attack ATTACK``: train, record what the server receives, attack it, score it (``attack``
    None: the one in ``config``'s file)."""
    return _call("attack", options if attack is None else {"attack": attack, **options}, progress)


def audit(*, progress: bool = True, **options) -> AuditResult:
    """``fedsec audit``: what leaves each client, and what it gives away (findings with evidence)."""
    return _call("audit", options, progress)


def report(*, progress: bool = True, **options) -> ReportResult:
    """``fedsec report``: train, audit and attack several methods; one comparison."""
    return _call("report", options, progress)


def defend(*, progress: bool = True, **options) -> DefendResult:
    """``fedsec defend``: a defense swept over ``values`` (e.g. ``defense="dp", values="0.5,1"``)."""
    return _call("defend", options, progress)


def mia(*, progress: bool = True, **options) -> MiaResult:
    """``fedsec mia``: membership inference on the federation's models and uploads."""
    return _call("mia", options, progress)


def compare(*, progress: bool = True, **options) -> CompareResult:
    """``fedsec compare``: several methods on the same partitions and seeds; their accuracy."""
    return _call("compare", options, progress)


def command_of(name: str) -> click.Command:
    from .commands import cli

    group = cli
    for part in name.split():
        group = group.commands[part]
    return group


def _call(name: str, options: dict, progress: bool):
    """Parse ``options`` through the command's own parameters (as a config file's settings are: each
    converted and checked, and counted as given), then run the command's body."""
    command = command_of(name)
    params = {p.name for p in command.params if p.name}
    unknown = sorted(set(options) - params)
    if unknown:
        shown = ", ".join(sorted(p.name for p in command.params if p.name and not getattr(p, "hidden", False)))
        raise UserError(f"fedsec.{name}() has no keyword {', '.join(unknown)}; its keywords (the flags of "
                        f"`fedsec {name}`): {shown}")
    given = {k: v for k, v in options.items() if not (k == "config" and v is None)}
    try:
        ctx = command.make_context(f"fedsec {name}", [], default_map=given)
    except click.exceptions.ClickException as exc:
        raise UserError(exc.format_message()) from None
    return BODIES[name](ctx, Shell(cli=False, progress=progress))


def run_command(ctx: click.Context) -> None:
    """The command line's entry into a command's body: run it, print what it says."""
    name = ctx.command.name if ctx.parent is None or ctx.parent.command.name != "flower" else \
        f"flower {ctx.command.name}"
    result = BODIES[name](ctx, Shell(cli=True, progress=True))
    for line in result.lines:
        click.echo(line)
    if isinstance(result, ReportResult) and result.failed:
        click.echo(f"{len(result.failed)} stage(s) failed (marked in the report); rerun the same command to retry "
                   "them", err=True)
        sys.exit(1)


@dataclass(frozen=True)
class Shell:
    """Who called: the command line (default folders, messages on stderr) or Python (``out=None`` keeps
    everything in memory; ``progress`` silences bars and messages)."""

    cli: bool
    progress: bool

    def echo(self, text: str) -> None:
        if self.cli:
            click.echo(text, err=True)
        elif self.progress:
            print(text, file=sys.stderr)

    def out(self, value, default: Callable[[], str]) -> Path | None:
        if value is not None:
            return Path(value)
        return Path(default()) if self.cli else None


def explicit(ctx: click.Context, name: str) -> bool:
    """Whether ``name`` was given (on the command line, as a keyword, or in a --config file): a preset
    never overrides those."""
    from click.core import ParameterSource

    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.DEFAULT_MAP)


def federation(ctx: click.Context, params: dict):
    """(RunConfig, the resolved flag values) from the train flags: ``--preset`` under the given flags,
    deprecated spellings announced."""
    from . import presets
    from .options import deprecated
    from .runner import RunConfig

    hp = {k: params[k] for k in HYPERPARAMETER_FLAGS if params.get(k) is not None}
    hp.update({flag[3:]: False for flag in ABLATION_FLAGS if params.get(flag)})
    for item in params.get("hp") or ():
        if "=" not in item:
            raise UserError(f"--hp expects NAME=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        hp[key.strip().replace("-", "_")] = _parse_value(value.strip())
    flat = {k: params.get(k) for k in TRAIN_KEYS}
    flat["s"] = params.get("uniform_share", 20.0)
    if params.get("s") is not None:
        if explicit(ctx, "uniform_share"):
            raise UserError("give --uniform-share only (--s is its deprecated spelling)")
        deprecated("--s", "--uniform-share")
        flat["s"] = params["s"]
    if params.get("samples_per_client") is not None:
        deprecated("--samples-per-client", "--train-images (exactly N training images per client, any partition)")
    presets.merge_federation(params.get("preset"), flat, hp, lambda name: explicit(ctx, name))
    flat["rounds"] = flat["rounds"] or DEFAULT_ROUNDS
    for key, default in QUIET_AT_DEFAULT.items():
        if flat.get(key) is None:
            flat[key] = default
    protocol = [k for k in TRAIN_KEYS if k.startswith("sa_")]
    # given at all (even at its default value) or changed by a preset: a user who names a protocol option
    # believes the protocol is on
    named = [k for k in protocol if explicit(ctx, k) or flat.get(k) != QUIET_AT_DEFAULT.get(k)]
    if not flat["secure_aggregation"] and named:
        flags = ", ".join("--" + k.replace("_", "-") for k in named)
        raise UserError(f"{flags} set{'s' if len(named) == 1 else ''} the secure-aggregation protocol, which is "
                        "off; add --secure-aggregation or drop the option")
    config = RunConfig.of(**flat, hyperparameters=hp)
    resolved = {**params, **{k: flat[k] for k in TRAIN_KEYS}, "uniform_share": flat["s"], "s": None,
                **{k: hp.get(k) for k in HYPERPARAMETER_FLAGS},
                "hp": tuple(f"{k}={v}" for k, v in hp.items() if k not in HYPERPARAMETER_FLAGS
                            and f"no_{k}" not in ABLATION_FLAGS) or None}
    resolved.update({k: None for k, default in QUIET_AT_DEFAULT.items() if resolved.get(k) == default})
    return config, resolved


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def identity(resolved: dict) -> dict:
    """What a folder's results depend on: the resolved settings without the neutral ones, JSON-normal."""
    import json

    return json.loads(json.dumps({k: v for k, v in sorted(resolved.items()) if k not in NEUTRAL and v is not None},
                                 default=str))


@contextmanager
def workspace(out: Path | None) -> Iterator[Path]:
    """``out``, or a temporary folder removed afterwards (a job of many stages run in memory)."""
    if out is not None:
        yield out
        return
    with tempfile.TemporaryDirectory(prefix="fedsec-") as tmp:
        yield Path(tmp)


def forget_if_forced(out: Path | None, force: bool) -> None:
    """``--force`` on a command of many stages: every stage below ``out`` is computed again."""
    if force and out is not None and out.is_dir():
        from .resumable import forget

        forget(out)


from .bodies import BODIES  # noqa: E402  (the bodies use the helpers above)
