"""Library function behind ``fedsec compare``: train several methods on the same partitions and
seeds and tabulate their accuracy.

Layout of ``out``::

    out/<method>/seed<k>/   a normal ``fedsec train`` run directory (config.json, metrics.csv, ...)
    out/accuracy.csv        method, seed, mean_accuracy, std_accuracy  (one row per finished run)
    out/accuracy.md         mean ± std over seeds of the per-run mean client accuracy, per method

For a given seed every method sees the same partition (it depends only on the seed and the
partition flags) and the same initial model. Each method receives only the hyperparameters it
accepts (``--lam`` goes to FedeCouple, FedPAC and FedProto alike; ``--mu`` only to FedeCouple).
The command is resumable: a run whose ``summary.json`` exists with the same configuration and all
rounds done is skipped, an interrupted run continues from its checkpoint, and a run directory
holding a *different* configuration is an error (nothing is overwritten). Both tables are rewritten
atomically after every run, so they always describe the finished runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from fedecouple.errors import UserError
from fedecouple.methods import METHODS

from reports.accuracy import accuracy_markdown

from .. import io, runner
from ..resumable import TrainRun
from ..runner import RunConfig

def parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise UserError(f"--{what} needs at least one value (comma-separated)")
    return list(dict.fromkeys(items))  # drop duplicates, keep order


def parse_methods(text: str) -> list[str]:
    methods = parse_list(text, "methods")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"choose from: {', '.join(METHODS)}")
    return methods


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for item in parse_list(text, "seeds"):
        try:
            seeds.append(int(item))
        except ValueError:
            raise UserError(f"--seeds expects comma-separated integers, got {item!r}") from None
    return seeds


def method_config(base: RunConfig, method: str, seed: int) -> RunConfig:
    """``base`` for one method and seed, with only the hyperparameters that method accepts."""
    return base.updated(method=method, seed=seed, hyperparameters=METHODS[method].accepted(base.hyperparameters))


def unused_hyperparameters(base: RunConfig, methods: list[str]) -> list[str]:
    """Hyperparameters in ``base`` that none of ``methods`` takes."""
    from fedecouple.methods.base import hyperparameter_names

    used = {k for m in methods for k in hyperparameter_names(METHODS[m])}
    return sorted(set(base.hyperparameters) - used)


def run_dir(out: Path, method: str, seed: int) -> Path:
    return out / method / f"seed{seed}"


def accuracy_tables(rows: list[dict], methods: list[str]) -> tuple[pd.DataFrame, str]:
    """(per-run frame in method then seed order, its Markdown summary)."""
    frame = pd.DataFrame(rows, columns=["method", "seed", "mean_accuracy", "std_accuracy"])
    order = {m: i for i, m in enumerate(methods)}
    frame = frame.sort_values(["method", "seed"], key=lambda col: col.map(order) if col.name == "method" else col,
                              kind="stable").reset_index(drop=True)
    return frame, accuracy_markdown(frame, methods)


def compare(base: RunConfig, methods: list[str], seeds: list[int], out: str | Path,
            progress: bool = True, on_run: Callable[[str, int, dict], None] | None = None) -> pd.DataFrame:
    """Train every (method, seed) of ``base`` into ``out/<method>/seed<k>/`` and write the tables.

    Everything is validated before the first run starts; returns the per-run accuracy frame.
    """
    from tqdm import tqdm

    if not methods:
        raise UserError("--methods needs at least one method")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UserError(f"unknown method {', '.join(unknown)}; choose from: {', '.join(METHODS)}")
    if not seeds:
        raise UserError("--seeds needs at least one seed")
    unused = unused_hyperparameters(base, methods)
    if unused:
        raise UserError(f"no compared method takes hyperparameter {', '.join(unused)}")
    out = Path(out)
    # seed-major: every method finishes seed k before any starts seed k+1, so an interrupted
    # comparison always holds complete method-by-method tables for its first seeds
    plan = [(m, s, method_config(base, m, s)) for s in seeds for m in methods]
    for m, s, cfg in plan:
        runner.build_method(cfg)
        cfg.federation.validate(cfg.data.clients)
        if TrainRun(run_dir(out, m, s), cfg).status() == "other":
            raise UserError(f"{run_dir(out, m, s)} holds a run with a different configuration; "
                            f"use another --out or remove that folder")

    rows: list[dict] = []
    bar = tqdm(total=len(plan) * base.federation.rounds, unit="round", desc="compare", disable=not progress)
    try:
        with runner.shared_datasets():
            for m, s, cfg in plan:
                path = run_dir(out, m, s)
                status = TrainRun(path, cfg).status()
                bar.set_postfix_str(f"{m} seed {s}")
                if status == "done":
                    summary = io.read_json(path / "summary.json")
                    bar.update(cfg.federation.rounds)
                else:
                    start = bar.n

                    def on_round(r, _summary, start=start):
                        bar.n = start + r + 1
                        bar.refresh()

                    summary = runner.train(cfg, path, resume=status == "partial", on_round=on_round)
                    bar.n = start + cfg.federation.rounds
                    bar.refresh()
                rows.append({"method": m, "seed": s, "mean_accuracy": summary["mean_accuracy"],
                             "std_accuracy": summary["std_accuracy"]})
                frame, markdown = accuracy_tables(rows, methods)
                io.write_csv(out / "accuracy.csv", frame)
                io.write_text(out / "accuracy.md", markdown)
                if on_run is not None:
                    on_run(m, s, summary)
    finally:
        bar.close()
    return accuracy_tables(rows, methods)[0]
