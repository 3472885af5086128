"""Seconds per reconstruction and PSNR of DLG and Inverting Gradients at a fixed budget.

The classic setting: mnist5k, the paper's 28x28 CNN at its initial weights (the federation's
initialisation for seed 0), one training image, the FedAvg-style update of one SGD step
(lr 0.05), read back by the attack as a scaled gradient. Budgets: DLG 50 L-BFGS steps (up to 20
evaluations each), IG 300 Adam steps; one start each, attack seed 0, one torch thread.

Prints one line per attack, then, as the last line, ``seconds <x> psnr <y>``: the mean over the
two attacks of the seconds per reconstruction and of the PSNR (dB, attacks.metrics).

    python bench/attack_speed.py [--image 0] [--threads 1] [--arch cnn28]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

from attacks import ATTACKS
from attacks.base import Budget, LocalHyperparameters, Observation
from attacks.metrics import score_reconstructions
from fedecouple.data import load_dataset
from fedecouple.engine import derive_seed
from fedecouple.methods import make_method
from fedecouple.models import build_model, get_params

BUDGETS = {"dlg": Budget(iterations=50, restarts=1, batch=1), "ig": Budget(iterations=300, restarts=1, batch=1)}
LR = 0.05


def classic_observation(dataset, index: int, arch: str = "cnn28") -> tuple[Observation, torch.Tensor]:
    torch.manual_seed(derive_seed(0, 0xC0DE))  # the federation's initialisation for seed 0
    model = build_model(arch, 1, 28, 10, dataset.mean, dataset.std)
    start = get_params(model)
    x, y = dataset.images[index:index + 1], dataset.labels[index:index + 1]
    params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    grads = torch.autograd.grad(F.cross_entropy(functional_call(model, params, (x,)), y), list(params.values()))
    upload = {k: (v - LR * g).detach() for (k, v), g in zip(params.items(), grads)}
    obs = Observation(method=make_method("fedavg"), round=0, client_id=0, download=start, upload=upload, previous_upload=None,
                      make_model=lambda: copy.deepcopy(model), image_shape=(1, 28, 28), num_classes=10,
                      known_hyperparameters=LocalHyperparameters(lr=LR, steps=1, batch_size=1))
    return obs, x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", type=int, default=0, help="index of the image in mnist5k")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arch", default="cnn28", help="cnn28 (no padding) or cnn28-same")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dataset = load_dataset("mnist5k")
    obs, truth = classic_observation(dataset, args.image, args.arch)
    prior = dataset.images.mean(dim=0)
    seconds, psnrs = [], []
    for name, budget in BUDGETS.items():
        start = time.perf_counter()
        result = ATTACKS[name].attack_one(obs, budget, 0)
        elapsed = time.perf_counter() - start
        (row,) = score_reconstructions(result.images, truth, prior)
        seconds.append(elapsed)
        psnrs.append(min(row["psnr"], 100.0))
        print(f"{name}: {budget.iterations} iterations, {elapsed:.2f} s, PSNR {row['psnr']:.2f} dB "
              f"(prior {row['prior_psnr']:.2f} dB), label {int(result.labels[0])} (true {int(dataset.labels[args.image])})")
    print(f"seconds {sum(seconds) / len(seconds):.3f} psnr {sum(psnrs) / len(psnrs):.3f}")


if __name__ == "__main__":
    main()
