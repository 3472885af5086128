"""What distributed differential privacy buys against the round-level attacks under secure aggregation.

Each client adds Skellam noise to its quantised values before masking (``--sa-dp-epsilon``;
``defenses.distributed_dp``), calibrated so that the run's sums spend the target ε at δ = 1e-5 with each
client's update (its weighted values' distance from its download) L2-clipped to 1; ε = inf is the
protocol without noise, and ε = 1e6 the clip with a negligible noise: that row shows what of the ε = 1 and
8 rows is the clip's, not the noise's. FedAvg on the embedded MNIST subset, 10 clients, one round (the
attacked one), per attack:

* ``sum-inversion`` (a curious server): the round's sum inverted as one batch of the 10 clients' images
  (one image each);
* ``sum-binning`` (a malicious server): the binning craft sized to the protocol, read out of the sum
  (5 images a client);
* ``inconsistency`` (a malicious server isolating one target by model inconsistency): the others'
  updates of the attacked layers are zero, but each of them still adds its own noise, so the sum's ε
  applies; the isolated ε (the target's own noise alone, n = 1) is printed beside it;
* ``sybil`` (a malicious server whose sybils are every other participant): it subtracts their updates and
  the noise they drew, so the target's own noise is all that remains: the isolated ε applies.

Printed per attack and ε: mean PSNR [95 % interval], the share recovered [interval], the images scored,
and the ε of the round's sum, the run's total and the isolated client's, each from the run's summary.

    python bench/secure_dp.py [--seed 0] [--iterations 1000] [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from secure_curious import fedsec  # noqa: E402  (bench/ is the script's own folder on sys.path)

EPSILONS = (1.0, 8.0, 1e6, math.inf)  # 1e6: the clip, with a negligible noise
BASE = ["--method", "fedavg", "--clients", "10", "--rounds", "1", "--attack-rounds", "0", "--threads", "1"]
ATTACKS = {"sum-inversion": ["--train-images", "1"],
           "sum-binning": ["--partition", "iid", "--train-images", "5", "--victim-batch", "0"],
           "inconsistency": ["--partition", "iid", "--train-images", "5", "--victim-batch", "0"],
           "sybil": ["--partition", "iid", "--train-images", "5", "--victim-batch", "0"]}


def _ci(values, digits: int, scale: float = 1.0) -> str:
    if not values or values[0] is None:
        return "[n/a]"
    return f"[{values[0] * scale:.{digits}f}, {values[1] * scale:.{digits}f}]"


def line(attack: str, epsilon: float, summary: dict) -> str:
    """One printed row: the attack's figures and what the noise spent."""
    psnr = summary.get("mean_psnr")
    shown = "n/a" if psnr is None or psnr != psnr else f"{psnr:.2f} dB {_ci(summary.get('mean_psnr_ci'), 2)}"
    rate = summary.get("success_rate")
    recovered = "n/a" if rate is None or rate != rate else f"{100 * rate:.0f} % {_ci(summary.get('success_rate_ci'), 0, 100)}"
    spent = summary.get("distributed_dp")
    if spent:
        last = spent["per_round"][-1]
        privacy = (f"epsilon round {last['epsilon_round']:.3g}, total {spent['epsilon_total']:.3g}, "
                   f"isolated {spent['epsilon_isolated']:.3g}")
    else:
        privacy = "epsilon round inf, total inf, isolated inf"
    return (f"  {attack:<14} eps {epsilon:<4g}  mean PSNR {shown}, recovered {recovered}, "
            f"n = {summary.get('images_scored', 0)}; {privacy}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=1000, help="sum-inversion's iterations (its default)")
    parser.add_argument("--out", type=Path, default=None, help="keep each run's folder here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="secure-dp-") as tmp:
        root = args.out or Path(tmp)
        rows = []
        for attack, extra in ATTACKS.items():
            for epsilon in EPSILONS:
                flags = ["--secure-aggregation", *([] if math.isinf(epsilon) else ["--sa-dp-epsilon", f"{epsilon:g}"])]
                budget = ["--iterations", str(args.iterations)] if attack == "sum-inversion" else []
                summary = fedsec(["attack", attack, *BASE, *extra, *budget, *flags, "--seed", str(args.seed)],
                                 root / f"{attack}-eps{epsilon:g}")
                rows.append(line(attack, epsilon, summary))
    print("\ndistributed DP (Skellam, delta 1e-5, L2 clip 1; FedAvg, 10 clients, round 0):")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
