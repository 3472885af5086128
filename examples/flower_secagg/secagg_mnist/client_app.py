"""secagg_mnist: the ClientApp. A legacy NumPyClient behind Flower's ``secaggplus_mod``: the mod runs
the SecAgg+ key agreement, and in the masking stage takes the client's FitRes, masks
``[num_examples / max_weight, that weight * parameters]`` and replaces the parameters with the masked
vector; ``num_examples`` and the FitRes metrics leave the node unmasked."""
from __future__ import annotations

import numpy as np
from flwr.app import Context
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from fedecouple.engine import derive_seed

from secagg_mnist import task


class SecAggClient(NumPyClient):
    def __init__(self, partition_id: int, num_partitions: int, run_config) -> None:
        self.partition_id, self.num_partitions, self.run_config = partition_id, num_partitions, dict(run_config)

    def fit(self, parameters, config):
        server_round = int(config["server-round"])
        weights, count, loss = task.local_update(parameters, self.partition_id, self.num_partitions, server_round,
                                                 self.run_config)
        # secaggplus_mod quantises with stochastic rounding from numpy's global generator once fit returns:
        # seeding it per (round, node) makes the unmasked aggregate repeat bit for bit
        seed = derive_seed(int(self.run_config["seed"]), server_round - 1, self.partition_id, 3)
        np.random.seed(seed % 2 ** 32)
        return weights, count, {"train_loss": loss}


def client_fn(context: Context):
    return SecAggClient(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]),
                        context.run_config).to_client()


app = ClientApp(client_fn=client_fn, mods=[secaggplus_mod])
