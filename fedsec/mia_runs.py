"""One federation of a membership-inference audit: train it, then record what every model it
produced says about every audited record (``fedsec.jobs.mia`` plans the runs and scores them).

A run trains ``config``'s method on a given partition with a given federation seed and keeps,
for each audited record (every record of every client: its training and held-out splits):

* ``personal``: logits under its owner's personalised model (``method.personalized``, exactly
  as ``Federation.evaluate`` builds it after the last round);
* ``global``: logits under the server's global model, where the server holds one. A server that
  holds only a base (extractor) — FedPer, FedRep, FedPAC — gets a linear head fitted on public
  data (see ``probe_logits``); FedProto and Local have no global model;
* ``upload``: logits under the model the owner uploaded in the last round (base-only uploads get a
  probe head the same way); FedProto uploads prototypes only and Local uploads nothing;
* ``loss_down`` / ``loss_up`` (when ``server_view``): every record's loss under the model the
  server sent each client in the last round and under that client's upload, for the update test
  (only where both carry a classifier).

"Public data" for a probe head: the records of the *other* clients that this run did not train
on (the target's held-out splits; a reference run's OUT halves), so a probe never saw the records
it scores. The run folder holds ``signals.pt`` and, written last, ``done.json`` (with a
fingerprint of everything that determines the run: ``RunSpec.stage``, a ``fedsec.resumable``
stage), so a finished run is reused on rerun.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from defenses.dp import DPConfig, DPMethod, privacy_report
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.errors import UserError
from fedecouple.data.dataset import ImageDataset
from fedecouple.devices import to_device
from fedecouple.data.partition import Partition
from fedecouple.engine import Federation, derive_seed, summarize
from fedecouple.methods.facets import secure_refusal
from fedecouple.models import SplitModel, set_params

from . import io
from .resumable import ResumableStage
from .runner import RunConfig, build_method

KINDS = ("personal", "global", "upload")
CHUNK = 1000
PROBE_MAX_RECORDS = 2000  # public records a probe head is fitted on (seeded subsample above that)
PROBE_STEPS = 100
ABSENT_LOGIT = -30.0  # probe logit of a class the public data lacks: that class is never predicted


@dataclass
class RunSpec:
    """Everything one run needs besides the data set (picklable: it travels to Ray workers)."""

    name: str  # "target" or "ref-<r>"
    config: RunConfig
    partition: Partition
    federation_seed: int
    records: np.ndarray  # pool indices of the audited records
    owner: np.ndarray  # client of each record
    trained: np.ndarray  # bool per record: in this run's training data
    folder: str
    dp: DPConfig | None = None
    server_view: bool = False

    def fingerprint(self) -> str:
        config = {k: v for k, v in self.config.to_dict().items() if k not in ("backend", "ray_address")}
        text = json.dumps({"config": config, "name": self.name, "seed": self.federation_seed,
                           "dp": None if self.dp is None else asdict(self.dp), "server_view": self.server_view,
                           "records": hashlib.sha256(self.records.tobytes() + self.trained.tobytes()).hexdigest()},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def stage(self) -> ResumableStage:
        """The run's folder as a resumable stage: complete when its ``done.json`` holds this fingerprint
        and ``signals.pt`` exists."""
        return ResumableStage(Path(self.folder), self.fingerprint(), required=("signals.pt",),
                              identity_field="fingerprint")


def done_record(spec: RunSpec) -> dict | None:
    """The run's ``done.json`` if it finished with the same fingerprint, else None."""
    stage = spec.stage()
    return stage.record() if stage.complete() else None


def load_signals(spec: RunSpec) -> dict[str, torch.Tensor]:
    return io.load_torch(Path(spec.folder) / "signals.pt")


def run_one(spec: RunSpec, dataset: ImageDataset) -> dict:
    """Train the run (unless already done) and write its signals; returns its ``done.json``."""
    done = done_record(spec)
    if done is not None:
        return done
    start = time.perf_counter()
    method = build_method(spec.config)
    if spec.dp is not None:
        method = DPMethod(method, spec.dp)
    last = spec.config.federation.rounds - 1
    recorder = Recorder(rounds={last}, remember_latest=False)
    fed_config = replace(spec.config.federation, seed=spec.federation_seed)
    protocol = spec.config.secure.protocol(spec.federation_seed)  # under it the uploads recorded are masked
    if protocol is not None and (refusal := secure_refusal(method)):
        raise UserError(refusal)
    fed = Federation(method, dataset, spec.partition, fed_config,
                     channel=ServerChannel(recorder=recorder, secure=protocol))
    fed.run()
    signals = collect_signals(fed, recorder, spec)
    io.save_torch(Path(spec.folder) / "signals.pt", signals)
    record = {"name": spec.name, "fingerprint": spec.fingerprint(), "federation_seed": spec.federation_seed,
              "rounds": fed.completed_rounds, "seconds": round(time.perf_counter() - start, 2),
              "mean_accuracy": summarize(fed.metrics)["mean_accuracy"],
              "training_records": int(spec.trained.sum()), "notes": signals_notes(signals)}
    if spec.dp is not None:
        record["dp"] = privacy_report(fed.clients, spec.dp)
    spec.stage().finish(io.finite(record))  # last: the run is complete
    return record


