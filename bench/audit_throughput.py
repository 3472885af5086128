"""Images reconstructed per second in the real-training setting, batched ÷ one by one.

The audit's question is how many of a client's images a server rebuilds from one upload of its
*real* local training (``--victim-batch 0``: the client's own batches of 10, its epochs, all its
samples; the attack rebuilds every image it trained on, one copy per epoch aligned and averaged).
This script trains a federation once (``fedsec.recording.train_recorded``), then attacks the same
recorded round-0 uploads of ``--targets`` clients twice per gradient attack with
``attacks.harness.attack_recorded``: once one by one (``batched=False``, what ``--no-batched`` does)
and once batched (the targets share the initial model, so their objectives are stacked), same
budget and seeds, one process. Training is outside the timing.

For each attack it prints images scored, seconds and images/s of both runs, their ratio, and the
mean PSNR of both (equal to float rounding per evaluation; a stalled optimisation can end
elsewhere). Last line: ``ratio <x>``, the throughput ratio of the first attack given.

    python bench/audit_throughput.py [--attacks ig,dlg,idlg] [--method fedavg] [--clients 20]
                                     [--targets 4] [--iterations ig=100,dlg=10,idlg=10] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch

from attacks.harness import attack_recorded
from fedsec.jobs.attack import AttackSettings
from fedsec.jobs.report import parse_iterations
from fedsec.recording import train_recorded
from fedsec.runner import RunConfig, prepare

DEFAULT_ITERATIONS = "ig=100,dlg=10,idlg=10"


def measure(run, settings: AttackSettings, targets: dict, batched: bool) -> tuple[int, float, float, int]:
    """(images scored, seconds, mean PSNR, largest number of targets optimised together) of one
    attack pass over the recorded targets."""
    args = settings.split()
    start = time.perf_counter()
    summary = attack_recorded(run, args.spec, targets, args.threat, args.budget, seed=args.seed, batched=batched,
                              victim=args.victim, threads=args.threads, progress=False).summary
    seconds = time.perf_counter() - start
    together = max((t["batched_with"] for t in summary.per_target), default=0)
    return summary.images_scored, seconds, float(summary.scores["mean_psnr"]), together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default="ig,dlg,idlg")
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--targets", type=int, default=4)
    parser.add_argument("--iterations", default=DEFAULT_ITERATIONS, help="N or ATTACK=N,...")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    names = args.attacks.split(",")
    iterations = parse_iterations(args.iterations)
    config = RunConfig.of(method=args.method, clients=args.clients, rounds=1, threads=args.threads)
    torch.set_num_threads(args.threads)
    prep = prepare(config)
    recording = AttackSettings(attack=names[0], victim_batch=0, targets=args.targets,
                               iterations=iterations.get(names[0])).resolved(0, args.threads)
    fed, run, targets, _, _ = train_recorded(prep, recording, progress=False)
    fed.close()
    ratios = []
    for name in names:
        settings = AttackSettings(attack=name, victim_batch=0, targets=args.targets, restarts=1,
                                  iterations=iterations.get(name)).resolved(0, args.threads)
        n_one, one, psnr_one, _ = measure(run, settings, targets, batched=False)
        n_many, many, psnr_many, together = measure(run, settings, targets, batched=True)
        ratio = (n_many / many) / (n_one / one)
        ratios.append(ratio)
        print(f"{name} on {args.method}, real local training, {len(targets[0])} clients, {settings.iterations} "
              f"iterations, {args.threads} thread(s): one by one {n_one} images in {one:.1f} s "
              f"({n_one / one:.2f} images/s, PSNR {psnr_one:.2f} dB), batched {n_many} images in {many:.1f} s "
              f"({n_many / many:.2f} images/s, PSNR {psnr_many:.2f} dB; up to {together} targets stacked), "
              f"throughput ratio {ratio:.2f}", flush=True)
    print(f"ratio {ratios[0]:.2f}")


if __name__ == "__main__":
    main()
