"""Images per second on each available device, and GPU ÷ CPU, measured in one run.

* **FedeCouple round**: one round of FedeCouple (10 clients, pathological, 1 local epoch, batch 10,
  the default seed) on mnist5k through ``fedecouple.engine.Federation`` on the device; images/s =
  the training images of the round's clients ÷ the round's seconds (evaluation included, as a run
  spends it).
* **Batched IG**: Inverting Gradients on 16 targets in one vmapped batch (``attacks.attack_many``,
  ``bench/attack_speed.py``'s classic setting: the FedAvg-style one-step update of one mnist5k image
  each, its tensors and model moved to the device as ``attacks.inversion.observation.observe`` does),
  ``--ig-iterations`` Adam steps, one start; images/s = 16 ÷ seconds.

A GPU runs each measurement once untimed first (CUDA's context and its kernels load on first use).

    python bench/device.py [--threads 1] [--arch cnn28] [--ig-iterations 50]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attacks import attack_many  # noqa: E402
from attacks.base import Budget  # noqa: E402
from fedecouple.data import load_dataset, make_partition  # noqa: E402
from fedecouple.devices import deterministic, to_device  # noqa: E402
from fedecouple.engine import Federation, FederationConfig  # noqa: E402
from fedecouple.methods import make_method  # noqa: E402
from fedecouple.methods.base import TrainConfig  # noqa: E402

from attack_speed import classic_observation  # noqa: E402


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def round_throughput(dataset, arch: str, device: str) -> float:
    partition = make_partition(dataset.labels.numpy(), 10, "pathological", num_classes=dataset.num_classes,
                               classes_per_client=3, seed=0)
    config = FederationConfig(rounds=1, seed=0, arch=arch, device=device,
                              train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    deterministic(device)
    fed = Federation(make_method("fedecouple"), dataset, partition, config)
    images = sum(len(partition.train[c]) for c in fed.sample_clients(0))
    synchronize(device)
    start = time.perf_counter()
    fed.run_round()
    synchronize(device)
    return images / (time.perf_counter() - start)


def on_device(obs, device: str):
    """The observation as ``observe(..., device=device)`` makes it."""
    make_model = obs.make_model
    return replace(obs, download=to_device(obs.download, device), upload=to_device(obs.upload, device),
                   make_model=lambda: make_model().to(device), device=device)


def ig_throughput(dataset, arch: str, iterations: int, device: str, targets: int = 16) -> float:
    observations = [on_device(classic_observation(dataset, 300 * i, arch=arch)[0], device) for i in range(targets)]
    synchronize(device)
    start = time.perf_counter()
    attack_many("ig", observations, Budget(iterations=iterations, restarts=1), list(range(targets)), batched=True)
    synchronize(device)
    return targets / (time.perf_counter() - start)


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arch", default="cnn28")
    parser.add_argument("--ig-iterations", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dataset = load_dataset("mnist5k")
    for device in devices()[1:]:  # untimed: the CUDA context and each kernel load on first use
        round_throughput(dataset, args.arch, device)
        ig_throughput(dataset, args.arch, 2, device)
    rounds = {d: round_throughput(dataset, args.arch, d) for d in devices()}
    ig = {d: ig_throughput(dataset, args.arch, args.ig_iterations, d) for d in devices()}
    for device in devices():
        name = f" ({torch.cuda.get_device_name()})" if device != "cpu" else f" ({args.threads} thread(s))"
        print(f"{device}{name}: FedeCouple round ({args.arch}, 10 clients, mnist5k) {rounds[device]:.1f} images/s; "
              f"batched IG (16 targets, {args.ig_iterations} steps) {ig[device]:.2f} images/s")
    if "cuda" in rounds:
        print(f"GPU / CPU: FedeCouple round {rounds['cuda'] / rounds['cpu']:.2f}, batched IG {ig['cuda'] / ig['cpu']:.2f}")
    else:
        print("GPU / CPU: n/a (torch sees no GPU)")


if __name__ == "__main__":
    main()
