"""Command-line options shared by several commands, each declared once: the same name, form, default
and help wherever it appears (``tests/test_cli_options.py`` holds every command to that, except the
differences declared in ``DIFFERING``). Nothing here imports torch: ``--help`` reads its choices from
``fedsec.catalog``."""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import click

from fedecouple.errors import UserError

from . import catalog

# names that differ between commands on purpose, each with its reason (the consistency test reads this)
DIFFERING = {
    "--out": "each command writes its own files, so its help lists them and names its default folder",
    "--attacks": "report's columns, defend's sweep and mia's membership attacks are different lists, each with "
                 "the default that fits its command",
    "--methods": "compare trains every method by default; report audits the four mission methods (--preset audit: FedAvg beside them)",
    "--rounds": "flower commands set the app's rounds through its declared rounds-key, not fedsec's engine",
    "--threads": "a Flower app's ClientApps run one torch thread each unless told otherwise, for bit-identical "
                 "reruns; fedsec's engine uses torch's default",
    "--seed": "on flower attack fedsec seeds only what it draws (the targets, the attack starts): the app's "
              "training seed is its own run-config's",
    # until the deprecated ``flower attack APP_DIR --attack ATTACK`` goes (next release): both arguments are
    # optional there and checked by the command (the attack against the registry, as on attack)
    "ATTACK": "flower attack still takes the older APP_DIR --attack ATTACK form, so its arguments are optional",
    "APP_DIR": "flower attack still takes the older APP_DIR --attack ATTACK form, so its arguments are optional",
}


def deprecated(old: str, new: str) -> None:
    """Announce a deprecated spelling: a ``FutureWarning`` (the CLI prints it as one ``warning:`` line
    when the command has run); the spelling keeps working for one release."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", FutureWarning,
                  stacklevel=3)


class AttackListCommand(click.Command):
    """A command whose help lists every registered attack with its one-line summary (``attack``, ``flower
    attack``)."""

    def format_help_text(self, ctx, formatter):
        super().format_help_text(ctx, formatter)
        with formatter.section("Attacks"):
            formatter.write_dl(list(catalog.attack_summaries().items()))


class Number(click.ParamType):
    """An int or float option with a range, checked as it is parsed: a value out of range (or NaN) is
    the one-line ``UserError`` "--flag must be at least 1, got 0" (exit 2, before anything runs)."""

    def __init__(self, kind: type = int, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False):
        self.kind, self.low, self.high, self.low_open, self.high_open = kind, low, high, low_open, high_open
        self.name = "integer" if kind is int else "number"

    def describe(self) -> str:
        if self.low == 0 and self.low_open and self.high is None:
            return "positive"
        if self.high is None:
            return f"{'greater than' if self.low_open else 'at least'} {self.low:g}"
        if self.low is None:
            return f"{'less than' if self.high_open else 'at most'} {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def convert(self, value, param, ctx):
        flag = param.opts[0] if param is not None else "value"
        try:
            number = self.kind(value)
            if self.kind is int and isinstance(value, float) and value != number:
                raise ValueError
        except (TypeError, ValueError):
            raise UserError(f"{flag} expects {'an integer' if self.kind is int else 'a number'}, got {value!r}") from None
        low_bad = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        high_bad = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if number != number or low_bad or high_bad:
            raise UserError(f"{flag} must be {self.describe()}, got {value}")
        return number


COUNT = Number(int, 1)  # how many of something: at least 1
SEED = Number(int, 0)  # numpy's generators take seeds >= 0
POSITIVE = Number(float, 0, low_open=True)
NON_NEGATIVE = Number(float, 0)


class Iterations(click.ParamType):
    """``--iterations``: N for every attack, or ``ATTACK=N,...`` per attack (or report cell, ``ig@real=300``).
    Converts to an int (N) or the normalised text (parsed by the command that runs the attacks)."""

    name = "iterations"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return COUNT.convert(value, param, ctx)
        text = str(value).replace(" ", "")
        if "=" not in text:
            return COUNT.convert(text, param, ctx)
        for item in text.split(","):
            name, _, n = item.partition("=")
            if not name or not n:
                raise UserError(f"--iterations expects N or ATTACK=N,..., got {item!r}")
            COUNT.convert(n, param, ctx)
        return text


def iterations_for(value, attack: str) -> int | None:
    """One attack's steps from an ``--iterations`` value (None: the attack's default)."""
    if value is None or isinstance(value, int):
        return value
    table = dict(item.split("=", 1) for item in value.split(","))
    if attack not in table:
        raise UserError(f"--iterations {value} names no value for {attack}; give --iterations N or {attack}=N")
    return int(table[attack])


class AttackName(click.ParamType):
    """A registered attack's name, read when used (an attack registered at run time is a choice)."""

    name = "attack"

    def get_metavar(self, param, ctx=None) -> str:
        return "{" + "|".join(catalog.attack_names()) + "}"

    def convert(self, value, param, ctx):
        names = catalog.attack_names()
        if value not in names:
            raise UserError(f"unknown attack {value!r}; choose one of: {', '.join(names)}")
        return value


