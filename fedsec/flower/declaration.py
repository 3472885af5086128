"""The declaration a user gives for their Flower app: what the audit needs to know and cannot observe.

In the app's ``pyproject.toml``::

    [tool.fedsec]
    declaration = "my_app.task:fedsec_declaration"   # function(run_config: dict) -> dict, keys below
    rounds-key = "num-server-rounds"                 # optional: run-config key of the number of rounds
    victim-keys = { batch = "victim-batch", steps = "victim-steps", rounds = "victim-rounds" }  # optional

The function gets the run config the audit runs with and returns:

* ``model``: a function of no arguments returning the app's model (a ``fedecouple.models.SplitModel``:
  ``extractor.*`` then ``classifier.*`` parameters, images in [0, 1]) at the federation's initial
  weights; attacks run their forward model on it, so it must be the model the app trains;
* ``dataset``: the pooled data set (``fedecouple.data.ImageDataset``) the app's nodes draw from, and the
  positions the app reports to ``fedsec.flower.log_batch`` index into (used to score only);
* ``method``: the fedsec protocol the app's strategy and clients follow: ``fedavg`` (the whole model
  uploaded and averaged) or ``fedper`` (the base uploaded, the head kept by each node);
* ``lr``, ``local-epochs``, ``batch-size``: the clients' local SGD (attacks that replay local training
  need them);
* ``local-parameters`` (optional, default none): name patterns (``fnmatch``) of the parameters that stay
  on the nodes, e.g. ``["classifier.*"]``.

``rounds-key`` lets ``fedsec flower attack`` stop the app after the last attacked round. ``victim-keys``
names the run-config keys through which the app supports the textbook attack setting: in the Flower
rounds listed in ``rounds`` (comma-separated, from 1) every node trains ``steps`` SGD steps on ``batch``
of its images (chosen by the app; ``batch`` 0 switches it off).

``check_traffic`` holds the declaration to what the app actually sent: every array must be a parameter
of the declared model with the same shape, every upload must carry exactly the parameters the method
uploads, and none that the declaration keeps local. A masked upload of Flower's SecAgg+ carries no
named arrays: ``fedsec.flower.secagg.check_secure_traffic`` checks its size instead.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

from torch import nn

from fedecouple.channel import Recorder
from fedecouple.data.dataset import ImageDataset
from fedecouple.errors import UserError
from fedecouple.methods import make_method
from fedecouple.methods.base import Method, TrainConfig

from .app import FlowerApp
from .convert import CONFIG_PREFIX, METRIC_PREFIX, SAMPLE_COUNT

METHODS = ("fedavg", "fedper")
REQUIRED = ("model", "dataset", "method", "lr", "local-epochs", "batch-size")
OPTIONAL = ("local-parameters",)
VICTIM_KEYS = ("batch", "steps", "rounds")
HOW = "see docs/flower.md, 'What the audit needs from you'"


@dataclass
class Declaration:
    make_model: Callable[[], nn.Module]
    dataset: ImageDataset
    method: Method
    train: TrainConfig
    local_parameters: tuple[str, ...] = ()
    rounds_key: str | None = None
    victim_keys: dict[str, str] | None = None
    source: str = ""  # where it came from, for messages

    def model_parameters(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.make_model().named_parameters()}

    def is_local(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.local_parameters)


def _names(names, limit: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def load_declaration(app: FlowerApp, run_config: dict) -> Declaration:
    """The app's declaration for ``run_config``; a one-line UserError for anything missing or ill-typed."""
    from flwr.supercore.object_ref import load_app

    table = app.fedsec
    where = f"{app.directory / 'pyproject.toml'} [tool.fedsec]"
    if not table.get("declaration"):
        raise UserError(f"{app.directory / 'pyproject.toml'} has no [tool.fedsec] declaration; add "
                        f"declaration = \"module:function\" naming a function(run_config) -> dict ({HOW})")
    reference = str(table["declaration"])
    unknown = sorted(set(table) - {"declaration", "rounds-key", "victim-keys"})
    if unknown:
        raise UserError(f"{where} has unknown keys {', '.join(unknown)}; it takes declaration, rounds-key, victim-keys")
    try:
        function = load_app(reference, UserError, app.directory)
    except (UserError, ImportError, AttributeError) as exc:
        raise UserError(f"{where}: cannot load declaration {reference!r} ({str(exc).splitlines()[0]})") from None
    if not callable(function):
        raise UserError(f"{where}: declaration {reference!r} is not a function of the run config")
    try:
        values = function(dict(run_config))
    except Exception as exc:  # the user's code: one line naming it, not its traceback
        first = (str(exc).splitlines() or [""])[0]
        raise UserError(f"{where}: declaration {reference!r} raised {type(exc).__name__}: {first} (check the "
                        f"run config it was given: --run-config and [tool.flwr.app.config])") from None
    if not isinstance(values, dict):
        raise UserError(f"declaration {reference!r} returned {type(values).__name__}, expected a dict ({HOW})")
    missing = [k for k in REQUIRED if k not in values]
    extra = sorted(set(values) - set(REQUIRED) - set(OPTIONAL))
    if missing or extra:
        problem = (f"lacks {', '.join(missing)}" if missing else "") + ("; " if missing and extra else "") + \
                  (f"has unknown keys {', '.join(extra)}" if extra else "")
        raise UserError(f"declaration {reference!r} {problem}; it takes {', '.join(REQUIRED + OPTIONAL)} ({HOW})")
    if not callable(values["model"]):
        raise UserError(f"declaration {reference!r}: model must be a function returning the model at its initial weights")
    if not isinstance(values["dataset"], ImageDataset):
        raise UserError(f"declaration {reference!r}: dataset must be a fedecouple.data.ImageDataset (the pooled "
                        f"images the nodes draw from), got {type(values['dataset']).__name__}")
    if values["method"] not in METHODS:
        raise UserError(f"declaration {reference!r}: method {values['method']!r} is not one fedsec can audit a "
                        f"Flower app under; choose one of: {', '.join(METHODS)}")
    try:
        train = TrainConfig(lr=float(values["lr"]), batch_size=int(values["batch-size"]),
                            local_epochs=int(values["local-epochs"]))
    except (TypeError, ValueError):
        raise UserError(f"declaration {reference!r}: lr must be a number, local-epochs and batch-size integers") from None
    if not train.lr > 0 or train.batch_size < 1 or train.local_epochs < 1:
        raise UserError(f"declaration {reference!r}: needs lr > 0, local-epochs >= 1 and batch-size >= 1 "
                        f"(got {train.lr}, {train.local_epochs}, {train.batch_size})")
    local = values.get("local-parameters", [])
    if isinstance(local, str) or not all(isinstance(p, str) for p in local):
        raise UserError(f"declaration {reference!r}: local-parameters must be a list of name patterns, e.g. [\"classifier.*\"]")
    rounds_key = table.get("rounds-key")
    if rounds_key is not None and rounds_key not in run_config:
        raise UserError(f"{where}: rounds-key {rounds_key!r} is not a run-config key of the app")
    victim = table.get("victim-keys")
    if victim is not None:
        if not isinstance(victim, dict) or set(victim) != set(VICTIM_KEYS):
            raise UserError(f"{where}: victim-keys must map batch, steps and rounds to run-config keys")
        absent = [v for v in victim.values() if v not in run_config]
        if absent:
            raise UserError(f"{where}: victim-keys name {', '.join(absent)}, which the app's run config does not have")
    return Declaration(make_model=values["model"], dataset=values["dataset"], method=make_method(values["method"]),
                       train=train, local_parameters=tuple(local), rounds_key=rounds_key,
                       victim_keys=None if victim is None else {k: str(v) for k, v in victim.items()},
                       source=reference)


