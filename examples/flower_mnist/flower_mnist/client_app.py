"""flower_mnist: the ClientApp. Each node trains on its own partition of the embedded mnist5k pool.

With the FedPer-style strategy the server sends only the shared base; the node keeps its own head
(classifier) in its ``Context.state``, which never leaves the node, and replies with the base only.
"""
from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedecouple.engine import derive_seed

from flower_mnist import task

HEAD = "fedper-head"  # Context.state key of the node's own head (FedPer-style strategy)

app = ClientApp()


def _model_for(msg: Message, context: Context) -> tuple[torch.nn.Module, list[str]]:
    """The architecture with what the server sent loaded, and the node's own head where it keeps one;
    also the names the server sent (the parameters the node shares)."""
    model = task.build_model(context.run_config)  # the common initial model: the initial head, too
    received = msg.content["arrays"].to_torch_state_dict()
    if HEAD in context.state:
        task.load_parameters(model, context.state[HEAD].to_torch_state_dict())
    task.load_parameters(model, received)
    return model, list(received)


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = context.run_config
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    server_round = int(msg.content["config"]["server-round"])
    seed = int(config["seed"])
    model, shared = _model_for(msg, context)
    indices, batch_size, steps = task.training_plan(partition_id, num_partitions, server_round, config)
    generator = torch.Generator().manual_seed(derive_seed(seed, server_round - 1, partition_id, 1))
    torch.manual_seed(derive_seed(seed, server_round - 1, partition_id, 2))
    loss = task.train(model, indices, float(config["lr"]), int(config["local-epochs"]), batch_size, generator, steps)
    params = task.parameters(model)
    kept = {name: value for name, value in params.items() if name not in shared}
    if config["strategy"] == "fedper":
        context.state[HEAD] = ArrayRecord(kept)
    reply = RecordDict({"arrays": ArrayRecord({name: params[name] for name in shared}),
                        "metrics": MetricRecord({"train_loss": loss, "num-examples": len(indices)})})
    return Message(content=reply, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The node's personalised model (global base + own head, or the global model) on its test split."""
    partition_id = int(context.node_config["partition-id"])
    partition = task.load_partition(int(context.node_config["num-partitions"]), context.run_config)
    model, _ = _model_for(msg, context)
    loss, accuracy = task.evaluate(model, partition.test[partition_id])
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(partition.test[partition_id])})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