ATTACK = AttackName()


class DeclaredChoice(click.Choice):
    """A choice among declared plugins (``fedsec.catalog``), read when used: a plugin declared after the
    command line was built is a choice too."""

    def __init__(self, names: Callable[[], Sequence[str]]):
        self._names = names
        super().__init__(tuple(names()))

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._names())

    @choices.setter
    def choices(self, _value) -> None:  # click.Choice sets it once; the declarations stay the source
        pass

DEVICE_HELP = ("Where tensors are computed: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda, cuda:N. "
               "Seeded GPU runs use torch's deterministic algorithms; their numbers differ from the CPU's in the "
               "last bits.")


class Device(click.ParamType):
    """``--device``: the device in force (auto already resolved by ``fedecouple.devices.resolve_device``); a
    device torch cannot use is the one-line ``UserError``, before anything runs."""

    name = "device"

    def convert(self, value, param, ctx):
        if value is None or (ctx is not None and ctx.resilient_parsing):  # the help's parse: no torch
            return value
        from fedecouple.devices import resolve_device  # torch: only when a command runs

        return resolve_device(value)


def device_option(func):
    """``--device``, one validator for every command."""
    return click.option("--device", type=Device(), default="auto", show_default=True, metavar="DEVICE",
                        help=DEVICE_HELP)(func)


def _load_config(ctx, param, value):
    """``--config FILE``: its settings become the command's defaults (flags given on the command line
    override them; a keyword of the Python API does too)."""
    if value is None or ctx.resilient_parsing:
        return value
    from .config_file import read_config

    settings = read_config(value, ctx.command)
    ctx.default_map = {**settings, **(ctx.default_map or {})}
    return value


def run_options(func):
    """``--config`` and ``--force``: every command that writes takes both."""
    for option in reversed([
        click.option("--config", type=click.Path(dir_okay=False), default=None, is_eager=True, expose_value=True,
                     callback=_load_config, metavar="FILE",
                     help="Read the settings from this TOML file (e.g. a run's config.toml, which every run "
                          "writes); flags given on the command line override it."),
        click.option("--force", is_flag=True, default=False,
                     help="Replace the results in --out even when they were computed with another configuration "
                          "(without it such a folder is refused)."),
    ]):
        func = option(func)
    return func


def hide(*names: str):
    """Hide options a command refuses (``compare`` takes --methods, not --method) from its help; giving
    them still reaches the command, which says what to use instead."""
    def decorate(func):
        for param in getattr(func, "__click_params__", []):
            if param.name in names:
                param.hidden = True
        return func
    return decorate


THREAT_MODEL = ("mode", "augmentations", "start", "aux_data", "hyperparameters_known", "head_known", "batched")

MODE_OPTION = click.option(
    "--mode", type=click.Choice(catalog.MODES), default="auto", show_default=True,
    help="Gradient attacks' forward model: method = replay the attacked method's own local training (its phases, "
         "losses, augmentation; needs known hyperparameters); replay = plain cross-entropy SGD steps; scaled = the "
         "update read as one gradient. auto: method where the method's training is not plain SGD, else replay for "
         "T > 1, else scaled (the same computation for plain SGD).")


