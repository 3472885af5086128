"""Time one FedeCouple round (20 clients, mnist5k, pathological K=3, 1 local epoch, batch 10) with
the Ray backend on 2 workers against the sequential backend: same run, same seed, and the script
checks that both end with identical metrics, server model and client states.

Both sides use ``--threads`` torch threads per update (default 1: bit-identical results need the
same thread count, and 2 workers x 1 thread fill 2 cores). Ray is started locally with
``--workers`` CPUs (workers at niceness 0, like the driver) and warmed up (worker processes started, torch imported) before timing; the
start-up time is printed separately. A round includes the driver's evaluation of every client,
which stays sequential under both backends; the updates alone are timed too.
Last line: ``ratio <ray round seconds / sequential round seconds>`` (target <= 0.6 on 2 cores).

    python bench/ray_speedup.py [--clients 20] [--workers 2] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from fedecouple.backends import Backend, RayBackend, SequentialBackend, import_ray, start_local_ray
from fedecouple.data import load_dataset, make_partition
from fedecouple.engine import Federation, FederationConfig
from fedecouple.methods import make_method
from fedecouple.methods.base import TrainConfig


class Timed(Backend):
    """Delegates to ``inner`` and remembers how long its last ``run_updates`` took."""

    def __init__(self, inner: Backend):
        self.inner, self.seconds = inner, 0.0

    def run_updates(self, *args):
        start = time.perf_counter()
        out = self.inner.run_updates(*args)
        self.seconds = time.perf_counter() - start
        return out


def one_round(ds, part, backend: Backend) -> tuple[Federation, float, float]:
    cfg = FederationConfig(rounds=1, seed=0, train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    timed = Timed(backend)
    fed = Federation(make_method("fedecouple"), ds, part, cfg, backend=timed)
    start, cpu = time.perf_counter(), time.process_time()
    fed.run_round()
    return fed, time.perf_counter() - start, timed.seconds, time.process_time() - cpu


def same(a: Federation, b: Federation) -> bool:
    rows = all(x == y or (np.isnan(x["accuracy"]) and np.isnan(y["accuracy"])) for x, y in zip(a.metrics, b.metrics))
    server = all(torch.equal(a.server[k], b.server[k]) for k in a.server)
    clients = all(torch.equal(a.clients[c][k], b.clients[c][k]) for c in a.clients for k in a.clients[c])
    return rows and len(a.metrics) == len(b.metrics) and server and clients and a.clients.keys() == b.clients.keys()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2, help="CPUs given to the local Ray (= parallel updates)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per update, both backends")
    ap.add_argument("--repeats", type=int, default=2, help="alternating timed repeats of each; the best is kept")
    args = ap.parse_args()
    ray = import_ray()
    torch.set_num_threads(args.threads)
    ds = load_dataset("mnist5k")
    part = make_partition(ds.labels.numpy(), args.clients, "pathological", classes_per_client=3, seed=0)

    start = time.perf_counter()
    start_local_ray(args.workers)  # as RayBackend does: workers at normal priority (Ray's default is nice 15)
    backend = RayBackend(threads=args.threads)
    backend.warm_up()
    startup = time.perf_counter() - start
    seq_best = ray_best = seq_upd = ray_upd = float("inf")
    load_before = os.getloadavg()[0]
    try:
        for _ in range(args.repeats):
            seq, t_seq, u_seq, cpu_seq = one_round(ds, part, SequentialBackend())
            par, t_ray, u_ray, _ = one_round(ds, part, backend)
            if not same(seq, par):
                raise SystemExit("Ray and sequential rounds differ: results must be identical")
            if t_seq < seq_best:
                seq_cpu = cpu_seq
            seq_best, ray_best = min(seq_best, t_seq), min(ray_best, t_ray)
            seq_upd, ray_upd = min(seq_upd, u_seq), min(ray_upd, u_ray)
    finally:
        backend.close()
        ray.shutdown()
    acc = np.mean([r["accuracy"] for r in seq.metrics])
    print(f"{args.clients} clients, fedecouple, 1 round (mean acc {acc:.4f}, identical under both backends); "
          f"torch threads per update {args.threads}; Ray start-up + warm-up {startup:.1f} s (not in the ratio)")
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs "
          f"(other jobs on the machine take CPUs from the workers)")
    print(f"sequential round {seq_best:.2f} s (updates {seq_upd:.2f} s, {seq_cpu:.2f} s CPU); "
          f"ray x{args.workers} round {ray_best:.2f} s (updates {ray_upd:.2f} s); updates ratio {ray_upd / seq_upd:.3f}")
    print(f"ratio {ray_best / seq_best:.3f}")


if __name__ == "__main__":
    main()
