"""The engine's names for what a user sets, and fedsec's. ``fedecouple`` is a library: a
``UserError`` it raises names the fields and parameters its caller set (``rounds``, ``num_clients``,
``data_dir``) and lists them in ``exc.fields``. The command line shows each under the flag that sets it
(``FLAGS``), the Python API under its keyword (the flag's name: ``--join-ratio`` is ``join_ratio``;
a method hyperparameter passed as ``--hp NAME=VALUE`` keeps its NAME)."""
from __future__ import annotations

import re
from typing import Callable

from fedecouple.errors import UserError

# engine field or parameter → the flag that sets it
FLAGS = {
    # FederationConfig, and the TrainConfig inside it
    "rounds": "--rounds", "join_ratio": "--join-ratio", "local_epochs": "--local-epochs",
    "batch_size": "--batch-size", "lr": "--lr", "dropout": "--dropout", "device": "--device",
    "arch": "--arch", "model": "--model",
    # make_partition
    "num_clients": "--clients", "scheme": "--partition", "classes_per_client": "--classes-per-client",
    "s": "--uniform-share", "samples_per_client": "--samples-per-client", "train_images": "--train-images",
    "beta": "--beta",
    # load_dataset
    "data_dir": "--data-dir", "download": "--download",
    # make_backend and RayBackend
    "backend": "--backend", "address": "--ray-address", "threads": "--threads",
    # method hyperparameters (make_method) without a flag of their own
    "head_epochs": "--hp head_epochs", "head_lr": "--hp head_lr", "momentum": "--hp momentum",
    "weight_decay": "--hp weight_decay", "finetune_epochs": "--hp finetune_epochs",
    # SecureAggregation (fedecouple.secure_aggregation); no flag sets the noise, the ε it is calibrated to does
    "clipping_range": "--sa-clipping-range", "quantization_range": "--sa-quantization-range",
    "modulus": "--sa-modulus", "num_shares": "--sa-num-shares", "reconstruction_threshold": "--sa-threshold",
    "max_weight": "--sa-max-weight", "clear_fields": "--sa-clear-fields", "dp_l2_clip": "--sa-dp-clip",
    "dp_delta": "--sa-dp-delta", "dp_noise": "the noise (raise --sa-dp-epsilon)",
    # SecureConfig's own, checked before the protocol is built
    "sa_dp_epsilon": "--sa-dp-epsilon", "sa_dp_delta": "--sa-dp-delta", "sa_dp_clip": "--sa-dp-clip",
}
_HYPERPARAMETER = re.compile(r"--hp (\w+)")
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)")


def flag(field: str) -> str:
    """The command line's name for an engine field (the field itself where no flag sets it)."""
    return FLAGS.get(field, field)


def keyword(field: str) -> str:
    """The Python API's name for an engine field: its flag's with each flag a keyword (``--join-ratio``:
    ``join_ratio``; ``--hp head_lr``, a method hyperparameter: ``head_lr``)."""
    name = _HYPERPARAMETER.sub(r"\1", flag(field))
    return _FLAG.sub(lambda m: m.group(1).replace("-", "_"), name)


def rename(exc: UserError, name: Callable[[str], str]) -> str:
    """``exc``'s message with each field of ``exc.fields`` named by ``name``: whole words only, and
    never inside a quoted value or touching a path's or a module's punctuation (``'pkg.model:f'``,
    ``/data/download``), which are values the message shows, not the field."""
    message = str(exc)
    fields = sorted(set(getattr(exc, "fields", ())), key=len, reverse=True)
    if not fields:
        return message
    # a quoted value is matched (and kept) whole; "GPU(s)" is a plural, not the field s
    names = "|".join(map(re.escape, fields))
    pattern = re.compile(r"""(?<!\w)('[^']*'|"[^"]*")(?!\w)"""
                         rf"""|(?<![\w.\-/\\:'"])(?<!\w\()({names})(?![\w\-/\\:'"]|\.\w)""")
    return pattern.sub(lambda m: m.group(1) or name(m.group(2)), message)


def for_cli(exc: UserError) -> str:
    """The message the command line prints: the engine's fields named by their flags."""
    return rename(exc, flag)


def for_api(exc: UserError) -> UserError:
    """The error the Python API raises: the engine's fields named by their keywords (``exc`` itself
    when it names none), with ``exc``'s traceback."""
    if not getattr(exc, "fields", ()):
        return exc
    return UserError(rename(exc, keyword)).with_traceback(exc.__traceback__)