def signals_notes(signals: dict) -> list[str]:
    return [f"{kind}: {note}" for kind, note in signals.get("_notes", {}).items()] if "_notes" in signals else []


# ---------------------------------------------------------------------------------------------
# signals


def _device(model: SplitModel) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _logits(model: SplitModel, images: torch.Tensor) -> torch.Tensor:
    """Logits on the model's device (the run's), returned on the CPU, where the signals are kept."""
    device = _device(model)
    return torch.cat([model(images[i:i + CHUNK].to(device)).cpu() for i in range(0, len(images), CHUNK)]) \
        if len(images) else torch.zeros(0, model.num_classes)


@torch.no_grad()
def _features(model: SplitModel, images: torch.Tensor) -> torch.Tensor:
    device = _device(model)
    return torch.cat([model.features(images[i:i + CHUNK].to(device)).cpu() for i in range(0, len(images), CHUNK)])


def personal_params(fed: Federation, cid: int, round: int) -> dict[str, torch.Tensor]:
    """Client ``cid``'s personalised model after ``round``, built exactly as ``Federation.evaluate`` does."""
    ctx = fed.context(cid, round)
    torch.manual_seed(derive_seed(fed.config.seed, round, cid, 3))
    device = fed.config.device
    with torch.enable_grad():
        return fed.method.personalized(ctx, to_device(fed.server, device), to_device(fed.client_state(cid), device))


def _groups(tensors) -> tuple[dict, dict]:
    extractor = {k: v for k, v in tensors.items() if k.startswith("extractor.")}
    classifier = {k: v for k, v in tensors.items() if k.startswith("classifier.")}
    return extractor, classifier


