"""Real local training against one step on the same images ("the multi-step attack is
never weaker than the one-step attack on the same images"): one federation of clients of exactly N
training images; the same clients attacked twice by ``fedavg-leak``, once on their real local
training (one epoch in batches of ``--batch-size``: N / B steps) and once on one step over all N
images (``--victim-batch N --victim-steps 1``). Prints each setting's mean PSNR with its interval and
the paired difference (multi-step minus one-step, PSNR above the prior, per image, resampling the
clients: ``attacks.metrics.paired_difference``), and writes both settings' rows to ``--out``.

    python bench/multi_vs_one_step.py [--train-images 4] [--batch-size 2] [--targets 10] [--seed 0]
                                      [--method fedavg] [--dataset mnist5k] [--iterations I]
                                      [--out multi_vs_one_step.csv]
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

SETTINGS = ("multi-step", "one-step")


def attack_both(n: int = 4, batch_size: int = 2, targets: int = 10, seed: int = 0, method: str = "fedavg",
                clients: int = 10, dataset: str = "mnist5k", threads: int = 1,
                iterations: int | None = None) -> dict[str, dict]:
    """{setting: {"summary": ..., "rows": attack.csv's rows}} for both settings on the same clients."""
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    config = RunConfig.of(method=method, dataset=dataset, partition="weak", train_images=n, clients=clients, rounds=1,
                          batch_size=batch_size, local_epochs=1, seed=seed, threads=threads)
    plans = {"multi-step": AttackSettings(attack="fedavg-leak", victim_batch=0, targets=targets,
                                          iterations=iterations),
             "one-step": AttackSettings(attack="fedavg-leak", victim_batch=n, victim_steps=1, images=n,
                                        targets=targets, iterations=iterations)}
    out = {}
    for name, settings in plans.items():
        with tempfile.TemporaryDirectory() as folder:
            summary = run_attack(config, settings, out=folder, progress=False)
            with open(Path(folder) / "attack.csv", newline="", encoding="utf-8") as fh:
                out[name] = {"summary": summary, "rows": list(csv.DictReader(fh))}
    return out


def same_image_keys(rows: list[dict]) -> list[dict]:
    """The rows with ``image`` renumbered by the image's prior PSNR within its client: the two settings
    number a client's images differently (the shuffle's place vs the victim batch's), and an image's
    prior PSNR (the data set's mean image against it) is the same in both."""
    by_client: dict[str, list[dict]] = {}
    for row in rows:
        by_client.setdefault(row["client"], []).append(row)
    out = []
    for client_rows in by_client.values():
        for rank, row in enumerate(sorted(client_rows, key=lambda r: float(r["prior_psnr"]))):
            out.append({**row, "image": rank})
    return out


def compare(results: dict[str, dict]) -> dict:
    """The paired difference (multi-step − one-step), after checking that both scored the same images."""
    from attacks.metrics import paired_difference

    multi, one = (same_image_keys(results[s]["rows"]) for s in SETTINGS)
    key = lambda r: (r["client"], r["image"])  # noqa: E731
    priors = {key(r): round(float(r["prior_psnr"]), 6) for r in one}
    if sorted(priors.items()) != sorted((key(r), round(float(r["prior_psnr"]), 6)) for r in multi):
        raise ValueError("the two settings did not score the same images: no paired comparison")
    return paired_difference(multi, one)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-images", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--targets", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--iterations", type=int, default=None, help="per start (default: the attack's)")
    parser.add_argument("--out", type=Path, default=Path("multi_vs_one_step.csv"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = attack_both(args.train_images, args.batch_size, args.targets, args.seed, args.method,
                          dataset=args.dataset, iterations=args.iterations)
    for name in SETTINGS:
        s = results[name]["summary"]
        low, high = s.get("mean_psnr_ci") or (float("nan"), float("nan"))
        print(f"{name}: mean PSNR {s['mean_psnr']:.2f} dB [{low:.2f}, {high:.2f}] (prior {s['mean_prior_psnr']:.2f}), "
              f"recovered {100 * s['success_rate']:.0f} %, n = {s['n_images']} images over {s['n_targets']} clients, "
              f"stopped short on {s.get('not_converged_targets')}, {s['seconds']:.0f} s")
    try:
        diff = compare(results)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    ci = diff["ci"] or (float("nan"), float("nan"))
    print(f"multi-step − one-step (dB above the prior, paired over {diff['n_pairs']} images of {diff['n_targets']} "
          f"clients): {diff['mean_difference']:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}]: {diff['verdict']}")
    import pandas as pd

    from fedsec import io

    io.write_csv(args.out, pd.DataFrame([{"setting": name, **r} for name in SETTINGS for r in results[name]["rows"]]))

if __name__ == "__main__":
    main()
