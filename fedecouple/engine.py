"""The federation loop: sample clients, download through the channel, local updates (run by a
backend: in this process or as Ray tasks), uploads through the channel in client order,
aggregation, evaluation of every client's personalised model.

Randomness is derived from (seed, round, client), never from shared mutable generators, so a
round gives the same result whether it runs after a resume, in another process or in another
order. Per-client persistent state is only what the method keeps; one workspace model is reused
by every client update.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict, field
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .backends import Backend, ClientJob, ModelSpec, SequentialBackend, make_context
from .channel import Download, ServerChannel
from .data.dataset import ImageDataset
from .data.partition import Partition
from .devices import to_device
from .errors import UserError
from .methods.base import BatchRecord, ClientContext, Method, State, TrainConfig
from .methods.facets import SecureSummation, SecureTwoPass, secure_refusal
from .models import SplitModel, set_params


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and platforms."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


@dataclass
class FederationConfig:
    rounds: int = 3
    join_ratio: float = 1.0
    seed: int = 0
    arch: str | None = None
    model: str | None = None  # ``package.module:factory`` returning the user's SplitModel (wins over arch)
    device: str = "cpu"  # where models and client data live while computing (``fedecouple.devices``)
    train: TrainConfig = field(default_factory=TrainConfig)
    # each round, each client that got the download drops out before its upload with this probability
    # (seeded per round); its upload never arrives (under secure aggregation the protocol unmasks without it)
    dropout: float = 0.0

    def validate(self, num_clients: int) -> None:
        if self.rounds < 0:
            raise UserError(f"rounds must be >= 0, got {self.rounds}", fields=("rounds",))
        if not 0 < self.join_ratio <= 1:
            raise UserError(f"join_ratio must be in (0, 1], got {self.join_ratio}", fields=("join_ratio",))
        if self.train.local_epochs < 1:
            raise UserError(f"local_epochs must be >= 1, got {self.train.local_epochs}",
                            fields=("local_epochs",))
        if self.train.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.train.batch_size}", fields=("batch_size",))
        if not self.train.lr > 0:
            raise UserError(f"lr must be positive, got {self.train.lr}", fields=("lr",))
        if not 0 <= self.dropout < 1:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout}", fields=("dropout",))


class GroundTruth:
    """Harness-only record of what each client trained on, batch by batch (``BatchRecord``: the
    images and, when augmented, the augmentation's draws), and the values it kept to itself.

    Kept apart from the channel: attacks may use it only to score their reconstructions, and a
    forward-model check may replay the client's true local training with it.
    """

    def __init__(self, rounds=None):
        self.rounds = None if rounds is None else set(rounds)
        self.batches: dict[tuple[int, int], list[BatchRecord]] = {}
        self.private: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.local_data: dict[tuple[int, int], np.ndarray] = {}

    def record(self, round: int, client_id: int, batches: list[BatchRecord],
               private: dict[str, torch.Tensor] | None = None, local_data: np.ndarray | None = None) -> None:
        if self.rounds is None or round in self.rounds:
            self.batches[(round, client_id)] = list(batches)
            if local_data is not None:
                self.local_data[(round, client_id)] = np.asarray(local_data, dtype=np.int64).copy()
            self.private[(round, client_id)] = {k: v.detach().clone() for k, v in (private or {}).items()}

    def training_set(self, round: int, client_id: int) -> np.ndarray:
        """Pool indices of the client's whole local training set in that round (what its label
        distribution is measured on; a ragged last batch may leave a few out of ``samples``)."""
        if (round, client_id) in self.local_data:
            return self.local_data[(round, client_id)]
        return self.samples(round, client_id)

    def samples(self, round: int, client_id: int) -> np.ndarray:
        """Distinct pool indices the client trained on in that round, in first-use order."""
        seen: dict[int, None] = {}
        for record in self.batches.get((round, client_id), []):
            for i in record.indices.tolist():
                seen.setdefault(i, None)
        return np.asarray(list(seen), dtype=np.int64)

    def schedule(self, round: int, client_id: int) -> list[BatchRecord]:
        """The client's batches in that round, in the order it took its SGD steps."""
        return list(self.batches.get((round, client_id), []))

    def steps_per_phase(self, round: int, client_id: int) -> dict[str, int]:
        """How many SGD steps the client took in each phase of its local training in that round."""
        counts: dict[str, int] = {}
        for record in self.batches.get((round, client_id), []):
            counts[record.phase] = counts.get(record.phase, 0) + 1
        return counts


