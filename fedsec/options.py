"""Command-line options shared by several commands (``fedsec attack`` and ``fedsec flower attack``):
the threat model an attack runs under. Each maps onto the ``AttackSettings`` field of its name."""
from __future__ import annotations

import click

import attacks
from attacks.base import STARTS
from attacks.inversion.observation import AUGMENTATION_MODELS, MODES

DEVICE_HELP = ("Where tensors are computed: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda, cuda:N. "
               "Seeded GPU runs use torch's deterministic algorithms; their numbers differ from the CPU's in the "
               "last bits (README, \"GPUs\").")


def _resolved_device(ctx, param, value):
    from fedecouple.devices import resolve_device

    return resolve_device(value)  # a UserError: one line, exit 2, before anything runs


def device_option(func):
    """``--device``, one validator for every command (``fedecouple.devices.resolve_device``): the
    command receives the device in force (auto already resolved)."""
    return click.option("--device", default="auto", show_default=True, callback=_resolved_device, metavar="DEVICE",
                        help=DEVICE_HELP)(func)


THREAT_MODEL = ("mode", "augmentations", "start", "aux_data", "hyperparameters_known", "head_known", "batched")


def threat_model_options(func):
    """The threat-model flags; the command receives them as keyword arguments named in ``THREAT_MODEL``."""
    options = [
        click.option("--mode", type=click.Choice(MODES), default="auto",
                     show_default=True,
                     help="Gradient attacks' forward model: method = replay the attacked method's own local training "
                          "(its phases, losses, augmentation; needs known hyperparameters); replay = plain "
                          "cross-entropy SGD steps; scaled = the update read as one gradient. auto: method where the "
                          "method's training is not plain SGD, else replay for T > 1, else scaled (the same "
                          "computation for plain SGD)."),
        click.option("--augmentations", type=click.Choice(AUGMENTATION_MODELS), default="free",
                     show_default=True,
                     help="Method mode, for methods that train on augmented copies (FedeCouple's DA): free = each "
                          "copy is an unknown image; family = each copy is a transform of its image from the "
                          "augmentation family (gain, offset, affine warp), its parameters unknown; oracle = the "
                          "server knows the client's augmentation draws and batch order (an upper bound)."),
        click.option("--start", type=click.Choice(STARTS), default="noise", show_default=True,
                     help="DLG/iDLG dummy images start as uniform noise or as the per-channel mean image (the first "
                          "start is the image rebuilt from the closed form where it fixes one image's "
                          "last-linear input)."),
        click.option("--aux-data", default=None, metavar="DATASET",
                     help="Threat model: the server holds public data of the same domain (an embedded data set: "
                          "digits or mnist5k, resized; the attacked clients' own images left out). proto then "
                          "inverts through a surrogate extractor trained on it towards the round's prototypes, and "
                          "the class-mean prior comes from it."),
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


def pop_threat_model(opts: dict) -> dict:
    """The threat-model options, removed from a command's keyword arguments."""
    return {name: opts.pop(name) for name in THREAT_MODEL}


class LiveChoice(click.Choice):
    """A ``click.Choice`` whose choices are read each time they are used, so an attack registered
    after this module was imported (``attacks.register``) is a valid choice and shows in ``--help``."""

    def __init__(self, source, case_sensitive: bool = True):
        self._source = source
        self.case_sensitive = case_sensitive

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._source())


def restarts_option(func):
    """``--restarts``, shared by ``fedsec attack`` and ``fedsec flower attack``; its help lists each
    registered attack's declared default."""
    defaults = ", ".join(f"{name} {spec.default_restarts}" for name, spec in attacks.ATTACKS.items())
    return click.option("--restarts", type=COUNT, default=None,
                        help=f"Independent starts; the lowest objective is kept [each attack's default: {defaults}].")(func)


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
        from fedecouple.errors import UserError

        flag = param.opts[0] if param is not None else "value"
        try:
            number = self.kind(value)
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
