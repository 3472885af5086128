"""Flower's own SecAgg+ recorded: what the server of a ``SecAggPlusWorkflow`` app receives, in the form
fedsec's engine records under ``--secure-aggregation``.

Flower runs SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead") as ``flwr.server.workflow.SecAggPlusWorkflow`` on the server and ``secaggplus_mod`` on the
clients, inside the legacy ``DefaultWorkflow`` with a legacy strategy (``flwr.server.strategy``). Each
round is four request/reply stages on the ``Grid``: setup (public keys back), share keys (encrypted
key shares back), collect masked vectors (the FitIns out, the masked vector and the FitRes' unmasked
fields back) and unmask (secret shares back); the workflow then hands the legacy strategy's
``aggregate_fit`` one FitRes per surviving node whose parameters all are the unmasked weighted average.

The recording point (``SecAggRecording``) wraps the ``Grid`` the workflow talks to (``RecordingGrid``:
it sees every message that server sends and receives) and taps the strategy's ``aggregate_fit``; while
``recording_secagg_workflows`` is active, every ``SecAggPlusWorkflow`` (and subclass, e.g.
``SecAggWorkflow``) runs with them, so an unmodified app is recorded. Per round (Flower round r is
fedsec round r - 1; client ids as ``fedsec.flower.recording`` documents them):

* ``recorder.secure``: a ``fedecouple.secure_aggregation.SecureAggregation`` with the protocol values
  the first setup stage sends, in the workflow's own terms: clipping range, quantisation range, modulus,
  max weight, ``num_shares`` (the share count the workflow derived, or 1.0 when it covers every node:
  every pair masks) and ``reconstruction_threshold`` (the share threshold t, an integer), so that the
  engine applies the same neighbourhoods and abort rule (``fedecouple.secure_aggregation.halted``);
  ``clear_fields`` is ``"flower"``; its ``seed`` is 0 and unused: Flower's masks come from real key
  agreement;
* each node's download: the FitIns the masking stage carries, its unnamed legacy arrays named after
  the declared model's ``named_parameters()`` in order (``array.<i>`` when they do not match in number),
  its config values as ``config.<key>``;
* each node's upload as ``Upload(round, client, {"masked": int64 vector, ...}, {"secure_aggregation":
  True, ...})``: the masked vector is Flower's ``[weight factor, parameters...]`` flattened in that
  order (the record's ``layout``), uniform modulo the modulus; beside it what SecAgg+ leaves in the
  clear: ``sample_count`` (FitRes ``num_examples``) and every FitRes metric as ``metric.<key>``;
* ``recorder.aggregates[round]``: an ``AggregateRecord`` whose ``participants`` are the nodes sent the
  setup stage, ``survivors`` those whose masked vector arrived (the unmasked sum is over them),
  ``dropped`` the others; ``clear`` each survivor's unmasked fields (as its upload carries them). Its
  ``total`` is in the engine's form, a SUM: ``total[name] = Σ w_i θ_i`` and
  ``total["sample_count"] = Σ w_i`` over the survivors, with Flower's weights
  ``w_i = round(num_examples_i / max_weight · quantization_range) / quantization_range`` (the engine's
  ``n_i / max_weight``, quantised). What the strategy receives, the weighted average, is
  ``total[name] / total["sample_count"]``: the record is that average (as ``aggregate_fit`` got it)
  times ``Σ w_i``, which the server decodes as the sum's first entry and which equals the same sum of
  the nodes' unmasked ``num_examples`` (the recording computes it from those). Each value of the
  sum is within ``len(survivors) · quantum`` of the true one, with ``quantum`` (``flower_quantum``) the
  rounding step ``2 · clipping_range / quantization_range`` plus ``clipping_range · 2**-22``: Flower's
  clients quantise float32 parameters (a PyTorch model's) in float32 arithmetic, whose rounding near
  the clipping range is that large, so a quantisation range beyond about 2**23 buys no precision; the
  masked vector does not tell the server the dtype, so the bound always allows for it. ``clipped`` is
  0 because Flower's clients do not report clipping (values beyond the clipping range are clipped
  silently); ``aborted`` says which stage halted a round that never reached the strategy.

What is not recorded: the public keys, encrypted shares and secret shares of the other stages (key
material, not client data).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import bytes_to_ndarray, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from fedecouple.channel import Download, Recorder, Upload
from fedecouple.errors import UserError
from fedecouple.secure_aggregation import AggregateRecord, Layout, SecureAggregation

from ..invocation import Request
from .convert import CONFIG_PREFIX, METRIC_PREFIX, SAMPLE_COUNT, content_to_tensors
from .recording import ClientIds

WEIGHT_FACTOR = SAMPLE_COUNT  # the masked vector's first entry: Flower's quantised weight, num_examples / max_weight


def protocol_of(setup: dict) -> SecureAggregation:
    """The ``SecureAggregation`` of a SecAgg+ setup stage's config (``Key`` names): the share count and
    threshold as the workflow sent them (the share count 1.0 where it covers every node, and as its
    fraction of the nodes where a threshold of as many shares, which the workflow accepts from a fractional
    ``num_shares``, would fail the check that integer settings get)."""
    samples, shares = int(setup[Key.SAMPLE_NUMBER]), int(setup[Key.SHARE_NUMBER])
    threshold = int(setup[Key.THRESHOLD])
    num_shares = 1.0 if shares >= samples else shares if threshold < shares else shares / samples
    return SecureAggregation(clipping_range=float(setup[Key.CLIPPING_RANGE]),
                             quantization_range=int(setup[Key.TARGET_RANGE]), modulus=int(setup[Key.MOD_RANGE]),
                             num_shares=num_shares,
                             reconstruction_threshold=threshold,
                             max_weight=float(setup[Key.MAX_WEIGHT]), clear_fields="flower")


def flower_weight(num_examples: int, protocol: SecureAggregation) -> int:
    """A node's weight as its ``secaggplus_mod`` quantises it: round(num_examples / max_weight · range)."""
    return round(num_examples / protocol.max_weight * protocol.quantization_range)