@dataclass
class VictimSetting:
    """The classic gradient-inversion setting for chosen (round, client) pairs: the client trains
    ``steps`` steps per phase on its first ``batch`` training images (seeded choice)."""

    batch: int
    steps: int
    targets: set[tuple[int, int]] = field(default_factory=set)


class Federation:
    def __init__(self, method: Method, dataset: ImageDataset, partition: Partition, config: FederationConfig,
                 channel: ServerChannel | None = None, ground_truth: GroundTruth | None = None,
                 victim: VictimSetting | None = None, backend: Backend | None = None):
        config.validate(partition.num_clients)
        self.method, self.dataset, self.partition, self.config = method, dataset, partition, config
        self.channel = channel if channel is not None else ServerChannel()
        self.ground_truth = ground_truth if ground_truth is not None else GroundTruth(rounds=())
        self.victim = victim
        self.backend: Backend = backend if backend is not None else SequentialBackend()
        if self.channel.secure is not None and (refusal := secure_refusal(method)):
            raise UserError(refusal)
        torch.manual_seed(derive_seed(config.seed, 0xC0DE))
        self.model_spec = ModelSpec.for_data(dataset, config.arch, config.model, config.device)
        self.model: SplitModel = self.model_spec.build()  # on the device; states and messages stay on the CPU
        self.initial_params = {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}
        self.server: State = to_device(method.init_server(self.model), "cpu")
        self.clients: dict[int, State] = {}
        self.completed_rounds = 0
        self.metrics: list[dict] = []
        # per round under secure aggregation or dropout: who took part, who dropped, clipped values
        self.round_log: list[dict] = []
        self._participants: list[int] = []

    # -- client plumbing -------------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return self.partition.num_clients

    def client_state(self, cid: int) -> State:
        if cid not in self.clients:
            set_params(self.model, self.initial_params)
            self.clients[cid] = to_device(self.method.init_client(self.model, cid), "cpu")
        return self.clients[cid]

    def _client_data(self, cid: int, round: int, split: str) -> tuple[np.ndarray, TrainConfig, int | None]:
        """Pool indices, training config and victim steps of one client's split in ``round``."""
        idx = (self.partition.train if split == "train" else self.partition.test)[cid]
        steps = None
        if split == "train" and self.victim is not None and (round, cid) in self.victim.targets:
            pick = np.random.default_rng(derive_seed(self.config.seed, round, cid, 7)).permutation(len(idx))
            idx = np.sort(idx[pick[: self.victim.batch]])
            steps = self.victim.steps
        train_cfg = self.config.train
        if steps is not None:
            train_cfg = TrainConfig(**{**asdict(train_cfg), "batch_size": len(idx)})
        return idx, train_cfg, steps

    def context(self, cid: int, round: int, split: str = "train") -> ClientContext:
        idx, train_cfg, steps = self._client_data(cid, round, split)
        t_idx, device = torch.from_numpy(idx), self.config.device
        return make_context(cid, round, self.dataset.images[t_idx].to(device), self.dataset.labels[t_idx].to(device),
                            idx, self.model, train_cfg, self.dataset.num_classes,
                            derive_seed(self.config.seed, round, cid, 1), steps)

    def client_job(self, cid: int, round: int, download: Download) -> ClientJob:
        """Everything client ``cid``'s update in ``round`` needs besides the method and the data set."""
        idx, train_cfg, steps = self._client_data(cid, round, "train")
        return ClientJob(cid, round, download, self.client_state(cid), idx, train_cfg,
                         generator_seed=derive_seed(self.config.seed, round, cid, 1),
                         torch_seed=derive_seed(self.config.seed, round, cid, 2), steps_per_phase=steps)

    def sample_clients(self, round: int) -> list[int]:
        n = self.num_clients
        k = max(1, int(round_half_up(self.config.join_ratio * n)))
        rng = np.random.default_rng(derive_seed(self.config.seed, round, 0x5A))
        return sorted(rng.choice(n, size=k, replace=False).tolist())

    # -- one round -------------------------------------------------------------------------
    def _round_jobs(self, t: int, communicates: bool) -> Iterator[ClientJob]:
        """Each sampled client's download through the channel (client order), as a job. Lazy, so a
        backend that runs one update at a time never holds every client's download at once; the
        channel still sees every download of the round before any upload."""
        self._participants = []
        for cid in self.sample_clients(t):
            if communicates:
                down = self.channel.download(Download(t, cid, self.method.download(self.server, cid, t)))
                if down is None:
                    continue  # dropped: the client sits this round out
                self._participants.append(cid)
            else:
                down = Download(t, cid, {})  # nothing is sent: the channel never sees this client
            yield self.client_job(cid, t, down)

    def dropouts(self, round: int, participants: list[int], pass_index: int = 0) -> set[int]:
        """The participants that drop out before uploading in ``round`` (seeded, ``config.dropout``); with
        ``pass_index`` > 0, before their upload of that later pass of a two-pass secure aggregation (a
        draw of its own: each masked upload may be lost)."""
        if not self.config.dropout:
            return set()
        parts = (self.config.seed, round, 0xD20) + ((pass_index,) if pass_index else ())
        draws = np.random.default_rng(derive_seed(*parts)).random(self.num_clients)
        return {c for c in participants if draws[c] < self.config.dropout}

    def run_round(self) -> list[dict]:
        """Downloads through the channel (client order) → the backend runs the updates → ground-truth
        hook → uploads through the channel (client order; a dropped-out client's never arrives) →
        aggregate (under secure aggregation: the channel's round stage, then the decoded sum) → evaluate."""
        t = self.completed_rounds
        communicates = self.method.communicates  # False: the channel never sees this method
        results = self.backend.run_updates(self.method, self.dataset, self.model_spec, self.model,
                                           self._round_jobs(t, communicates))
        uploads, dropped = [], None
        for i, result in enumerate(results):
            results[i] = None  # drop each result once handled (1,000 clients: one round's traffic, not two)
            cid = result.client_id
            self.clients[cid] = {k: v.detach().clone() for k, v in result.state.items()}
            self.ground_truth.record(t, cid, result.batch_log, result.private, result.indices)
            if dropped is None:  # the downloads are all out once the first result is back
                dropped = self.dropouts(t, self._participants)
            received = self.channel.upload(result.upload) if communicates and cid not in dropped else None
            if received is not None:
                uploads.append(received)
        if communicates and self.channel.secure is not None:
            self._aggregate_securely(t, uploads)
        elif uploads:
            self.server = self.method.aggregate(self.server, uploads, t)
        if communicates and self.config.dropout and self.channel.secure is None:
            self.round_log.append({"round": t, "participants": len(self._participants),
                                   "survivors": len(uploads), "clipped": 0, "aborted": ""})
        rows = self.evaluate(t)
        self.metrics.extend(rows)
        self.completed_rounds += 1
        return rows

    def _aggregate_securely(self, t: int, uploads: list) -> None:
        protocol, method = self.channel.secure, self.method
        if not isinstance(method, SecureSummation):  # (refused when the federation was built)
            raise UserError(secure_refusal(method))
        record = self.channel.aggregate_securely(
            t, self._participants, uploads,
            lambda u: method.secure_summands(u, protocol.max_weight, self.dataset.num_classes))
        entry = {"round": t, "participants": len(record.participants), "survivors": len(record.survivors),
                 "clipped": record.clipped, "aborted": record.aborted or ""}
        if protocol.private:  # the survivors whose values distributed DP's L2 clip shortened
            entry["dp_clipped"] = record.dp_clipped
        if record.aborted is None and isinstance(method, SecureTwoPass):
            entry.update(self._second_pass(t, uploads, record))
        elif record.aborted is None:
            self.server = method.secure_aggregate(self.server, record.total, t, protocol.max_weight)
        self.round_log.append(entry)

    def _second_pass(self, t: int, uploads: list, first) -> dict:
        """A two-pass method's second secure sum (``SecureTwoPass``: FedeCouple's eq. 16): the server sends
        the first sum's ``secure_broadcast`` to its survivors, those that stay send ``secure_second_summands``,
        and the method aggregates both sums. With fewer than ``secure_second_pass_minimum`` of them left, or
        a second sum the protocol cannot unmask, the round keeps the first pass's aggregate. Returns the
        round log's entries: the survivors whose uploads are in the model, the clipping of both passes,
        and ``second_pass`` ("" when it decoded, else why not)."""
        method, protocol = self.method, self.channel.secure
        broadcast = method.secure_broadcast(first.total, protocol.max_weight)
        leaving = self.dropouts(t, list(first.survivors), pass_index=1)
        staying = [u for u in uploads if u.client_id in first.survivors and u.client_id not in leaving]
        minimum = method.secure_second_pass_minimum
        second = None
        if len(staying) >= minimum:
            second = self.channel.aggregate_securely(
                t, list(first.survivors), staying,
                lambda u: method.secure_second_summands(u, broadcast, protocol.max_weight, self.dataset.num_classes),
                pass_index=1, broadcast=broadcast)
        if second is not None and second.aborted is None:
            self.server = method.secure_second_aggregate(self.server, first.total, second.total, t,
                                                         protocol.max_weight)
            return {"survivors": len(second.survivors), "clipped": first.clipped + second.clipped, "second_pass": "",
                    **({"dp_clipped": first.dp_clipped + second.dp_clipped} if protocol.private else {})}
        self.server = method.secure_aggregate(self.server, first.total, t, protocol.max_weight)
        why = (f"skipped: {len(staying)} of {len(first.survivors)} stayed, fewer than {minimum}"
               if second is None else f"aborted: {second.aborted}")
        return {"clipped": first.clipped + (second.clipped if second is not None else 0),
                "second_pass": why + "; the round kept the first pass's average"}

    @torch.no_grad()
    def _test(self, ctx: ClientContext) -> tuple[float, float]:
        if ctx.num_samples == 0:
            return float("nan"), float("nan")
        logits = self.model(ctx.images)
        return (float((logits.argmax(1) == ctx.labels).float().mean()), float(F.cross_entropy(logits, ctx.labels)))

    def evaluate(self, round: int) -> list[dict]:
        """Test accuracy and loss of every client's personalised model on its own test split."""
        rows = []
        for cid in range(self.num_clients):
            train_ctx = self.context(cid, round)
            torch.manual_seed(derive_seed(self.config.seed, round, cid, 3))
            device = self.config.device
            with torch.enable_grad():
                params = self.method.personalized(train_ctx, to_device(self.server, device),
                                                  to_device(self.client_state(cid), device))
            set_params(self.model, params)
            acc, loss = self._test(self.context(cid, round, "test"))
            rows.append({"round": round, "client": cid, "accuracy": acc, "loss": loss})
        return rows

    def close(self) -> None:
        """Release the backend (e.g. shut down the Ray it started)."""
        self.backend.close()

    def run(self, rounds: int | None = None, on_round: Callable[[int, list[dict]], None] | None = None) -> list[dict]:
        target = self.config.rounds if rounds is None else rounds
        while self.completed_rounds < target:
            rows = self.run_round()
            if on_round is not None:
                on_round(self.completed_rounds - 1, rows)
        return self.metrics

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"completed_rounds": self.completed_rounds, "server": self.server, "clients": self.clients,
                "metrics": self.metrics, "round_log": self.round_log}

    def load_state_dict(self, state: dict) -> None:
        self.completed_rounds = int(state["completed_rounds"])
        self.server = dict(state["server"])
        self.clients = {int(k): dict(v) for k, v in state["clients"].items()}
        self.metrics = list(state["metrics"])
        self.round_log = list(state.get("round_log", []))


def round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


def summarize(rows: list[dict], round: int | None = None) -> dict:
    """Mean and std over clients of the accuracy in ``round`` (default: the last one)."""
    if not rows:
        return {"mean_accuracy": float("nan"), "std_accuracy": float("nan")}
    last = max(r["round"] for r in rows) if round is None else round
    acc = np.array([r["accuracy"] for r in rows if r["round"] == last], dtype=float)
    acc = acc[~np.isnan(acc)]
    return {"round": last, "mean_accuracy": float(acc.mean()), "std_accuracy": float(acc.std())}
