"""Atomic output files: write to a temporary file in the same folder, then rename over the target,
so an interrupted run never leaves a half-written result."""
from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; it replaces ``target`` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(target: str | Path, text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def write_json(target: str | Path, obj) -> None:
    write_text(target, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def finite(x):
    """``x`` with every non-finite float (NaN, ±inf) replaced by None, recursively: valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def _json_default(obj):
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def write_csv(target: str | Path, frame) -> None:
    """Write a pandas DataFrame atomically (no index column)."""
    with atomic_path(target) as tmp:
        frame.to_csv(tmp, index=False)


def save_torch(target: str | Path, obj) -> None:
    with atomic_path(target) as tmp:
        torch.save(obj, tmp)


def load_torch(path: str | Path):
    """Load a checkpoint written by ``save_torch``; tensors and plain containers only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read_json(path: str | Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))
