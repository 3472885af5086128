"""secagg_mnist: the ServerApp. Flower's legacy FedAvg run by ``DefaultWorkflow`` with
``SecAggPlusWorkflow`` as its fit workflow: the strategy receives only the unmasked weighted average."""
from __future__ import annotations

from flwr.app import Context
from flwr.common import ndarrays_to_parameters
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid, ServerApp

from secagg_mnist import task


def weighted_loss(metrics):
    """The sample-weighted mean of the nodes' training losses (every node reports it unmasked)."""
    total = sum(count for count, _ in metrics)
    return {"train_loss": sum(count * m["train_loss"] for count, m in metrics) / max(total, 1)}


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=2, min_available_clients=2,
                      initial_parameters=ndarrays_to_parameters(task.get_weights(task.build_model(config))),
                      on_fit_config_fn=lambda server_round: {"server-round": server_round},
                      fit_metrics_aggregation_fn=weighted_loss)
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=int(config["num-server-rounds"])),
                           strategy=strategy)
    secagg = SecAggPlusWorkflow(num_shares=config["num-shares"],
                                reconstruction_threshold=config["reconstruction-threshold"],
                                max_weight=float(config["max-weight"]), clipping_range=float(config["clipping-range"]),
                                quantization_range=int(config["quantization-range"]))
    DefaultWorkflow(fit_workflow=secagg)(grid, legacy)
