"""Accuracy of FedeCouple's and FedPAC's secure-aggregation variants against the plain methods.

    python bench/secure_methods.py [--seeds 0,1,2] [--clients 10] [--rounds 3] [--local-epochs 1]
                                   [--threads 2] [--out results/secure_methods.json]

Trains, on the embedded MNIST subset (mnist5k) with the pathological partition, each variant over the
seeds: plain FedeCouple; FedeCouple under ``--secure-aggregation`` (its two-pass eq. 16, exact up to
quantisation); plain FedPAC; FedPAC under ``--secure-aggregation`` (partial: heads local, no head
combination); and FedPer (a shared base and local heads, the reference for FedPAC's partial variant).
It prints each variant's final accuracy (mean over clients of the last round, then mean ± std over
seeds) and each secure variant's difference to its plain method, paired by seed, with a t interval
(95 %) over the seeds. Everything else is the CLI's defaults (``fedsec train``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fedsec  # noqa: E402

# (variant, method, under secure aggregation, the plain method it is compared to)
VARIANTS = [("fedecouple", "fedecouple", False, None),
            ("fedecouple two-pass", "fedecouple", True, "fedecouple"),
            ("fedpac", "fedpac", False, None),
            ("fedpac secure-partial", "fedpac", True, "fedpac"),
            ("fedper", "fedper", False, None)]


def final_accuracy(method: str, secure: bool, seed: int, args) -> float:
    """Mean over clients of the last round's test accuracy of one training run (nothing written)."""
    result = fedsec.train(method=method, dataset="mnist5k", partition="pathological", clients=args.clients,
                          rounds=args.rounds, local_epochs=args.local_epochs, seed=seed, threads=args.threads,
                          secure_aggregation=secure, progress=False)
    return float(result.mean_accuracy)


def paired_interval(differences: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): a t interval for the mean of paired differences (one per seed)."""
    d = np.asarray(differences, dtype=float)
    mean = float(d.mean())
    if len(d) < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    return mean, mean - half, mean + half


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        parser.error("--seeds needs at least one seed")

    start = time.perf_counter()
    accuracy: dict[str, list[float]] = {}
    for name, method, secure, _ in VARIANTS:
        accuracy[name] = [final_accuracy(method, secure, seed, args) for seed in seeds]
        print(f"{name:24s} " + " ".join(f"{a:.4f}" for a in accuracy[name]), flush=True)

    print(f"\nmnist5k, pathological, {args.clients} clients, {args.rounds} rounds, {args.local_epochs} local "
          f"epoch(s), seeds {','.join(map(str, seeds))}: final accuracy (mean over clients), mean ± std over seeds")
    figures = {}
    for name, _, _, plain in VARIANTS:
        values = np.asarray(accuracy[name])
        line = f"{name:24s} {values.mean():.4f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.4f}"
        entry = {"accuracy": accuracy[name], "mean": float(values.mean()),
                 "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0}
        if plain is not None:
            diff, low, high = paired_interval([a - b for a, b in zip(accuracy[name], accuracy[plain])])
            line += f"   vs {plain}: {diff:+.4f} (95 % t interval {low:+.4f} .. {high:+.4f})"
            entry.update(difference=diff, interval=[low, high], compared_to=plain)
        figures[name] = entry
        print(line)
    seconds = time.perf_counter() - start
    print(f"{seconds:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"setting": {"dataset": "mnist5k", "partition": "pathological",
                                                    "clients": args.clients, "rounds": args.rounds,
                                                    "local_epochs": args.local_epochs, "seeds": seeds},
                                        "variants": figures, "seconds": round(seconds, 1)}, indent=2))


if __name__ == "__main__":
    main()