def threat_model_options(func):
    """The threat-model flags; the command receives them as keyword arguments named in ``THREAT_MODEL``."""
    options = [
        MODE_OPTION,
        click.option("--augmentations", type=click.Choice(catalog.AUGMENTATION_MODELS), default="free",
                     show_default=True,
                     help="Method mode, for methods that train on augmented copies (FedeCouple's DA): free = each "
                          "copy is an unknown image; family = each copy is a transform of its image from the "
                          "augmentation family (gain, offset, affine warp), its parameters unknown; oracle = the "
                          "server knows the client's augmentation draws and batch order (an upper bound)."),
        click.option("--start", type=click.Choice(catalog.STARTS), default="noise", show_default=True,
                     help="DLG/iDLG dummy images start as uniform noise or as the per-channel mean image (the first "
                          "start is the image rebuilt from the closed form where it fixes one image's "
                          "last-linear input)."),
        click.option("--aux-data", default=None, metavar="DATASET",
                     help="Threat model: the server holds public data of the same domain (an embedded data set: "
                          f"{' or '.join(catalog.EMBEDDED_DATASETS)}, resized; the attacked clients' own images left "
                          "out). proto then inverts through a surrogate extractor trained on it towards the round's "
                          "prototypes, and the class-mean prior comes from it."),
        click.option("--hyperparameters-known/--hyperparameters-unknown", default=True, show_default=True,
                     help="Whether the server knows the client's lr, batch size, epochs and number of samples."),
        click.option("--head-known/--head-unknown", default=True, show_default=True,
                     help="--head-unknown: the attack does not use the classifier's update (private-head threat "
                          "model)."),
        click.option("--batched/--no-batched", default=True, show_default=True,
                     help="Gradient attacks: optimise the targets that share a model (e.g. all of round 0) together "
                          "in one vmapped batch. Each evaluation equals --no-batched (one by one) to float rounding; "
                          "a stalled optimisation (DLG on cnn28) can end in another local minimum, and IG's final stage "
                          "(one L-BFGS-B over the batch) depends on the batch."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _defaults(field: str) -> str:
    return ", ".join(f"{name} {n}" for name, n in catalog.attack_defaults(field).items())


class _DefaultsOption(click.Option):
    """An option whose help ends with each registered attack's declared default, read when shown."""

    def __init__(self, *args, defaults_of: str, **kwargs):
        self._field = defaults_of
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx):
        record = super().get_help_record(ctx)
        return None if record is None else (record[0], record[1].replace("{defaults}", _defaults(self._field)))


ATTACK_ROUNDS = click.option(
    "--attack-rounds", default=None, metavar="R,R,...",
    help="Comma-separated rounds whose uploads are attacked (0 = the first round, at the initial weights) [0; fish: "
         "1, the first round with an earlier upload to read].")
TARGETS = click.option("--targets", type=COUNT, default=8, show_default=True,
                       help="Clients attacked per attacked round (seeded choice); 8 one-image targets give an interval.")
ITERATIONS = click.option(
    "--iterations", type=Iterations(), default=None, metavar="N|ATTACK=N,...", cls=_DefaultsOption,
    defaults_of="default_iterations",
    help="Optimiser steps per reconstruction, for every attack (N) or per attack (dlg=300,ig=1000) [each attack's "
         "default: {defaults}; dlg/idlg count L-BFGS steps of up to 20 evaluations, ig Adam steps].")
RESTARTS = click.option("--restarts", type=COUNT, default=None, cls=_DefaultsOption, defaults_of="default_restarts",
                        help="Independent starts; the lowest objective is kept [each attack's default: {defaults}].")
VICTIM_BATCH = click.option(
    "--victim-batch", type=Number(int, 0), default=None,
    help="B: attacked clients train on B of their images in the attacked round, and B images are rebuilt [1 for the "
         "gradient attacks; 0 (= the clients' real local training) for the others].")
VICTIM_STEPS = click.option("--victim-steps", type=COUNT, default=1, show_default=True,
                            help="T: local steps per phase in the victim setting.")
IMAGES = click.option("--images", type=COUNT, default=None,
                      help="Images rebuilt per target [--victim-batch; 1 with --victim-batch 0]; e.g. 2 for a method "
                           "that trains on each image and an augmented copy.")
ATTACK_SEED = click.option("--attack-seed", type=SEED, default=None,
                           help="Seed for target choice and attack starts [--seed].")
EVIDENCE = click.option(
    "--evidence/--no-evidence", default=True, show_default=True,
    help="Measure each finding's evidence with the matching attack (the first registered gradient, image and label "
         "attack that applies: DLG, proto, labels) on the same federation, the gradient attack in the textbook "
         "setting; under --secure-aggregation, sum-labels on every round's sum.")
EVIDENCE_ITERATIONS = click.option(
    "--evidence-iterations", type=COUNT, default=300, show_default=True,
    help="Optimisation steps for each evidence attack, and for inverting the uploads towards a private value "
         "(e.g. FedeCouple's anchors).")


class CountOrFraction(click.ParamType):
    """A SecAgg+ setting Flower's ``SecAggPlusWorkflow`` takes as an integer (a count) or a float (a
    fraction): written without a decimal point it is a count of at least ``least``, with one a fraction in
    (0, 1]; 1 is the fraction 1.0, as Flower reads it. A bad value is one ``UserError`` line."""

    name = "count-or-fraction"

    def __init__(self, least: int):
        self.least = least

    def convert(self, value, param, ctx):
        flag = param.opts[0] if param is not None else "value"
        wanted = f"an integer of at least {self.least} (a count) or a fraction in (0, 1]"
        number = value
        if isinstance(value, str):
            text = value.strip()
            try:
                number = int(text) if text.lstrip("+-").isdigit() else float(text)
            except ValueError:
                raise UserError(f"{flag} expects {wanted}, got {value!r}") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise UserError(f"{flag} expects {wanted}, got {value!r}")
        if isinstance(number, int):
            if number == 1:
                return 1.0
            if number >= self.least:
                return number
        elif 0 < number <= 1:
            return number
        raise UserError(f"{flag} must be {wanted}, got {value}")