def arrays_of(tensors) -> dict:
    """The model arrays among a recorded message's tensors (not the sample count, metrics or config)."""
    return {n: t for n, t in tensors.items()
            if n != SAMPLE_COUNT and not n.startswith(METRIC_PREFIX) and not n.startswith(CONFIG_PREFIX)}


def check_traffic(declaration: Declaration, recorder: Recorder) -> None:
    """A one-line UserError where what the app sent contradicts the declaration (module docstring)."""
    shapes = declaration.model_parameters()
    local = {n for n in shapes if declaration.is_local(n)}
    model = declaration.make_model()
    method = declaration.method
    uploaded_by_method = {f.name for f in method.manifest(model) if f.kind in ("extractor", "classifier")}
    if uploaded_by_method != set(shapes) - local:
        raise UserError(f"the declaration keeps {_names(local) or 'no parameter'} on the nodes, but method "
                        f"{method.name} keeps {_names(set(shapes) - uploaded_by_method) or 'none'}; declare the "
                        f"method the app follows and its local-parameters consistently")
    for (round, client), exchange in sorted(recorder.exchanges.items()):
        where = f"round {round} (Flower round {round + 1}), client {client}"
        for kind, message in (("sends", exchange.download), ("uploads", exchange.upload)):
            if message is None or (kind == "uploads" and message.meta.get("secure_aggregation")):
                continue  # a masked upload carries no named arrays (``fedsec.flower.secagg`` checks its size)
            arrays = arrays_of(message.tensors)
            unknown = set(arrays) - set(shapes)
            if unknown:
                raise UserError(f"the app {kind} arrays the declared model has no parameter for: {_names(unknown)} "
                                f"({where}); the declaration's model must build the model the app trains")
            for name, tensor in arrays.items():
                if tuple(tensor.shape) != shapes[name]:
                    raise UserError(f"the app {kind} {name} with shape {tuple(tensor.shape)}, the declared model has "
                                    f"{shapes[name]} ({where}); the declaration's model must build the app's model")
            if kind != "uploads":
                continue
            leaked = set(arrays) & local
            if leaked:
                raise UserError(f"the declaration keeps {_names(leaked)} on the nodes, but the app uploads it "
                                f"({where}); declare the method the app follows (e.g. fedavg) or fix the app")
            absent = uploaded_by_method - set(arrays)
            if absent:
                raise UserError(f"method {method.name} uploads {_names(absent)}, which the app does not send ({where}); "
                                f"declare the method and local-parameters the app follows")
