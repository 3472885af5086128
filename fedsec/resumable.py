"""One resumable stage: a folder of results whose marker file, written last and atomically, holds
the stage's identity (what its result depends on). Used by ``fedsec report`` (its stages),
``fedsec defend`` (one folder per swept value), ``fedsec mia`` (one folder per federation) and
``fedsec compare`` (``fedsec train`` run folders, ``TrainRun``).

A stage is

* **complete** when its marker holds the same identity and its required files exist (a marker whose
  ``status`` is not ``done``, e.g. ``not_applicable``, needs no files);
* **another stage** when its marker holds a different identity: callers refuse to overwrite it;
* otherwise incomplete: redone (a ``fedsec train`` run resumes from its checkpoint).

``finish`` writes the marker (last: the stage is complete from then on); ``copy_from`` copies a
complete stage of an earlier run into this one's folder through a hidden sibling, renamed when whole.
The on-disk formats are those the commands always wrote (``done.json`` with ``identity``, ``key`` or
``fingerprint``), so folders of earlier versions still resume and are still reused.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from . import io
from .runner import RunConfig

MARKER = "done.json"


@dataclass(frozen=True)
class ResumableStage:
    path: Path
    identity: Any
    required: tuple[str, ...] = ()  # files a finished (status done) stage must hold besides the marker
    marker: str = MARKER
    identity_field: str = "identity"  # the marker's field holding the identity

    def record(self, path: Path | None = None) -> dict | None:
        """The marker of ``path`` (default: this stage's folder) when it is readable, else None."""
        try:
            record = io.read_json(Path(path or self.path) / self.marker)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and self.identity_field in record else None

    def stored_identity(self, record: dict) -> Any:
        return record[self.identity_field]

    def holds_other(self) -> bool:
        """Whether the folder holds a stage with a different identity (never to be overwritten)."""
        record = self.record()
        return record is not None and self.stored_identity(record) != self.identity

    def files_present(self, path: Path, record: dict) -> bool:
        return record.get("status", "done") != "done" or all((path / name).is_file() for name in self.required)

    def complete(self, path: Path | None = None) -> bool:
        """Whether ``path`` (default: this stage's folder) holds this stage, finished."""
        path = Path(path or self.path)
        record = self.record(path)
        return record is not None and self.stored_identity(record) == self.identity and self.files_present(path,
                                                                                                          record)

    def finish(self, fields: dict) -> dict:
        """Write the marker (identity first, then ``fields``): the stage is complete from now on."""
        record = {self.identity_field: self.identity, **fields}
        io.write_json(self.path / self.marker, record)
        return record

    def find_complete(self, folders: Iterable[Path]) -> Path | None:
        """The first of ``folders`` (other than this stage's own) that holds this stage, finished."""
        own = self.path.resolve()
        return next((d for d in folders if d.resolve() != own and self.complete(d)), None)

    def partial_copy(self) -> Path:
        return self.path.parent / f".{self.path.name}.partial"

    def clear_partial_copy(self) -> None:
        """Remove what an interrupted ``copy_from`` left behind."""
        shutil.rmtree(self.partial_copy(), ignore_errors=True)

    def copy_from(self, source: Path, default: dict, **extra) -> None:
        """Copy the complete stage in ``source`` into this folder: into a hidden sibling first, with its
        marker rewritten last (this identity, ``source``'s other fields or ``default``, then ``extra``),
        renamed over the folder when whole."""
        tmp = self.partial_copy()
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.tmp", ".*", self.marker))
        record = {**(self.record(source) or default), self.identity_field: self.identity, **extra}
        io.write_json(tmp / self.marker, record)  # last: the copy is complete
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(tmp, self.path)


def marked_folders(roots: Iterable[Path], marker: str = MARKER, max_depth: int = 4) -> tuple[list[Path], list[Path]]:
    """(folders holding ``marker``, folders that look like ``fedsec train`` runs) below ``roots``, at
    most ``max_depth`` levels down; hidden folders are skipped."""
    marked, train_runs = [], []
    for root in roots:
        base_depth = len(Path(root).resolve().parts)
        for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _e: None):
            here = Path(dirpath)
            if len(here.resolve().parts) - base_depth >= max_depth:
                dirnames[:] = []
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            if marker in filenames:
                marked.append(here)
            elif "config.json" in filenames and "summary.json" in filenames:
                train_runs.append(here)
    return marked, train_runs