def flower_quantum(protocol: SecureAggregation) -> float:
    """A bound on one node's error per summed value: the stochastic rounding's step, plus the float32
    rounding of ``(value + c) · range / 2c`` for float32 parameters (at most half an ulp of ``2c`` in the
    sum, half an ulp of the range in the product, and half an ulp of the weighted value: ``c · 2**-22``
    together)."""
    return 2.0 * protocol.clipping_range / protocol.quantization_range + protocol.clipping_range * 2.0 ** -22


def _stage(message: Message) -> str | None:
    configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if configs is None or Key.STAGE not in configs else str(configs[Key.STAGE])


def masked_vector(reply: Message) -> np.ndarray:
    """A masking-stage reply's masked vector, its arrays flattened in order, as int64."""
    arrays = [bytes_to_ndarray(b) for b in reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
    return np.concatenate([np.asarray(a).reshape(-1).astype(np.int64) for a in arrays])


def config_tensors(values: dict, prefix: str) -> dict[str, torch.Tensor]:
    """Legacy config or metric values (any Flower scalar) as named tensors, as ``convert`` records them."""
    tensors = content_to_tensors(RecordDict({"values": ConfigRecord(dict(values))}))
    return {prefix + name[len(CONFIG_PREFIX):]: tensor for name, tensor in tensors.items()}


def clear_fields(reply: Message) -> dict[str, torch.Tensor]:
    """What a masking-stage reply carries unmasked: the FitRes' ``num_examples`` and metrics."""
    content = reply.content
    count = int(content.metric_records["fitres.num_examples"]["num_examples"])
    return {SAMPLE_COUNT: torch.tensor(count), **config_tensors(content.config_records.get("fitres.metrics", {}),
                                                                  METRIC_PREFIX)}


class SecAggRecording:
    """One SecAgg+ federation recorded into ``recorder`` (module docstring); ``names``: the declared
    model's parameter names in ``named_parameters()`` order, for the legacy unnamed arrays."""

    def __init__(self, recorder: Recorder, names: Iterable[str] | None = None) -> None:
        self.recorder = recorder
        self.names = None if names is None else list(names)
        self.client_ids = ClientIds()
        self.failures: list[dict] = []  # replies carrying an error: {"round", "client", "node_id", "reason"}
        self.round: int | None = None
        self.participants: list[int] = []  # node ids of this round, as the stages reach them
        self.survivors: list[int] = []
        self.clear: dict[int, dict[str, float]] = {}  # node id -> what its masking-stage reply carried unmasked
        self.halted: str | None = None  # the last stage that was sent this round

    # -- the round, as the workflow runs it ----------------------------------------------------
    def begin(self, flower_round: int, node_ids: Iterable[int]) -> None:
        self.round, self.participants, self.survivors, self.halted = int(flower_round) - 1, [], [], None
        self.clear = {}
        self.client_ids.see(node_ids)

    def end(self) -> None:
        """After the workflow's round: a round that never reached the strategy is recorded as aborted."""
        if self.round is None or self.round in self.recorder.aggregates:
            return
        cids, survivors = self._cids(self.participants), self._cids(self.survivors)
        why = f"SecAgg+ halted in its {self.halted or 'setup'} stage: the server unmasked nothing"
        quantum = 0.0 if self.recorder.secure is None else flower_quantum(self.recorder.secure)
        self.recorder.on_aggregate(AggregateRecord(self.round, cids, survivors,
                                                   tuple(c for c in cids if c not in survivors), {}, quantum, 0, why,
                                                   clear=self._clear(self.survivors)))

    def sent(self, messages: list[Message]) -> str | None:
        """Record the requests of one stage; returns the stage (None: not a SecAgg+ stage)."""
        stages = {_stage(m) for m in messages}
        if len(stages) != 1 or None in stages:
            return None  # not a SecAgg+ stage: nothing of the protocol to record
        stage = stages.pop()
        self.halted = stage
        if stage == Stage.SETUP:
            configs = messages[0].content.config_records[RECORD_KEY_CONFIGS]
            if self.recorder.secure is None:
                self.recorder.secure = protocol_of(dict(configs))
            self.participants = sorted(int(m.metadata.dst_node_id) for m in messages)
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            for message in messages:
                self._download(message)
        return stage

    def received(self, stage: str | None, replies: list[Message]) -> None:
        """Record the replies to one stage's requests."""
        for reply in replies:
            if reply.has_error():
                node = int(reply.metadata.src_node_id)
                self.failures.append({"round": self.round, "client": self.client_ids[node], "node_id": node,
                                      "reason": f"SecAgg+ {stage} stage: {reply.error.reason}"})
        if stage == Stage.COLLECT_MASKED_VECTORS:
            for reply in replies:
                if not reply.has_error():
                    self._upload(reply)

    def aggregated(self, flower_round: int, results) -> None:
        """The strategy's ``aggregate_fit`` input: the unmasked weighted average in every FitRes."""
        protocol = self._protocol()
        arrays = parameters_to_ndarrays(results[0][1].parameters) if results else []
        weight = sum(flower_weight(int(fitres.num_examples), protocol) for _, fitres in results)
        weight /= protocol.quantization_range
        names = self._names(len(arrays))
        total = {name: torch.from_numpy(np.asarray(a, dtype=np.float64)) * weight for name, a in zip(names, arrays)}
        total[SAMPLE_COUNT] = torch.tensor(weight, dtype=torch.float64)
        layout = Layout(((WEIGHT_FACTOR, (1,)),) + tuple((n, tuple(np.shape(a))) for n, a in zip(names, arrays)))
        cids = self._cids(self.participants)
        nodes = [int(proxy.node_id) for proxy, _ in results]
        survivors = self._cids(nodes)
        self.recorder.on_aggregate(AggregateRecord(int(flower_round) - 1, cids, survivors,
                                                   tuple(c for c in cids if c not in survivors), total,
                                                   flower_quantum(protocol), 0, None, layout,
                                                   self._clear(nodes)))

    # -- ids, names and messages ---------------------------------------------------------------
    def _protocol(self) -> SecureAggregation:
        if self.recorder.secure is None:
            raise RuntimeError("SecAgg+ reached a later stage without a recorded setup stage")
        return self.recorder.secure

    def _cids(self, node_ids: Iterable[int]) -> tuple[int, ...]:
        return tuple(sorted(self.client_ids[int(n)] for n in node_ids))

    def _clear(self, node_ids: Iterable[int]) -> dict[int, dict[str, float]]:
        """{client: its unmasked fields} of the nodes whose masking-stage reply arrived."""
        return {self.client_ids[int(n)]: dict(self.clear[int(n)]) for n in node_ids if int(n) in self.clear}

    def _names(self, count: int) -> list[str]:
        if self.names is not None and len(self.names) == count:
            return list(self.names)
        return [f"array.{i}" for i in range(count)]

    def _download(self, message: Message) -> None:
        node = int(message.metadata.dst_node_id)
        fitins = compat.recorddict_to_fitins(message.content, keep_input=True)
        arrays = parameters_to_ndarrays(fitins.parameters)
        tensors = {name: torch.from_numpy(np.array(a, copy=True)) for name, a in zip(self._names(len(arrays)), arrays)}
        tensors.update(config_tensors(fitins.config, CONFIG_PREFIX))
        self.recorder.on_download(Download(self.round, self.client_ids[node], tensors, meta={
            "flower_round": self.round + 1, "node_id": node, "config": dict(fitins.config),
            "secure_aggregation": True}))

    def _upload(self, reply: Message) -> None:
        node = int(reply.metadata.src_node_id)
        self.survivors.append(node)
        unmasked = clear_fields(reply)
        self.clear[node] = {name: (int(t) if name == SAMPLE_COUNT else float(t)) for name, t in unmasked.items()}
        tensors = {"masked": torch.from_numpy(masked_vector(reply)), **unmasked}
        self.recorder.on_upload(Upload(self.round, self.client_ids[node], tensors, meta={
            "secure_aggregation": True, "flower_round": self.round + 1, "node_id": node,
            "reply_to_message_id": reply.metadata.reply_to_message_id}))


class RecordingGrid:
    """The ``Grid`` a ``SecAggPlusWorkflow`` round talks to, with every request and reply shown to the
    recording; everything else is the wrapped grid's."""

    def __init__(self, grid, recording: SecAggRecording) -> None:
        self.grid, self.recording = grid, recording

    def __getattr__(self, name: str):
        if name == "grid":
            raise AttributeError(name)
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        # the stage is read before sending: in-process, the client's mod pops it from the same record
        stage = self.recording.sent(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.recording.received(stage, replies)
        return replies


class _AggregateTap:
    """The legacy strategy, with ``aggregate_fit`` shown to the recording first; all else delegated."""

    def __init__(self, strategy, recording: SecAggRecording) -> None:
        self.strategy, self.recording = strategy, recording

    def __getattr__(self, name: str):
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    def aggregate_fit(self, server_round, results, failures):
        self.recording.aggregated(server_round, results)
        return self.strategy.aggregate_fit(server_round, results, failures)


_ORIGINAL_CALL = SecAggPlusWorkflow.__call__


@contextmanager
def recording_secagg_workflows(make: Callable[[], SecAggRecording]) -> Iterator[list[SecAggRecording]]:
    """While active, every ``SecAggPlusWorkflow`` round runs on a ``RecordingGrid`` with its strategy's
    ``aggregate_fit`` tapped, recording into ``make()`` (one recording per workflow object, i.e. per
    federation). Yields the list of recordings made."""
    made: dict[int, SecAggRecording] = {}
    recordings: list[SecAggRecording] = []

    def call(self, grid, context) -> None:
        if id(self) not in made:
            made[id(self)] = make()
            recordings.append(made[id(self)])
        recording = made[id(self)]
        flower_round = int(context.state.config_records[MAIN_CONFIGS_RECORD][WorkflowKey.CURRENT_ROUND])
        recording.begin(flower_round, grid.get_node_ids())
        strategy = context.strategy
        context.strategy = _AggregateTap(strategy, recording)
        try:
            _ORIGINAL_CALL(self, RecordingGrid(grid, recording), context)
        finally:
            context.strategy = strategy
        recording.end()

    SecAggPlusWorkflow.__call__ = call
    try:
        yield recordings
    finally:
        SecAggPlusWorkflow.__call__ = _ORIGINAL_CALL


def check_secure_traffic(recorder: Recorder, parameter_count: int) -> None:
    """A one-line UserError where the legacy arrays could not be named after the declared model (their
    number differs), or a masked vector is not one weight factor plus every parameter value."""
    names = [n for (_, _), ex in sorted(recorder.exchanges.items()) if ex.download is not None
             for n in ex.download.tensors if n.startswith("array.")]
    if names:
        count = len({n for n in names})
        raise UserError(f"the app sends {count} unnamed arrays, the declared model has {parameter_count} parameters; "
                        f"fedsec names a legacy app's arrays in named_parameters() order: send every parameter of "
                        f"the declared model, in that order")
    for (round, client), exchange in sorted(recorder.exchanges.items()):
        if exchange.upload is None or exchange.download is None:
            continue
        values = sum(math.prod(t.shape) for n, t in exchange.download.tensors.items() if not n.startswith("config."))
        size = int(exchange.upload.tensors["masked"].numel())
        if size != values + 1:
            raise UserError(f"client {client}'s masked vector in round {round} holds {size} values, not its download's "
                            f"{values} plus the weight factor: the app must return the parameters it was sent")


# ------------------------------------------------------------------------------------------------
# ``fedsec flower audit`` of a SecAgg+ app: what its server held, what it still reads

SECURE_MODS = ("secaggplus_mod", "secagg_mod")  # Flower's client mods for SecAgg+ and SecAgg
CLEAR = "clear"  # the audit's kind of a field a masked upload carries unmasked


def is_secure_app(app_dir) -> bool:
    """Whether the app's ClientApp runs behind one of Flower's secure-aggregation mods (its server must
    then run ``SecAggPlusWorkflow``, or ``SecAggWorkflow``, for the clients to answer at all)."""
    from flwr.client import mod

    from .app import read_app

    client = read_app(app_dir).load("clientapp")
    secure = [getattr(mod, name) for name in SECURE_MODS]
    return any(m in secure for m in getattr(client, "_mods", ()))


def uniformity(recorder: Recorder, bins: int = 64) -> list[float]:
    """Each masked upload's chi-square p-value against the uniform distribution over the modulus
    (``bins`` equal bins): what a server that holds one masked vector can tell from it."""
    from scipy.stats import chisquare

    modulus = recorder.secure.modulus
    values = []
    for upload in recorder.uploads():
        masked = upload.tensors["masked"].numpy()
        observed = np.bincount((masked.astype(np.float64) * bins // modulus).astype(np.int64), minlength=bins)
        values.append(float(chisquare(observed[:bins]).pvalue))
    return values


def secure_findings(recorder: Recorder) -> list[dict]:
    """What the server held (each round's sum) and what SecAgg+ leaves in the clear, measured."""
    records = [recorder.aggregates[r] for r in sorted(recorder.aggregates)]
    aborted = [r.round for r in records if r.aborted]
    p_values = uniformity(recorder)
    uploads = list(recorder.uploads())
    clear = sorted({n for up in uploads for n in up.tensors if n != "masked"})
    counts = {str(r): {str(up.client_id): int(up.tensors[SAMPLE_COUNT]) for up in uploads if up.round == r}
              for r in sorted({up.round for up in uploads}) if all(SAMPLE_COUNT in up.tensors for up in uploads)}
    out = [{"severity": "info", "code": "SECURE_AGGREGATION",
            "finding": f"Flower's SecAgg+: the server received each node's parameters only as a masked integer vector "
                       f"(uniform over the modulus: smallest chi-square p-value {min(p_values, default=1.0):.2g} over "
                       f"{len(p_values)} uploads) and decoded each round's sum of the surviving nodes alone, in "
                       f"{len(records) - len(aborted)} of {len(records)} round(s)"
                       + (f" (round(s) {', '.join(map(str, aborted))} aborted)" if aborted else "") + ".",
            "evidence": {"rounds": [r.round for r in records], "aborted_rounds": aborted,
                         "survivors": [len(r.survivors) for r in records], "dropped": [len(r.dropped) for r in records],
                         "uniformity_min_p": min(p_values, default=None), "protocol": recorder.secure.describe()}}]
    if clear:
        out.append({"severity": "medium", "code": "FIELDS_IN_THE_CLEAR",
                    "finding": f"SecAgg+ masks only the parameters: {', '.join(clear)} reach the server unmasked, one "
                               f"node at a time (sample_count is the node's FitRes num_examples, its training-set "
                               f"size; metric.* its FitRes metrics).",
                    "evidence": {"fields": clear, "sample_counts": counts}})
    return out


def protocol_line(protocol: SecureAggregation, nodes: int, clear: list[str]) -> str:
    """What the server of a SecAgg+ app held, with the protocol's values and the fields in the clear."""
    shares, threshold = protocol.shares(nodes)
    graph = "every other node" if shares >= nodes else f"{shares - 1} neighbours"
    beside = f"; in the clear beside it: {', '.join(clear)}" if clear else "; nothing in the clear"
    return (f"Flower SecAgg+ (masks with {graph} of {nodes}, unmasking needs {threshold} surviving share-holders "
            f"in every node's neighbourhood; clipping ±{protocol.clipping_range:g}, {protocol.quantization_range} "
            f"quantisation steps, modulus {protocol.modulus}, max weight {protocol.max_weight:g}): the server held "
            f"only each round's sum of the parameters, never one node's{beside}")


def refusal(app_dir, attack: str) -> str | None:
    """Why ``fedsec flower attack ATTACK`` does not run on an app under Flower's SecAgg+ (one line), or
    None for a round-level attack, which runs on the recorded sums."""
    import attacks

    spec = attacks.get(attack)
    if spec.round_level:
        return None  # runs on the sums (``fedsec.flower.harness.attack_secure_app``)
    return (f"{attack} attacks one node's upload, but {app_dir} runs Flower's SecAgg+: its server holds only each "
            f"round's sum (every upload is a masked vector); audit what it holds with fedsec flower audit {app_dir}")


def check_attack_command(request: Request) -> None:
    """``fedsec flower attack`` refuses a per-client attack on an app under Flower's SecAgg+, and a round-level
    attack on an app without it, with one line; otherwise, or for a folder that is no app, it does nothing (the
    command's own checks speak)."""
    p = request.params
    legacy = p.get("attack_option") is not None and p.get("app_dir") is None  # APP_DIR --attack ATTACK
    app_dir, attack = (p["attack"], p["attack_option"]) if legacy else (p.get("app_dir"), p.get("attack"))
    if app_dir is None or attack is None or not (Path(app_dir) / "pyproject.toml").is_file():
        return
    try:
        secure = is_secure_app(app_dir)
        import attacks

        attacks.get(attack)
    except (UserError, KeyError):
        return
    if secure and (reason := refusal(app_dir, attack)) is not None:
        raise UserError(reason)
    if not secure and attacks.get(attack).round_level:
        raise UserError(f"{attack} attacks the sum a secure-aggregation server holds, but {app_dir}'s ClientApp runs "
                        f"no secure-aggregation mod (secaggplus_mod); its server sees each upload: run a per-client "
                        f"attack, e.g. fedsec flower attack ig {app_dir}")
