"""SPEAR against the batch size: how many of a one-step batch's images come back exactly, and how long it takes.

FedAvg on the embedded MNIST subset, round 0, ``--targets`` clients attacked per batch size, each in the
textbook setting of one SGD step on B of its images (``--victim-batch B``), through ``fedsec attack spear``
(``fedsec.jobs.attack.run_attack``). Four models:

* ``mlp-relu``: the layer is the first (784 → 256, ReLU), its input the normalised image itself;
* ``pfllib-cnn``: the layer is the fully connected one after the convolutions (1024 → 512, ReLU), the
  images rebuilt from its recovered inputs by inverting the convolutions (mean PSNR against the prior,
  with the harness's interval over targets);
* ``mlp`` and ``cnn28`` (the default model), the same layers followed by LeakyReLU (slope 0.01): the attack
  is approximate there and never certified; their rows show how near it comes.

For each model and B it prints the share of images whose layer input was recovered exactly (relative
error ≤ 1e-4, with the harness's 95 % interval), the share certified, the mean PSNR and the prior's, and
the seconds per target (recovery and image rebuild, from the summary's per-target times; training not
counted), and saves the figure (share and seconds against B) to ``--out``.

    python bench/spear.py [--batches 4,8,16,24,32] [--targets 2] [--seed 0] [--out spear.png]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = ("mlp-relu", "pfllib-cnn", "mlp", "cnn28")


def attack(arch: str, batch: int, targets: int, seed: int) -> dict:
    """The summary of ``fedsec attack spear`` on ``arch`` with clients of one step on ``batch`` images."""
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="mnist5k", arch=arch, clients=max(targets, 2), rounds=1,
                          train_images=batch, seed=seed, threads=1)
    settings = AttackSettings(attack="spear", victim_batch=batch, targets=targets)
    with tempfile.TemporaryDirectory() as folder:
        return run_attack(config, settings, out=folder, progress=False)


def row(arch: str, batch: int, summary: dict) -> dict:
    """The figures of one summary (nothing scored, e.g. every target refused: shares of 0)."""
    per_target = [t["seconds"] for t in summary["per_target"]]
    return {"arch": arch, "batch": batch, "exact": summary.get("inputs_exact_share") or 0.0,
            "exact_ci": summary.get("inputs_exact_share_ci") or [0.0, 0.0],
            "certified": summary.get("inputs_certified_share") or 0.0,
            "psnr": summary["mean_psnr"], "psnr_ci": summary["mean_psnr_ci"], "prior": summary["mean_prior_psnr"],
            "seconds": sum(per_target) / max(len(per_target), 1), "images": summary["images_scored"]}


def show(r: dict) -> str:
    low, high = r["exact_ci"]
    psnr_low, psnr_high = r["psnr_ci"] or (float("nan"), float("nan"))
    return (f"{r['arch']:10s} B = {r['batch']:2d}: exact {100 * r['exact']:5.1f} % [{100 * low:.0f}, {100 * high:.0f}], "
            f"certified {100 * r['certified']:5.1f} %, PSNR {min(r['psnr'], 100):6.2f} dB [{psnr_low:.2f}, "
            f"{psnr_high:.2f}] (prior {r['prior']:.2f}), {r['seconds']:6.2f} s per target, n = {r['images']}")


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (share, seconds) = plt.subplots(1, 2, figsize=(10, 4))
    for arch in MODELS:
        mine = [r for r in rows if r["arch"] == arch]
        batches = [r["batch"] for r in mine]
        share.errorbar(batches, [100 * r["exact"] for r in mine], capsize=3, marker="o", label=arch,
                       yerr=[[100 * (r["exact"] - r["exact_ci"][0]) for r in mine],
                             [100 * (r["exact_ci"][1] - r["exact"]) for r in mine]])
        seconds.plot(batches, [r["seconds"] for r in mine], marker="o", label=arch)
    share.set(xlabel="batch size B", ylabel="images with layer input exact (%)", ylim=(-5, 105),
              title="SPEAR: inputs recovered exactly (error <= 1e-4)")
    seconds.set(xlabel="batch size B", ylabel="seconds per target", title="time (recovery and image rebuild)")
    for axes in (share, seconds):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="4,8,16,24,32", help="comma-separated batch sizes")
    parser.add_argument("--targets", type=int, default=2, help="clients attacked per batch size and model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("spear.png"), help="the figure (PNG)")
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1 or args.targets < 1:
        print(f"error: --batches needs positive integers (got {args.batches!r}) and --targets at least 1",
              file=sys.stderr)
        raise SystemExit(2)
    if not args.out.parent.is_dir():
        print(f"error: --out {args.out}: its folder does not exist", file=sys.stderr)
        raise SystemExit(2)
    import torch

    from fedecouple.errors import UserError

    torch.set_num_threads(1)
    rows = []
    for arch in MODELS:
        for batch in batches:
            try:
                summary = attack(arch, batch, args.targets, args.seed)
            except UserError as exc:
                print(f"error: {exc}", file=sys.stderr)
                raise SystemExit(2) from None
            rows.append(row(arch, batch, summary))
            print(show(rows[-1]), flush=True)
    plot(rows, args.out)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
