"""SPEAR beside the optimisation attacks on the same uploads, in three settings.

Each comparison runs ``fedsec attack`` (``run_attack``) twice on one federation and seed, so both attacks
read the same recorded uploads of the same chosen clients; the images are paired (round, client, image)
and the difference of PSNR above the prior is given with its 95 % interval over attacked clients
(``attacks.metrics.paired_difference``).

* ``one-step``: FedAvg, round 0, each target one SGD step on B images: ``mlp-relu`` at B = 16 and 25,
  ``pfllib-cnn`` at B = 8 and 16; SPEAR against Inverting Gradients (``ig``, ``--ig-iterations`` steps,
  one start: its budget is named in the line).
* ``real``: FedAvg, round 0, the clients' real local training: ``--real-images`` images each, batches of 8,
  one local epoch (several SGD steps); SPEAR against the attack built for real local training
  (``fedavg-leak``, ``--leak-iterations`` steps, one start).
* ``trained``: every method whose upload carries the extractor (FedAvg, FT-FedAvg, FedPer, FedRep, FedPAC,
  FedeCouple) on ``pfllib-cnn`` after 19 rounds (clients of ``--trained-images`` images), the attack at
  round 19 on the method's own local training on 8 images (``--victim-batch 8``: one step for the plain-SGD
  methods; FedRep's, FedPAC's and FedeCouple's phases as they train): the shared body's ``fc`` with trained
  weights. SPEAR alone (its share exact, certified, PSNR against the prior).

A line per attack and case::

    one-step mlp-relu B=16 spear: exact 100.0 % [100, 100], PSNR 45.1 dB [40.2, 48.0] (prior 11.6), 1.20 s per target, n = 32

and per comparison ``... paired: spear - ig = +12.3 dB [9.8, 14.9] over n = 32 images``.

    python bench/spear_compare.py [--settings one-step,real,trained] [--targets 2] [--seed 0]
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = ("one-step", "real", "trained")
ONE_STEP_CASES = (("mlp-relu", 16), ("mlp-relu", 25), ("pfllib-cnn", 8), ("pfllib-cnn", 16))
REAL_ARCHS = ("mlp-relu", "pfllib-cnn")
TRAINED_METHODS = ("fedavg", "ft-fedavg", "fedper", "fedrep", "fedpac", "fedecouple")
TRAINED_ROUND = 19
REAL_BATCH = 8


def run(config: dict, attack: str, targets: int, **settings) -> tuple[dict, list[dict]]:
    """(summary, per-image rows of attack.csv) of one ``fedsec attack`` run."""
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    with tempfile.TemporaryDirectory() as folder:
        summary = run_attack(RunConfig.of(**config), AttackSettings(attack=attack, targets=targets, **settings),
                             out=folder, progress=False)
        path = Path(folder) / "attack.csv"
        rows = list(csv.DictReader(path.open(encoding="utf-8"))) if path.is_file() else []
    return summary, rows


def describe(case: str, attack: str, summary: dict) -> str:
    """The line of one attack in one case."""
    per_target = [t["seconds"] for t in summary.get("per_target", [])]
    low, high = summary.get("mean_psnr_ci") or (float("nan"), float("nan"))
    exact = ""
    if summary.get("inputs_exact_share") is not None:
        e_low, e_high = summary["inputs_exact_share_ci"]
        exact = (f"exact {100 * summary['inputs_exact_share']:.1f} % [{100 * e_low:.0f}, {100 * e_high:.0f}], "
                 f"certified {100 * (summary.get('inputs_certified_share') or 0.0):.1f} %, ")
    return (f"{case} {attack}: {exact}PSNR {min(summary['mean_psnr'], 100):.2f} dB [{low:.2f}, {high:.2f}] "
            f"(prior {summary['mean_prior_psnr']:.2f}), {sum(per_target) / max(len(per_target), 1):.2f} s per target, "
            f"n = {summary['images_scored']}")


def paired(case: str, a: str, rows_a: list[dict], b: str, rows_b: list[dict], seed: int) -> str:
    """The paired line: PSNR above the prior of ``a`` minus ``b`` on the images both scored."""
    from attacks.metrics import paired_difference

    found = paired_difference(rows_a, rows_b, seed=seed)
    if found["mean_difference"] is None:
        return f"{case} paired: {a} - {b}: {found['verdict']}"
    low, high = found["ci"] or (float("nan"), float("nan"))
    return (f"{case} paired: {a} - {b} = {found['mean_difference']:+.2f} dB [{low:+.2f}, {high:+.2f}] over "
            f"n = {found['n_pairs']} images ({found['verdict']})")


def compare(case: str, config: dict, first: tuple[str, dict], second: tuple[str, dict], targets: int,
            seed: int) -> None:
    """Both attacks on the same federation and clients, their lines and the paired line."""
    results = []
    for attack, settings in (first, second):
        summary, rows = run(config, attack, targets, **settings)
        print(describe(case, attack, summary), flush=True)
        results.append((attack, rows))
    print(paired(case, results[0][0], results[0][1], results[1][0], results[1][1], seed), flush=True)


def one_step(targets: int, seed: int, ig_iterations: int) -> None:
    for arch, batch in ONE_STEP_CASES:
        config = dict(method="fedavg", dataset="mnist5k", arch=arch, clients=max(targets, 2), rounds=1,
                      train_images=batch, seed=seed, threads=1)
        compare(f"one-step {arch} B={batch}", config, ("spear", {"victim_batch": batch}),
                ("ig", {"victim_batch": batch, "iterations": ig_iterations, "restarts": 1}), targets, seed)


def real(targets: int, seed: int, images: int, leak_iterations: int) -> None:
    for arch in REAL_ARCHS:
        config = dict(method="fedavg", dataset="mnist5k", arch=arch, clients=max(targets, 2), rounds=1,
                      train_images=images, batch_size=REAL_BATCH, local_epochs=1, seed=seed, threads=1)
        compare(f"real {arch} N={images} batch={REAL_BATCH}", config, ("spear", {"victim_batch": 0}),
                ("fedavg-leak", {"victim_batch": 0, "iterations": leak_iterations, "restarts": 1}), targets, seed)


def trained(targets: int, seed: int, images: int) -> None:
    for method in TRAINED_METHODS:
        config = dict(method=method, dataset="mnist5k", arch="pfllib-cnn", clients=max(targets, 2),
                      rounds=TRAINED_ROUND + 1, train_images=images, seed=seed, threads=1)
        summary, _ = run(config, "spear", targets, victim_batch=REAL_BATCH, rounds=(TRAINED_ROUND,))
        print(describe(f"trained {method} round={TRAINED_ROUND} B={REAL_BATCH}", "spear", summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--targets", type=int, default=2, help="clients attacked per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ig-iterations", type=int, default=1000, help="IG's steps in the one-step cases")
    parser.add_argument("--leak-iterations", type=int, default=500, help="fedavg-leak's steps in the real cases")
    parser.add_argument("--real-images", type=int, default=24, help="training images per client, real cases")
    parser.add_argument("--trained-images", type=int, default=100, help="training images per client, trained cases")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SETTINGS]
    numbers = (args.targets, args.ig_iterations, args.leak_iterations, args.real_images, args.trained_images)
    if unknown or not chosen or min(numbers) < 1:
        print(f"error: --settings takes {', '.join(SETTINGS)} (got {args.settings!r}); --targets, --ig-iterations, "
              f"--leak-iterations, --real-images and --trained-images need positive integers", file=sys.stderr)
        raise SystemExit(2)
    import torch

    from fedecouple.errors import UserError

    torch.set_num_threads(1)
    try:
        if "one-step" in chosen:
            one_step(args.targets, args.seed, args.ig_iterations)
        if "real" in chosen:
            real(args.targets, args.seed, args.real_images, args.leak_iterations)
        if "trained" in chosen:
            trained(args.targets, args.seed, args.trained_images)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
