"""What the commands' bodies (``fedsec.bodies``) share: ``Request`` (one command's settings as given, the
seam between the front ends and the bodies), ``Shell`` (who called: the command line or Python),
``federation`` (the train settings as a ``RunConfig``), ``identity`` (what an output folder's results depend
on) and ``workspace`` (the output folder, or a temporary one).
The command line's help loads this module, so it imports torch only inside ``federation``."""
from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

import click

from fedecouple.errors import UserError

from . import catalog

# settings that say where and how a run computes, never what it computes (``fedsec.runner.RESULT_NEUTRAL``)
NEUTRAL = ("out", "force", "config", "data_dir", "download", "threads", "backend", "ray_address", "ray_cpus",
           "flower_log", "show_partition", "resume", "reuse", "jobs")
TRAIN_KEYS = ("method", "dataset", "data_dir", "download", "partition", "classes_per_client", "train_images",
              "samples_per_client", "beta", "clients", "rounds", "local_epochs", "join_ratio", "lr", "batch_size",
              "seed", "arch", "model", "device", "threads", "backend", "ray_address", "dropout", "secure_aggregation",
              "sa_clipping_range", "sa_quantization_range", "sa_modulus", "sa_num_shares", "sa_threshold",
              "sa_max_weight", "sa_clear_fields", "sa_dp_epsilon", "sa_dp_delta", "sa_dp_clip")
# distributed DP under secure aggregation (``fedsec.runner.SecureConfig``): off without a target epsilon
SECURE_DP = {"sa_dp_epsilon": None, "sa_dp_delta": catalog.SECURE_AGGREGATION["dp_delta"], "sa_dp_clip": 1.0}
# protocol settings left out of a folder's identity at their defaults (folders written before they existed)
QUIET_AT_DEFAULT = {"dropout": 0.0, "secure_aggregation": False,
                    **{f"sa_{'threshold' if k == 'reconstruction_threshold' else k}": v
                       for k, v in catalog.SECURE_AGGREGATION.items() if not k.startswith("dp_")}, **SECURE_DP}
HYPERPARAMETER_FLAGS = ("lam", "mu", "tau", "teacher", "center_reduction")
ABLATION_FLAGS = ("no_glf", "no_gfa", "no_gpc", "no_da")
DEFAULT_ROUNDS = 3


@dataclass(frozen=True)
class Request:
    """One command's settings, converted and checked: what a body reads, whoever called it.

    The command line builds it from its parsed flags (``of_click``), the Python API from keywords
    (``fedsec.keywords.request``); both convert each value with the command's own parameter types, so a
    bad value is the same one-line error either way. ``given`` holds the settings given explicitly (a
    flag, a keyword or a ``--config`` file's entry): a preset never overrides those."""

    command: str  # "attack", "flower attack"
    params: Mapping[str, Any]  # every setting of the command, by parameter name; defaults filled in
    given: frozenset[str] = frozenset()
    order: tuple[str, ...] = ()  # the help's order (a run's config.toml lists its settings in it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def explicit(self, name: str) -> bool:
        """Whether ``name`` was given (on the command line, as a keyword, or in a --config file)."""
        return name in self.given

    @classmethod
    def of_click(cls, ctx: click.Context) -> "Request":
        """The command line's parsed context as a request."""
        from click.core import ParameterSource

        name = ctx.command.name if ctx.parent is None or ctx.parent.command.name != "flower" else \
            f"flower {ctx.command.name}"
        given = {n for n in ctx.params
                 if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.DEFAULT_MAP)}
        return cls(name, ctx.params, frozenset(given), tuple(p.name for p in ctx.command.params if p.name))


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


def federation(request: Request, params: Mapping[str, Any]):
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
        if request.explicit("uniform_share"):
            raise UserError("give --uniform-share only (--s is its deprecated spelling)")
        deprecated("--s", "--uniform-share")
        flat["s"] = params["s"]
    if params.get("samples_per_client") is not None:
        deprecated("--samples-per-client", "--train-images (exactly N training images per client, any partition)")
    presets.merge_federation(params.get("preset"), flat, hp, lambda name: request.explicit(name))
    flat["rounds"] = flat["rounds"] or DEFAULT_ROUNDS
    for key, default in QUIET_AT_DEFAULT.items():
        if flat.get(key) is None:
            flat[key] = default
    protocol = [k for k in TRAIN_KEYS if k.startswith("sa_")]
    # given at all (even at its default value) or changed by a preset: a user who names a protocol option
    # believes the protocol is on
    named = [k for k in protocol if request.explicit(k) or flat.get(k) != QUIET_AT_DEFAULT.get(k)]
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

