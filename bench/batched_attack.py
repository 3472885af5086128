"""Throughput of batched attacks: 16 targets that share a model, batched ÷ one by one.

The classic setting of ``bench/attack_speed.py`` for 16 different mnist5k images (indices 0, 300,
600, ...): the model at the seed-0 initial weights, each target's upload the FedAvg-style update of
one SGD step on its own image. ``attacks.attack_many`` runs the 16 targets once with
``batched=False`` (one optimisation after another, what ``--no-batched`` does) and once with
``batched=True`` (one vmapped optimisation), same budget and seeds, in one process.

For each attack it prints the seconds of both runs, their throughput ratio (targets/s batched ÷
targets/s one by one) and the mean PSNR of both (they agree to float rounding per evaluation; an
optimisation that amplifies rounding, e.g. DLG stalling in a local minimum, can end elsewhere).
Last line: ``ratio <x>``, the throughput ratio of the first attack given (default ig).

    python bench/batched_attack.py [--attacks ig,dlg] [--targets 16] [--threads 1] [--arch cnn28]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from attacks import attack_many
from attacks.base import Budget
from attacks.metrics import score_reconstructions
from fedecouple.data import load_dataset

from attack_speed import classic_observation  # noqa: E402  (bench/ is the working directory's sibling)

BUDGETS = {"ig": Budget(iterations=200), "dlg": Budget(iterations=20), "idlg": Budget(iterations=20)}


def run(name: str, observations, truths, prior, batched: bool) -> tuple[float, float]:
    seeds = list(range(len(observations)))
    start = time.perf_counter()
    results = attack_many(name, observations, BUDGETS[name], seeds, batched=batched)
    seconds = time.perf_counter() - start
    psnrs = [min(score_reconstructions(r.images, t, prior)[0]["psnr"], 100.0) for r, t in zip(results, truths)]
    return seconds, statistics.mean(psnrs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default="ig,dlg")
    parser.add_argument("--targets", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arch", default="cnn28")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dataset = load_dataset("mnist5k")
    pairs = [classic_observation(dataset, 300 * i, arch=args.arch) for i in range(args.targets)]
    observations, truths = [p[0] for p in pairs], [p[1] for p in pairs]
    prior = dataset.images.mean(dim=0)
    ratios = []
    for name in args.attacks.split(","):
        one, psnr_one = run(name, observations, truths, prior, batched=False)
        many, psnr_many = run(name, observations, truths, prior, batched=True)
        ratios.append(one / many)
        print(f"{name}: {args.targets} targets, {BUDGETS[name].iterations} iterations, {args.threads} thread(s): "
              f"one by one {one:.2f} s (PSNR {psnr_one:.2f} dB), batched {many:.2f} s (PSNR {psnr_many:.2f} dB), "
              f"throughput ratio {one / many:.2f}")
    print(f"ratio {ratios[0]:.2f}")


if __name__ == "__main__":
    main()
