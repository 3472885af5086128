"""Leakage vs client size: for clients of N training images (``--train-images N``), one
local epoch in batches of 10, the strongest attack on real local training against each method.

    python bench/n_curve.py [--sizes 4,10,25,50,100,180] [--methods fedavg,fedecouple,fedper,fedpac,fedproto]
                            [--targets 4] [--iterations I] [--restarts R] [--out n_curve.csv]
                            [--figure n_curve.png]

``client_size_curve`` is a function other scripts can call; each finished cell is
appended to ``--out`` at once, so an interrupted sweep keeps what it measured and a rerun skips the
cells already there. The table and figure are ``reports.client_size``'s. FedProto uploads no weights:
its cell is prototype inversion (``proto``), the attack that applies to it.
"""
from __future__ import annotations

import argparse
import csv
import tempfile
import time
from pathlib import Path

SIZES = (4, 10, 25, 50, 100, 180)
METHODS = ("fedavg", "fedecouple", "fedper", "fedpac", "fedproto")
ATTACK_FOR = {"fedproto": "proto"}  # a method without weights gets the attack that applies to it
COLUMNS = ("method", "attack", "train_images", "mean_psnr", "mean_psnr_low", "mean_psnr_high", "prior_psnr",
           "success_rate", "label_count_error", "n_images", "n_targets", "mis_specified_targets",
           "not_converged_targets", "iterations", "restarts", "seconds", "note")


def measure_cell(method: str, n: int, *, batch_size: int = 10, epochs: int = 1, targets: int = 4,
                 iterations: int | None = None, restarts: int | None = None, seed: int = 0,
                 dataset: str = "mnist5k", clients: int = 10, threads: int = 1) -> dict:
    """One (method, N) cell: a one-round federation of ``clients`` clients of exactly ``n`` training
    images (weak partition), ``targets`` of them attacked in round 0; the summary's figures as a row."""
    from fedecouple.errors import UserError
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    attack = ATTACK_FOR.get(method, "fedavg-leak")
    config = RunConfig.of(method=method, dataset=dataset, partition="weak", train_images=n, clients=clients,
                          rounds=1, batch_size=batch_size, local_epochs=epochs, seed=seed, threads=threads)
    settings = AttackSettings(attack=attack, victim_batch=0, targets=targets, iterations=iterations,
                              restarts=restarts, images=n if attack == "proto" else None)
    started = time.perf_counter()
    row = {"method": method, "attack": attack, "train_images": n}
    with tempfile.TemporaryDirectory() as out:  # the label-count errors are per image: attack.csv's column
        try:
            summary = run_attack(config, settings, out=out, progress=False)
        except UserError as exc:
            return {**row, "note": str(exc), "seconds": round(time.perf_counter() - started, 1)}
        with open(Path(out) / "attack.csv", newline="", encoding="utf-8") as fh:
            errors = [int(r["label_count_error"]) for r in csv.DictReader(fh) if r.get("label_count_error")]
    low, high = summary.get("mean_psnr_ci") or (None, None)
    return {**row, "mean_psnr": summary.get("mean_psnr"), "mean_psnr_low": low, "mean_psnr_high": high,
            "prior_psnr": summary.get("mean_prior_psnr"), "success_rate": summary.get("success_rate"),
            "label_count_error": max(errors) if errors else None, "n_images": summary.get("n_images"),
            "n_targets": summary.get("n_targets"), "mis_specified_targets": summary.get("mis_specified_targets"),
            "not_converged_targets": summary.get("not_converged_targets"),
            "iterations": (summary.get("budget") or {}).get("iterations"),
            "restarts": (summary.get("budget") or {}).get("restarts"),
            "seconds": round(time.perf_counter() - started, 1), "note": ""}


def client_size_curve(sizes=SIZES, methods=METHODS, out: str | Path | None = None, **cell_options) -> list[dict]:
    """Every (method, N) cell, in order of N; with ``out`` each cell is appended to that CSV as it
    finishes and the cells already in it are read back instead of measured again."""
    done: dict[tuple[str, int], dict] = {}
    if out is not None and Path(out).exists():
        with open(out, newline="", encoding="utf-8") as fh:
            done = {(r["method"], int(r["train_images"])): r for r in csv.DictReader(fh)}
    rows = []
    for n in sizes:
        for method in methods:
            row = done.get((method, int(n)))
            if row is None:
                row = measure_cell(method, int(n), **cell_options)
                if out is not None:
                    _append(Path(out), row)
            rows.append(row)
    return rows


def _append(path: Path, row: dict) -> None:
    """The CSV with ``row`` added, rewritten whole under ``COLUMNS`` (a file from before a column was
    added keeps its rows aligned, the new column empty) by a temp file and a rename."""
    from fedsec.io import atomic_path

    rows = []
    if path.exists():
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    with atomic_path(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows + [row])


def main() -> None:
    import torch

    from reports.client_size import client_size_figure, client_size_table
    from fedsec import io

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--targets", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--restarts", type=int, default=None, help="starts per target (default: the attack's)")
    parser.add_argument("--out", type=Path, default=Path("n_curve.csv"))
    parser.add_argument("--figure", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = client_size_curve([int(s) for s in args.sizes.split(",")], args.methods.split(","), out=args.out,
                             targets=args.targets, iterations=args.iterations, restarts=args.restarts)
    print(client_size_table(rows))
    if args.figure is not None:
        io.write_bytes(args.figure, client_size_figure(rows))  # temp file + rename


if __name__ == "__main__":
    main()