class TrainRun(ResumableStage):
    """A ``fedsec train`` run folder as a stage: ``config.json`` (written first) names its identity —
    the config's ``result_key``, so settings that never change a result may differ — ``summary.json``
    with every round done marks it complete, and ``checkpoint.pt`` a partial run to resume."""

    def __init__(self, path: Path, config: RunConfig):
        super().__init__(Path(path), config.result_key(), marker="config.json", identity_field="config")
        object.__setattr__(self, "rounds", config.federation.rounds)

    def stored_identity(self, record: dict) -> Any:
        try:
            return RunConfig.from_dict(record["config"]).result_key()
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: another stage

    def files_present(self, path: Path, record: dict) -> bool:
        try:
            return int(io.read_json(path / "summary.json").get("rounds", -1)) >= self.rounds
        except (ValueError, TypeError, OSError, AttributeError):
            return False

    def status(self) -> str:
        """``new`` (nothing there), ``done``, ``partial`` (same config, checkpointed) or ``other``."""
        if not (self.path / self.marker).exists():
            return "new"
        record = self.record()
        if record is None or self.stored_identity(record) != self.identity:
            return "other"
        if self.files_present(self.path, record):
            return "done"
        return "partial" if (self.path / "checkpoint.pt").exists() else "new"


# ------------------------------------------------------------------------------------------------
# a command's output folder: refused when it holds results of another configuration


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def differences(stored, current, limit: int = 4) -> str:
    """What differs between two identities, by flag name: ``--seed 0 there, 5 here``."""
    if not isinstance(stored, dict) or not isinstance(current, dict):
        return "an unreadable record"
    a, b = _flat(stored), _flat(current)
    changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shown = [f"{'' if '.' in k else '--'}{k.replace('_', '-')} {a.get(k, 'unset')} there, {b.get(k, 'unset')} here"
             for k in changed[:limit]]
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return "; ".join(shown) + more if shown else "a different configuration"


def refuse(folder: Path, why: str) -> None:
    from fedecouple.errors import UserError

    raise UserError(f"{folder} holds results of another configuration ({why}); use another --out, or --force to "
                    f"replace them")


class RunFolder(ResumableStage):
    """A command's whole output folder as a stage (``fedsec attack``, ``audit``, ``flower attack|audit``):
    its ``done.json`` is written when the run starts (status ``running``) and again when it ends (``done``),
    both holding the run's identity (its resolved settings, by flag name, without those that never change
    a result). ``claim`` says what to do with the folder before anything is written."""

    def claim(self, force: bool) -> str:
        """``new`` (start), ``done`` (same configuration, finished: reuse it), ``partial`` (same
        configuration, interrupted: redo it); a folder of another configuration is refused (a
        one-line ``UserError`` naming what differs). ``force`` makes every folder ``new``: computed
        again and its files replaced."""
        if force:
            return "new"
        record = self.record()
        if record is None:
            if any((self.path / name).exists() for name in self.required):
                refuse(self.path, "results with no record of their configuration, written by an earlier version")
            return "new"
        if self.stored_identity(record) != self.identity:
            refuse(self.path, differences(self.stored_identity(record), self.identity))
        done = record.get("status") == "done" and all((self.path / n).is_file() for n in self.required)
        return "done" if done else "partial"

    def start(self) -> None:
        self.finish({"status": "running"})

    def done(self, **fields) -> None:
        self.finish({"status": "done", **fields})


def forget(folder: Path) -> None:
    """``--force`` on a command of many stages (report, compare, defend, mia): remove every record of a
    configuration below ``folder`` (stage markers, a sweep's record and its values' parts, a train run's
    config.json), so every stage is computed again and its files replaced."""
    for record in Path(folder).rglob("defend.json"):  # a sweep reuses the parts of a value it did not finish
        for part in record.parent.glob("value-*"):
            if part.is_dir():
                shutil.rmtree(part)
    for name in (MARKER, "defend.json"):
        for path in Path(folder).rglob(name):
            path.unlink()
    for path in Path(folder).rglob("config.json"):
        if (path.parent / "summary.json").exists() or (path.parent / "checkpoint.pt").exists():
            path.unlink()
