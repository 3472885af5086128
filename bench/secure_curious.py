"""What a curious server learns under secure aggregation (SecAgg+): the round-level attacks of
``attacks.secure`` on FedAvg, 10 clients that each train one step on one image per round.

The clients hold exactly one training image each (``--train-images 1``; batch size 10, one epoch: one
SGD step on that image per round). That keeps a client's label counts and image the same in every
round, which gradient disaggregation needs; the victim setting (``--victim-batch``) would put only the
attacked rounds' clients on a chosen image and leave the other rounds of the window on their real data.

Printed, each with the ``fedsec`` command that measured it:

1. ``sum-labels``: in how many of 20 rounds the round's label histogram (over the 10 images) is exact,
   with a Clopper–Pearson interval, and the mean count error;
2. ``sum-inversion``: the union-batch inversion of rounds 0–4 (50 images): mean PSNR with its interval
   (clients resampled) against the prior (the data set's mean image), and the mean gap PSNR − prior
   with a bootstrap interval;
3. ``sum-disaggregation`` over 20 rounds with half the clients per round (``--join-ratio 0.5``): the share
   of per-client label counts recovered exactly, and the per-client attack on the recovered updates
   (iDLG's label, the closed-form image) against the same attack (``attacks.secure.disaggregation
   .attack_update``, same budget) on each client's true update in the same federation without secure
   aggregation (its last upload up to round 19): n clients, mean PSNR with bootstrap intervals, and the
   paired difference. Both sets of images are scored the same way: against their best match among the
   10 clients' images, one-to-one (``attacks.metrics.score_images``), paired by the matched client.

The protocol's ``--sa-max-weight`` is set to 1, the largest client weight here (what the parameter is
for); the same runs at Flower's default 1000 follow, since that scaling spends most of the
quantisation's resolution.

    python bench/secure_curious.py [--seed 0] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

BASE = ["--method", "fedavg", "--clients", "10", "--train-images", "1", "--threads", "1"]


def fedsec(args: list[str], out: Path) -> dict:
    """Run ``fedsec ARGS --out OUT`` in this process, print the command, return its summary."""
    from fedsec.cli import main

    argv = [*args, "--out", str(out)]
    print("$ fedsec " + shlex.join(argv), flush=True)
    try:
        main(argv)
    except SystemExit as exc:
        if exc.code:
            raise RuntimeError(f"fedsec exited with {exc.code}") from None
    return json.loads((out / "summary.json").read_text())


def interval(values, seed: int) -> str:
    from attacks.statistics import bootstrap_mean

    values = np.asarray(values, dtype=float)
    low, high = bootstrap_mean(values, seed=seed)
    return f"{values.mean():.2f} [{low:.2f}, {high:.2f}] (n = {len(values)})"


def sum_labels(folder: Path, seed: int, weight: str) -> None:
    summary = fedsec(["attack", "sum-labels", *BASE, "--secure-aggregation", "--sa-max-weight", weight, "--rounds",
                      "20", "--attack-rounds", ",".join(map(str, range(20))), "--seed", str(seed)],
                     folder / f"labels-{weight}")
    h = summary["histogram"]
    low, high = h["exact_rate_ci"]
    print(f"  round histogram exact in {h['exact_rounds']} of {h['rounds']} rounds [{100 * low:.0f}, {100 * high:.0f}] %; "
          f"count errors per round {h['count_errors']} (mean {h['mean_count_error']:.2f})")


def sum_inversion(folder: Path, seed: int, weight: str) -> None:
    import pandas as pd

    out = folder / f"inversion-{weight}"
    summary = fedsec(["attack", "sum-inversion", *BASE, "--secure-aggregation", "--sa-max-weight", weight,
                      "--attack-rounds", "0,1,2,3,4", "--seed", str(seed)], out)
    rows = pd.read_csv(out / "attack.csv")
    ci = summary["mean_psnr_ci"] or [float("nan")] * 2
    print(f"  mean PSNR {summary['mean_psnr']:.2f} dB [{ci[0]:.2f}, {ci[1]:.2f}] ({summary['interval_resamples']}) "
          f"vs prior {summary['mean_prior_psnr']:.2f} dB, n = {len(rows)} images")
    print(f"  PSNR - prior per image: {interval(rows['psnr'] - rows['prior_psnr'], seed)} dB; "
          f"label accuracy {summary['label_accuracy']:.2f}")


def true_updates(seed: int, iterations: int) -> tuple[list[dict], object]:
    """The per-client attack on each client's true update in the same federation without secure
    aggregation (its last upload up to round 19), scored as the harness scores the recovered ones."""
    import torch

    from attacks.metrics import score_images
    from attacks.secure.disaggregation import attack_update
    from fedecouple.channel import Recorder, ServerChannel
    from fedsec.runner import RunConfig, build_federation, prepare

    config = RunConfig.of(method="fedavg", clients=10, train_images=1, join_ratio=0.5, rounds=20, seed=seed, threads=1)
    prep = prepare(config)
    recorder = Recorder(rounds=None)
    fed = build_federation(prep, channel=ServerChannel(recorder=recorder))
    fed.run(20)
    images, labels, clients = [], [], []
    for c in range(10):
        r = max(r for (r, cid), ex in recorder.exchanges.items() if cid == c and ex.upload is not None)
        ex = recorder.get(r, c)
        model = fed.model_spec.build().cpu()
        names = [n for n, _ in model.named_parameters()]
        update = {n: ex.upload.tensors[n].double() - ex.download.tensors[n].double() for n in names}
        image, label, _ = attack_update(update, model, dict(ex.download.tensors), tuple(prep.dataset.images.shape[1:]),
                                        iterations)
        images.append(image)
        labels.append(label)
        clients.append(c)
    fed.close()
    idx = torch.tensor([int(prep.partition.train[c][0]) for c in range(10)])
    truths, truth_labels = prep.dataset.images[idx], prep.dataset.labels[idx]
    prior = prep.dataset.images.mean(dim=0)
    rows = [{"client": j, "psnr": row["psnr"], "prior_psnr": row["prior_psnr"], "label_ok": labels[i] == int(truth_labels[j])}
            for i, j, row in score_images("images", torch.stack(images), torch.tensor(labels), truths, truth_labels, prior)]
    return rows, prep


def disaggregation(folder: Path, seed: int, weight: str, baseline: list[dict] | None) -> None:
    import pandas as pd

    out = folder / f"disaggregation-{weight}"
    summary = fedsec(["attack", "sum-disaggregation", *BASE, "--secure-aggregation", "--sa-max-weight", weight,
                      "--join-ratio", "0.5", "--rounds", "20", "--attack-rounds", "19", "--seed", str(seed)], out)
    counts = summary["client_counts"]
    low, high = counts["exact_rate_ci"]
    print(f"  per-client label counts exact: {counts['exact']} of {counts['clients']} clients "
          f"[{100 * low:.0f}, {100 * high:.0f}] % ({counts['unresolved']} not determined)")
    rows = pd.read_csv(out / "attack.csv")
    print(f"  recovered updates: PSNR {interval(rows['psnr'], seed)} dB, prior {rows['prior_psnr'].mean():.2f} dB, "
          f"iDLG label accuracy {summary['label_accuracy']:.2f}")
    if baseline is None:
        return
    true = pd.DataFrame(baseline)
    print(f"  true updates without secure aggregation: PSNR {interval(true['psnr'], seed)} dB, "
          f"iDLG label accuracy {true['label_ok'].mean():.2f}")
    paired = rows.set_index("client")["psnr"].sub(true.set_index("client")["psnr"]).dropna()
    print(f"  paired difference (recovered - true) by matched client: {interval(paired, seed)} dB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here [a temporary folder]")
    args = parser.parse_args(argv)
    import attacks

    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or Path(scratch)
        print("== 1. sum-labels: the round's label histogram", flush=True)
        sum_labels(folder, args.seed, "1")
        print("== 2. sum-inversion: the round's sum as one batch of 10 images", flush=True)
        sum_inversion(folder, args.seed, "1")
        print("== 3. sum-disaggregation: 20 rounds, half the clients per round", flush=True)
        print("$ (baseline) the same per-client attack on each client's true update, same federation without "
              "--secure-aggregation", flush=True)
        baseline, _ = true_updates(args.seed, attacks.ATTACKS.facts("sum-disaggregation")["default_iterations"])
        disaggregation(folder, args.seed, "1", baseline)
        print("== at Flower's default --sa-max-weight 1000", flush=True)
        sum_labels(folder, args.seed, "1000")
        disaggregation(folder, args.seed, "1000", baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
