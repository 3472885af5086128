"""flower_mnist: the ServerApp, with Flower's FedAvg or a FedPer-style strategy (run config ``strategy``)."""
from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flower_mnist import task


class FedPer(FedAvg):
    """FedPer (Arivazhagan et al., 2019) on Flower's FedAvg: only the shared base (parameters whose name
    starts with one of ``shared_prefixes``) is sent and sample-weight averaged; each node keeps its head."""

    def __init__(self, shared_prefixes: tuple[str, ...] = ("extractor.",), **kwargs) -> None:
        super().__init__(**kwargs)
        self.shared_prefixes = tuple(shared_prefixes)

    def shared(self, arrays: ArrayRecord) -> ArrayRecord:
        return ArrayRecord({name: arrays[name] for name in arrays if name.startswith(self.shared_prefixes)})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return super().configure_train(server_round, self.shared(arrays), config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return super().configure_evaluate(server_round, self.shared(arrays), config, grid)


STRATEGIES = {"fedavg": FedAvg, "fedper": FedPer}

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    name = str(config["strategy"])
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    strategy = STRATEGIES[name](fraction_train=float(config["fraction-train"]),
                                fraction_evaluate=float(config["fraction-evaluate"]))
    model = task.build_model(config)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(task.parameters(model)),
                   num_rounds=int(config["num-server-rounds"]))
