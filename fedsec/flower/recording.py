"""``RecordingStrategy``: fedsec's server channel around any Flower Message-API strategy.

It wraps a ``flwr.serverapp.strategy.Strategy`` the way Flower's own DP wrappers do and changes nothing
it does. In each training round:

* ``configure_train``: the wrapped strategy builds its messages; each node's message is recorded as a
  ``fedecouple.channel.Download`` (its whole content as named tensors, as for replies below; its config
  values also in plain form in the metadata) and the messages go out unchanged;
* ``aggregate_train``: each reply is recorded as an ``Upload`` (``convert.content_to_tensors``: arrays
  under their own names, the weighting metric as ``sample_count``, other metrics and config values
  under ``metric.``/``config.``) after passing the interceptors (e.g. ``defenses.FilterChain``,
  which sees the node's download first and so acts on its update); the wrapped strategy aggregates the
  replies as the interceptors left them (a reply an interceptor drops never reaches it). Replies that
  carry an error are passed on unrecorded (their download stays without an upload) and listed in
  ``failures``.

Everything else (evaluation, ``summary``, attributes) is delegated unchanged. ``start`` is Flower's
``Strategy.start`` run on the wrapper, so every round passes through the two methods above.

Numbering, documented once here and in every message's metadata:

* client id: node ids are random 64-bit integers in Flower; a node's client id is its rank among the
  node ids the grid reported, in ascending order, as first seen (in simulation all nodes are known from
  the first round, so client ids are 0..N-1 in node-id order). ``client_ids`` holds the mapping.
  ``fedsec.flower.simulate`` renames them to the nodes' partition ids after the run (stable across runs);
* rounds: Flower's round r (from 1) is fedsec's round r − 1 (from 0, the round answered at the initial
  weights), so "round 0" means the same thing for both engines.

The recorder is the server's end of the channel: it stores each download as sent and each upload as
received, after all interceptors. Interceptors' ``on_download`` sees every download, but cannot change
or drop what Flower sends (a download interceptor that returns ``None`` is refused).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Iterator

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedecouple.channel import Download, Interceptor, Recorder, ServerChannel, Upload
from fedecouple.errors import UserError

from .convert import DEFAULT_WEIGHT_KEY, config_values, content_to_tensors, tensors_to_content


def check_message_api(strategy) -> None:
    """A one-line UserError unless ``strategy`` is a Message-API ``flwr.serverapp.strategy.Strategy``."""
    if isinstance(strategy, Strategy):
        return
    kind = type(strategy)
    legacy = kind.__module__.startswith("flwr.server.strategy") or any(
        base.__module__.startswith("flwr.server.strategy") for base in kind.__mro__)
    what = (f"a legacy Flower strategy ({kind.__module__}.{kind.__name__}: configure_fit/aggregate_fit)" if legacy
            else f"a {kind.__module__}.{kind.__name__}")
    raise UserError(f"the strategy is {what}, not a Message-API flwr.serverapp.strategy.Strategy; "
                    f"use a strategy from flwr.serverapp.strategy (e.g. FedAvg) or subclass it")


class ClientIds:
    """Flower node id → fedsec client id: ranks in ascending node-id order, as nodes are first seen."""

    def __init__(self) -> None:
        self.by_node: dict[int, int] = {}

    def see(self, node_ids: Iterable[int]) -> None:
        for node in sorted(int(n) for n in node_ids if int(n) not in self.by_node):
            self.by_node[node] = len(self.by_node)

    def __getitem__(self, node_id: int) -> int:
        node_id = int(node_id)
        if node_id not in self.by_node:
            self.see([node_id])
        return self.by_node[node_id]

    def nodes(self) -> dict[int, int]:
        """client id → node id."""
        return {cid: node for node, cid in self.by_node.items()}


class RecordingStrategy(Strategy):
    """Wraps ``strategy``; records each training round into ``recorder`` (module docstring).

    ``interceptors`` act on the replies before the wrapped strategy aggregates them, in order, as in
    ``fedecouple.channel.ServerChannel``; the recorder stores what comes out of the last one.
    """

    def __init__(self, strategy: Strategy, recorder: Recorder | None = None,
                 interceptors: Iterable[Interceptor] = ()) -> None:
        check_message_api(strategy)
        super().__init__()
        self.strategy = strategy
        self.recorder = recorder if recorder is not None else Recorder()
        self.channel = ServerChannel(interceptors, recorder=self.recorder)
        self.client_ids = ClientIds()
        # the metric Flower's FedAvg family weights by; recorded as ``sample_count``
        self.weight_key = str(getattr(strategy, "weighted_by_key", DEFAULT_WEIGHT_KEY))
        self.failures: list[dict] = []  # replies carrying an error: {"round", "client", "node_id", "reason"}

    def __getattr__(self, name: str):
        # attributes the wrapper does not have (e.g. fraction_train) read through to the wrapped strategy
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)

    # -- training: recorded --------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self.client_ids.see(grid.get_node_ids())
        for message in messages:
            node = int(message.metadata.dst_node_id)
            download = Download(int(server_round) - 1, self.client_ids[node], content_to_tensors(message.content, self.weight_key),
                                meta={"flower_round": int(server_round), "node_id": node,
                                      "config": config_values(message.content)})
            if self.channel.download(download) is None:
                raise ValueError("an interceptor dropped a download: under Flower, interceptors cannot change or "
                                 "drop what the strategy sends")
        return messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        passed = []
        changing = bool(self.channel.interceptors)
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            client = self.client_ids[node]
            if reply.has_error():
                self.failures.append({"round": int(server_round) - 1, "client": client, "node_id": node,
                                      "reason": str(reply.error.reason)})
                passed.append(reply)
                continue
            upload = Upload(int(server_round) - 1, client, content_to_tensors(reply.content, self.weight_key),
                            meta={"flower_round": int(server_round), "node_id": node,
                                  "reply_to_message_id": reply.metadata.reply_to_message_id})
            received = self.channel.upload(upload)
            if received is None:
                continue  # dropped by an interceptor: the strategy never sees it
            if changing:
                reply.content = tensors_to_content(reply.content, dict(received.tensors), self.weight_key)
            passed.append(reply)
        return self.strategy.aggregate_train(server_round, passed)

    # -- everything else: delegated unchanged ------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()


_ORIGINAL_START = Strategy.start


@contextmanager
def wrapping_started_strategies(wrap: Callable[[Strategy], RecordingStrategy]) -> Iterator[list[RecordingStrategy]]:
    """While active, ``Strategy.start`` (the round loop every Message-API strategy inherits) runs on
    ``wrap(strategy)`` instead of the strategy it is called on. This is how an unmodified app's
    ``strategy.start(grid=..., ...)`` gets recorded. Yields the list of wrappers made. A strategy class
    that overrides ``start`` itself is not reached (nothing gets recorded; callers check)."""
    made: list[RecordingStrategy] = []

    def start(self, *args, **kwargs):
        if isinstance(self, RecordingStrategy):
            return _ORIGINAL_START(self, *args, **kwargs)
        wrapper = wrap(self)
        made.append(wrapper)
        return _ORIGINAL_START(wrapper, *args, **kwargs)

    Strategy.start = start
    try:
        yield made
    finally:
        Strategy.start = _ORIGINAL_START