def probe_logits(public_features: torch.Tensor, public_labels: torch.Tensor, features: torch.Tensor,
                 num_classes: int) -> torch.Tensor:
    """Logits of records with ``features`` under a linear head fitted on public records' features.

    The head: multinomial logistic regression on standardised features, mean cross-entropy +
    ‖W‖²/(2n) (scikit-learn's ``LogisticRegression(C=1)`` objective divided by n), fitted with
    torch's L-BFGS (strong Wolfe line search, at most ``PROBE_STEPS`` iterations) in float64. A
    class absent from the public data gets the constant logit ``ABSENT_LOGIT``.
    """
    out = torch.full((len(features), num_classes), ABSENT_LOGIT)
    classes = torch.unique(public_labels)
    if len(classes) < 2:
        return out
    public_features = public_features.to(torch.float64)
    mean, std = public_features.mean(0), public_features.std(0).clamp_min(1e-6)
    x = (public_features - mean) / std
    y = torch.searchsorted(classes, public_labels)
    weight = torch.zeros(x.shape[1], len(classes), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(len(classes), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=PROBE_STEPS, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-7, tolerance_change=1e-10)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + weight.pow(2).sum() / (2 * len(x))
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        out[:, classes] = (((features.to(torch.float64) - mean) / std) @ weight + bias).to(torch.float32)
    return out


class _SignalContext:
    """The data of one run's signal collection, shared by the per-kind helpers."""

    def __init__(self, fed: Federation, spec: RunSpec):
        self.fed, self.spec = fed, spec
        self.model = fed.model
        idx = torch.from_numpy(spec.records)
        self.images, self.labels = fed.dataset.images[idx], fed.dataset.labels[idx]
        self.num_classes = fed.dataset.num_classes
        self.clients = np.unique(spec.owner)
        self._shared: tuple[int, torch.Tensor] | None = None  # features of every record under one shared base

    def rows(self, cid: int) -> np.ndarray:
        return np.flatnonzero(self.spec.owner == cid)

    def public_rows(self, cid: int) -> np.ndarray:
        """Records of the other clients this run did not train on (a seeded subsample of at most
        ``PROBE_MAX_RECORDS``)."""
        rows = np.flatnonzero((self.spec.owner != cid) & ~self.spec.trained)
        if len(rows) > PROBE_MAX_RECORDS:
            rng = np.random.default_rng(derive_seed(self.spec.federation_seed, cid, 0x9808E))
            rows = np.sort(rng.choice(rows, PROBE_MAX_RECORDS, replace=False))
        return rows

    def _features_of(self, tensors: dict, rows: np.ndarray, shared: bool) -> torch.Tensor:
        if shared:  # the same base for every client (the global model): every record's features once
            if self._shared is None or self._shared[0] != id(tensors):
                self._shared = (id(tensors), _features(self.model, self.images))
            return self._shared[1][torch.from_numpy(rows)]
        return _features(self.model, self.images[torch.from_numpy(rows)])

    def logits_of(self, tensors: dict, cid: int, shared: bool = False) -> torch.Tensor | None:
        """Client ``cid``'s records under the model in ``tensors`` (a probe head if it has no classifier)."""
        extractor, classifier = _groups(tensors)
        rows = self.rows(cid)
        if extractor and classifier:
            set_params(self.model, {**extractor, **classifier})
            return _logits(self.model, self.images[torch.from_numpy(rows)])
        if extractor:
            set_params(self.model, extractor)
            public = self.public_rows(cid)
            return probe_logits(self._features_of(tensors, public, shared), self.labels[torch.from_numpy(public)],
                                self._features_of(tensors, rows, shared), self.num_classes)
        return None


def collect_signals(fed: Federation, recorder: Recorder, spec: RunSpec) -> dict:
    """Per-record logits under the run's personal, global and uploaded models (see the module)."""
    ctx = _SignalContext(fed, spec)
    last = fed.completed_rounds - 1
    n = len(spec.records)
    out: dict = {"records": torch.from_numpy(spec.records), "owner": torch.from_numpy(spec.owner),
                 "trained": torch.from_numpy(spec.trained)}
    notes: dict[str, str] = {}
    personal = torch.empty(n, ctx.num_classes)
    for cid in ctx.clients:
        set_params(ctx.model, personal_params(fed, int(cid), last))
        personal[torch.from_numpy(ctx.rows(cid))] = _logits(ctx.model, ctx.images[torch.from_numpy(ctx.rows(cid))])
    out["personal"] = personal
    server = {k[len("global."):]: v for k, v in fed.server.items() if k.startswith("global.")}
    _fill(out, notes, "global", ctx, lambda cid: server,
          "the server holds no model weights (no global model)", shared=True)
    _fill(out, notes, "upload", ctx, lambda cid: _upload_tensors(recorder, last, cid),
          "the server holds only masked uploads and their sum (secure aggregation)" if recorder.secure is not None
          else "the uploads carry no model weights")
    if spec.server_view:
        _update_losses(out, notes, ctx, recorder, last)
    out["_notes"] = notes
    return out


def _upload_tensors(recorder: Recorder, round: int, cid: int) -> dict:
    exchange = recorder.get(round, int(cid))
    return {} if exchange is None or exchange.upload is None else dict(exchange.upload.tensors)


def _fill(out: dict, notes: dict, kind: str, ctx: _SignalContext, tensors_of, absent: str,
          shared: bool = False) -> None:
    """``out[kind]``: each record under its owner's model of that kind (NaN rows where a client has none)."""
    logits = torch.full((len(ctx.spec.records), ctx.num_classes), float("nan"))
    found = 0
    probe = False
    for cid in ctx.clients:
        tensors = tensors_of(int(cid))
        result = ctx.logits_of(tensors, int(cid), shared)
        if result is not None:
            logits[torch.from_numpy(ctx.rows(cid))] = result
            found += 1
            probe = probe or not _groups(tensors)[1]
    if found == 0:
        notes[kind] = absent
        return
    out[kind] = logits
    if probe:
        notes[kind] = ("no classifier in it: a linear head was fitted on public records (the other clients' records "
                       "this run did not train on)")
    if found < len(ctx.clients):
        notes[kind] = notes.get(kind, "") + f" {len(ctx.clients) - found} client(s) had none (rows left NaN)"


def _update_losses(out: dict, notes: dict, ctx: _SignalContext, recorder: Recorder, round: int) -> None:
    """Every record's loss under each last-round download and upload that carries a full model."""
    down, up, clients = [], [], []
    for cid in ctx.clients:
        exchange = recorder.get(round, int(cid))
        if exchange is None or exchange.upload is None:
            continue
        pair = []
        for tensors in (exchange.download.tensors, exchange.upload.tensors):
            extractor, classifier = _groups(tensors)
            if not (extractor and classifier):
                break
            set_params(ctx.model, {**extractor, **classifier})
            pair.append(F.cross_entropy(_logits(ctx.model, ctx.images), ctx.labels, reduction="none"))
        if len(pair) == 2:
            down.append(pair[0])
            up.append(pair[1])
            clients.append(int(cid))
    if len(clients) < len(ctx.clients) or not clients:
        notes["update"] = ("the server's last-round download and upload do not both carry a full model (extractor and "
                           "classifier) for every client, so no per-record loss change exists")
        return
    out["loss_down"], out["loss_up"] = torch.stack(down), torch.stack(up)
    out["update_clients"] = torch.tensor(clients)
