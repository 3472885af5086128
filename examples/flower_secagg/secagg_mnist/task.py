"""secagg_mnist: the model, the data and the local update shared by the ServerApp and the ClientApp.

The same model, data and seeding as ``examples/flower_mnist`` (fedsec's engine seeds a federation the
same way), in the legacy form ``SecAggPlusWorkflow`` needs: parameters travel as an unnamed list of
NumPy arrays, in ``named_parameters()`` order (fedsec names them back in that order):

* initial model: ``torch.manual_seed(derive_seed(seed, 0xC0DE))``, then the architecture is built;
* data: the embedded mnist5k pool (no network), partitioned with ``fedecouple.data.make_partition``
  into one client per node; node ``partition-id`` p trains on ``partition.train[p]``;
* a node's update in Flower round r + 1 (fedsec's round r): mini-batch order from a
  ``torch.Generator`` seeded with ``derive_seed(seed, r, p, 1)``, ``torch.manual_seed(derive_seed(seed,
  r, p, 2))`` right before training, and in the victim setting its B images chosen by
  ``numpy.random.default_rng(derive_seed(seed, r, p, 7))``.

Mini-batches are drawn by index; a last batch smaller than the batch size is dropped each epoch.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from fedecouple.data import load_dataset, make_partition
from fedecouple.engine import derive_seed
from fedecouple.models import build_model as build_architecture
from fedsec.flower.groundtruth import log_batch, log_training_set

DATASET = "mnist5k"


@lru_cache(maxsize=1)
def load_pool():
    """The pooled data set every node's partition indexes into (embedded in fedsec, no network)."""
    return load_dataset(DATASET)


@lru_cache(maxsize=4)
def _partition(num_partitions: int, scheme: str, classes_per_client: int, seed: int):
    pool = load_pool()
    return make_partition(pool.labels.numpy(), num_partitions, scheme, num_classes=pool.num_classes,
                          classes_per_client=classes_per_client, seed=seed)


def load_partition(num_partitions: int, run_config):
    """The seeded label-skew partition of the pool into ``num_partitions`` clients."""
    return _partition(int(num_partitions), str(run_config["partition"]), int(run_config["classes-per-client"]),
                      int(run_config["seed"]))


def build_model(run_config) -> torch.nn.Module:
    """The paper's 28x28 CNN (``arch``: cnn28 or cnn28-same) at the federation's initial weights."""
    pool = load_pool()
    torch.manual_seed(derive_seed(int(run_config["seed"]), 0xC0DE))
    return build_architecture(str(run_config["arch"]), pool.channels, pool.image_size, pool.num_classes,
                              pool.mean, pool.std)


def get_weights(model: torch.nn.Module) -> list[np.ndarray]:
    """The trainable parameters as the legacy API carries them: a list in ``named_parameters()`` order."""
    return [p.detach().cpu().numpy().copy() for _, p in model.named_parameters()]


@torch.no_grad()
def set_weights(model: torch.nn.Module, weights) -> None:
    for (_, own), value in zip(model.named_parameters(), weights, strict=True):
        own.copy_(torch.as_tensor(np.asarray(value), dtype=own.dtype))


def victim_rounds(run_config) -> set[int]:
    return {int(r) for r in str(run_config["victim-rounds"]).replace(" ", "").split(",") if r}


def training_plan(partition_id: int, num_partitions: int, server_round: int, run_config):
    """Pool indices, batch size and step budget (None: ``local-epochs`` epochs) of one node's update."""
    indices = load_partition(num_partitions, run_config).train[partition_id]
    batch_size, steps = int(run_config["batch-size"]), None
    victim_batch = int(run_config["victim-batch"])
    if victim_batch > 0 and server_round in victim_rounds(run_config):
        seed = derive_seed(int(run_config["seed"]), server_round - 1, partition_id, 7)
        pick = np.random.default_rng(seed).permutation(len(indices))
        indices = np.sort(indices[pick[:victim_batch]])
        batch_size, steps = len(indices), int(run_config["victim-steps"])
    return indices, batch_size, steps


def batches(n: int, batch_size: int, epochs: int, generator: torch.Generator, steps: int | None = None):
    """Positions of each mini-batch: shuffled epochs, ragged last batch dropped; exactly ``steps``
    batches when given (as many epochs as that takes)."""
    if n == 0:
        return
    size = min(batch_size, n)
    if steps is not None:
        epochs = -(-steps // (n // size))
    emitted = 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, size):
            if steps is not None and emitted >= steps:
                return
            chosen = order[start:start + size]
            if len(chosen) < size:
                break
            emitted += 1
            yield chosen


def local_update(weights, partition_id: int, num_partitions: int, server_round: int, run_config):
    """One node's update in Flower round ``server_round`` from the global ``weights``: (its new
    weights, its number of training examples, its mean training loss)."""
    model = build_model(run_config)
    set_weights(model, weights)
    indices, batch_size, steps = training_plan(partition_id, num_partitions, server_round, run_config)
    seed = int(run_config["seed"])
    generator = torch.Generator().manual_seed(derive_seed(seed, server_round - 1, partition_id, 1))
    torch.manual_seed(derive_seed(seed, server_round - 1, partition_id, 2))
    pool = load_pool()
    index = torch.from_numpy(indices)
    images, labels = pool.images[index], pool.labels[index]
    log_training_set(indices)  # fedsec's ground-truth hook, as log_batch below: no-ops outside an audit
    optimizer = torch.optim.SGD(model.parameters(), lr=float(run_config["lr"]))
    total, count = 0.0, 0
    for chosen in batches(len(labels), batch_size, int(run_config["local-epochs"]), generator, steps):
        log_batch(indices[chosen.numpy()])
        loss = F.cross_entropy(model(images[chosen]), labels[chosen])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += float(loss.detach())
        count += 1
    return get_weights(model), len(indices), total / max(count, 1)


def fedsec_declaration(run_config) -> dict:
    """What a fedsec audit needs to know about this app for a given run config (see fedsec's docs/flower.md,
    "What the audit needs from you"); ``[tool.fedsec] declaration`` in pyproject.toml points here."""
    return {
        "model": lambda: build_model(run_config),
        "dataset": load_pool(),
        "method": "fedavg",  # Flower's FedAvg over SecAgg+'s weighted sum follows fedsec's fedavg protocol
        "lr": float(run_config["lr"]),
        "local-epochs": int(run_config["local-epochs"]),
        "batch-size": int(run_config["batch-size"]),
    }
