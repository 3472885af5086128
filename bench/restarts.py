"""DLG's restarts on the main job: what ``--restarts K`` costs and gives against one start.

The main job's configuration (``fedsec attack dlg --method fedecouple``: 8 FedeCouple clients of round 0
on the embedded MNIST subset, one image and one local step each, 300 L-BFGS steps) run through
``run_attack`` at ``--restarts 1`` and at ``--restarts K`` in one process, same seed. Every (target,
start) is a slot of one batched L-BFGS; the starts after the first race by successive halving and the
kept start follows ``attacks.inversion.optimise.matching``'s rule.

It prints, for both runs, the wall seconds (training, attack and scoring), the mean PSNR with the
harness's 95 % interval, and the number of targets whose kept start stopped short of the truth (the
forward check's ``not_converged``); then the wall-time ratio (K starts ÷ one start). Last line:
``ratio <x> psnr1 <a> psnr8 <b>`` (``psnr8``: the mean PSNR at K starts, whatever K is).

    python bench/restarts.py [--restarts 8] [--seed 0] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def attack(restarts: int, seed: int, threads: int) -> tuple[dict, float]:
    """The summary of the main job at ``restarts`` starts per target, and its wall seconds."""
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedecouple", dataset="mnist5k", seed=seed, threads=threads)
    settings = AttackSettings(attack="dlg", targets=8, restarts=restarts)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        summary = run_attack(config, settings, out=folder, progress=False)
    return summary, time.perf_counter() - start


def show(restarts: int, summary: dict, seconds: float) -> str:
    low, high = summary["mean_psnr_ci"] or (float("nan"), float("nan"))
    return (f"--restarts {restarts}: {seconds:7.1f} s, mean PSNR {summary['mean_psnr']:.2f} dB [{low:.2f}, {high:.2f}], "
            f"kept start stopped short on {summary['not_converged_targets']} of {summary['n_targets']} targets")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restarts", type=int, default=8, help="starts per target of the second run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.restarts < 1 or args.threads < 1:
        print("error: --restarts and --threads need positive integers", file=sys.stderr)
        raise SystemExit(2)
    one, one_seconds = attack(1, args.seed, args.threads)
    print(show(1, one, one_seconds), flush=True)
    many, many_seconds = attack(args.restarts, args.seed, args.threads)
    print(show(args.restarts, many, many_seconds), flush=True)
    ratio = many_seconds / one_seconds
    print(f"wall time ratio ({args.restarts} starts / 1): {ratio:.2f}")
    print(f"ratio {ratio:.2f} psnr1 {one['mean_psnr']:.2f} psnr8 {many['mean_psnr']:.2f}")


if __name__ == "__main__":
    main()
