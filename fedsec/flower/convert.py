"""Flower message content ↔ fedsec's named tensors.

A fedsec channel message holds ``dict[str, torch.Tensor]``. A Flower message's content is a
``RecordDict`` of ``ArrayRecord``s, ``MetricRecord``s and ``ConfigRecord``s. What leaves a node is all
of it, so all of it is recorded, under these names:

* every array of every ``ArrayRecord``: under its own key (our parameter names, e.g.
  ``extractor.conv1.weight``: a Flower app that sends a PyTorch model's parameters uses exactly those);
  two ArrayRecords carrying the same key are refused (the recording would be ambiguous);
* the strategy's weighting metric (Flower's ``weighted_by_key``, ``num-examples`` by default):
  ``sample_count`` (int64 scalar), the name fedsec's methods give the training-set size;
* every other metric ``k``: ``metric.k`` (int64 or float64; lists as 1-D tensors);
* every config value ``k``: ``config.k`` (numbers as above, ``str`` as its UTF-8 bytes and ``bytes``
  as uint8 tensors).

``tensors_to_content`` writes tensors back into a reply after interceptors acted on them: arrays and
metrics that an interceptor changed take the new values (in the original array dtype), those it removed
are removed; config records are passed on unchanged.
"""
from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

SAMPLE_COUNT = "sample_count"
METRIC_PREFIX = "metric."
CONFIG_PREFIX = "config."
DEFAULT_WEIGHT_KEY = "num-examples"


def array_to_tensor(array: Array) -> torch.Tensor:
    return torch.from_numpy(np.array(array.numpy(), copy=True))


def _value_tensor(value) -> torch.Tensor:
    if isinstance(value, bytes):
        return torch.tensor(list(value), dtype=torch.uint8)
    if isinstance(value, str):
        return torch.tensor(list(value.encode("utf-8")), dtype=torch.uint8)
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int) or (isinstance(value, list) and value and all(isinstance(v, int) for v in value)):
        return torch.tensor(value, dtype=torch.int64)
    return torch.tensor(value, dtype=torch.float64)


def content_to_tensors(content: RecordDict, weight_key: str = DEFAULT_WEIGHT_KEY) -> dict[str, torch.Tensor]:
    """Everything a message's content carries, as named tensors (module docstring for the names)."""
    tensors: dict[str, torch.Tensor] = {}
    for record_name, record in content.array_records.items():
        for name, array in record.items():
            if name in tensors:
                raise ValueError(f"array {name!r} appears in two ArrayRecords (the second is {record_name!r}); "
                                 f"fedsec records arrays by name and cannot tell them apart")
            tensors[name] = array_to_tensor(array)
    for record in content.metric_records.values():
        for key, value in record.items():
            tensors[SAMPLE_COUNT if key == weight_key else METRIC_PREFIX + key] = _value_tensor(value)
    for record in content.config_records.values():
        for key, value in record.items():
            tensors[CONFIG_PREFIX + key] = _value_tensor(value)
    return tensors


def config_values(content: RecordDict) -> dict:
    """The plain config values of a message (for a download's metadata)."""
    out = {}
    for record in content.config_records.values():
        for key, value in record.items():
            out[key] = value.hex() if isinstance(value, bytes) else value
    return out


def _metric_value(tensor: torch.Tensor, like):
    if isinstance(like, list):
        return [type(like[0])(v) for v in tensor.tolist()] if like else tensor.tolist()
    return type(like)(tensor.item())


def tensors_to_content(content: RecordDict, tensors: dict[str, torch.Tensor],
                       weight_key: str = DEFAULT_WEIGHT_KEY) -> RecordDict:
    """``content`` with its arrays and metrics replaced by ``tensors`` (names as ``content_to_tensors``
    gives them); entries missing from ``tensors`` are dropped."""
    out = RecordDict()
    for record_name, record in content.array_records.items():
        arrays = {}
        for name, array in record.items():
            if name in tensors:
                dtype = array.numpy().dtype
                arrays[name] = Array(np.ascontiguousarray(tensors[name].detach().cpu().numpy().astype(dtype)))
        out[record_name] = ArrayRecord(arrays)
    for record_name, record in content.metric_records.items():
        metrics = {}
        for key, value in record.items():
            name = SAMPLE_COUNT if key == weight_key else METRIC_PREFIX + key
            if name in tensors:
                metrics[key] = _metric_value(tensors[name], value)
        out[record_name] = MetricRecord(metrics)
    for record_name, record in content.config_records.items():
        out[record_name] = record
    return out
