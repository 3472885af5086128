"""Flower's own SecAgg+ recorded and attacked: ``examples/flower_secagg`` (legacy FedAvg under
``SecAggPlusWorkflow``, clients behind ``secaggplus_mod``) with 10 nodes and 3 rounds in Flower's
simulation engine, recorded by ``fedsec.flower.secagg``, in three settings:

* ``textbook``: every node takes one SGD step on 1 image in every round; the app's protocol values
  (Flower's defaults but max weight 2000);
* ``textbook, max weight 1``: the same with the max weight at the nodes' sample count (1), as Flower's
  documentation advises (a max weight far above it costs quantisation precision);
* ``local training``: the app's own training (one epoch on about 375 images per node).

For each it prints: the recording checked against the truth (the round's recorded aggregate against
the weighted average of every node's true parameters, replayed from the recorded downloads with the
app's own code: the largest error over the quantisation bound); what one masked upload shows (the
smallest chi-square p-value of uniformity over the modulus, the largest |correlation| with the node's
true parameters); and the curious server's round-level attack ``sum-labels`` on every round (the
round's label histogram exact in k of n rounds with a Clopper–Pearson interval, the mean count error
with a bootstrap interval). The masks come from Flower's key agreement (unseeded); the sums, and so
every figure but the uniformity and correlation, repeat bit for bit (the app seeds the quantisation).

    python bench/flower_secagg.py [--nodes 10] [--rounds 3] [--ray-cpus 2]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before Flower is first imported: no network calls

from attacks.base import Budget  # noqa: E402
from attacks.recorded import ThreatModel  # noqa: E402
from attacks.harness import attack_rounds  # noqa: E402
from fedsec.flower.harness import recorded_run  # noqa: E402
from fedsec.flower.secagg import uniformity  # noqa: E402
from fedsec.flower.simulation import simulate  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_secagg"


def settings(rounds: int) -> dict[str, dict]:
    every = ",".join(str(r) for r in range(1, rounds + 1))
    textbook = {"num-server-rounds": rounds, "victim-batch": 1, "victim-steps": 1, "victim-rounds": every}
    return {"textbook": textbook, "textbook, max weight 1": {**textbook, "max-weight": 1.0},
            "local training": {"num-server-rounds": rounds}}


def replay(run, nodes: int) -> dict:
    """Each recorded (round, client)'s true update with the app's own code: (weights, count, loss)."""
    from secagg_mnist import task  # the app directory is on sys.path once ``simulate`` ran

    names = [n for n, _ in task.build_model(run.run_config).named_parameters()]
    return {(r, c): task.local_update([ex.download.tensors[n].numpy() for n in names], c, nodes, r + 1, run.run_config)
            for (r, c), ex in sorted(run.recorder.exchanges.items())}, names


def aggregate_error(run, truth: dict, names: list[str]) -> tuple[float, float]:
    """The largest |recorded weighted average - true weighted average| over every round and value, and
    the largest quantisation bound (len(survivors) * quantum / summed weight) it is held to."""
    protocol = run.recorder.secure
    worst, bound = 0.0, 0.0
    for r, record in run.recorder.aggregates.items():
        updates = [truth[r, c] for c in record.survivors]
        weights = [round(n / protocol.max_weight * protocol.quantization_range) / protocol.quantization_range
                   for _, n, _ in updates]
        bound = max(bound, len(updates) * record.quantum / sum(weights))
        for i, name in enumerate(names):
            exact = sum(w * np.asarray(u[0][i], dtype=np.float64) for w, u in zip(weights, updates)) / sum(weights)
            recorded = (record.total[name] / record.total["sample_count"]).numpy()
            worst = max(worst, float(np.abs(recorded - exact).max()))
    return worst, bound


def correlation(run, truth: dict) -> tuple[float, int]:
    """The largest |Pearson r| between a masked upload and its node's true parameters, and how many
    values each has."""
    out, n = 0.0, 0
    for key, exchange in run.recorder.exchanges.items():
        plain = np.concatenate([np.asarray(w, dtype=np.float64).reshape(-1) for w in truth[key][0]])
        masked = exchange.upload.tensors["masked"].numpy()[1:].astype(np.float64)
        out, n = max(out, abs(float(np.corrcoef(masked, plain)[0, 1]))), len(plain)
    return out, n


def measure(name: str, config: dict, nodes: int, ray_cpus: int) -> None:
    start = time.perf_counter()
    run = simulate(EXAMPLE, nodes=nodes, run_config=config, threads=1, ray_cpus=ray_cpus)
    simulated = time.perf_counter() - start
    truth, names = replay(run, nodes)
    worst, bound = aggregate_error(run, truth, names)
    rounds = sorted(run.recorder.aggregates)
    outcome = attack_rounds(recorded_run(run), "sum-labels", rounds, ThreatModel(), Budget(iterations=1), seed=0,
                            progress=False)
    hist = outcome.summary.statistics["histogram"]
    images = sum(row["true_count"] for row in outcome.rows) / len(rounds)
    ci, err_ci = hist["exact_rate_ci"], hist["mean_count_error_ci"] or (float("nan"), float("nan"))
    p, (r_max, values) = run.recorder.secure, correlation(run, truth)
    print(f"\n{name}: {nodes} nodes, {len(rounds)} rounds, protocol: clipping {p.clipping_range:g}, "
          f"{p.quantization_range} steps, modulus {p.modulus}, max weight {p.max_weight:g}, "
          f"{'all pairs' if p.num_shares == 1.0 else f'{p.num_shares} shares'}; simulation {simulated:.1f} s")
    print(f"  recorded: {len(run.recorder.exchanges)} masked uploads; survivors per round "
          f"{[len(run.recorder.aggregates[r].survivors) for r in rounds]}")
    print(f"  aggregate vs true weighted average: largest error {worst:.3g} (bound {bound:.3g}; "
          f"{'within' if worst <= bound else 'OUTSIDE'})")
    print(f"  one masked upload: smallest uniformity p {min(uniformity(run.recorder)):.3g} over "
          f"{len(run.recorder.exchanges)}; largest |r| with the true parameters {r_max:.4f} "
          f"(4/sqrt(n) = {4 / math.sqrt(values):.4f}, n = {values})")
    print(f"  sum-labels: histogram exact in {hist['exact_rounds']} of {hist['rounds']} rounds "
          f"(95 % CI {ci[0]:.2f}-{ci[1]:.2f}); mean count error {hist['mean_count_error']:.2f} "
          f"[{err_ci[0]:.2f}, {err_ci[1]:.2f}] of {images:.0f} images per round; per round {hist['count_errors']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ray-cpus", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("command: python bench/flower_secagg.py " + " ".join(sys.argv[1:]))
    for name, config in settings(args.rounds).items():
        measure(name, config, args.nodes, args.ray_cpus)


if __name__ == "__main__":
    main()
