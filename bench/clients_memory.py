"""Peak memory of one process simulating many clients: peak RSS after one round with 100 and with
1,000 clients (mnist5k, iid: 5 samples per client), for FedPer (keeps a personal head per client)
and FedeCouple (keeps its personal model {theta_i, phi_i} per client).

Each (method, clients) point runs in a fresh subprocess. Peak RSS is a high-water mark: on Linux it
is reset once torch and the data set are loaded, so it measures the federation and its round (the
phases: after the client updates, and with the round's uploads received, before aggregation).
The child also counts the bytes the federation keeps per client (``Federation.clients``) and what
the server channel's recorder remembers per client (nothing for a channel built without a recorder
of its own, as here), to check the RSS slope against them. The sequential backend is used (one process).
Last line: ``per_client_kib <(peak RSS at 1,000 - at 100) / 900, in KiB, largest over the methods>``.

    python bench/clients_memory.py [--methods fedper,fedecouple] [--sizes 100,1000]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def reset_peak() -> bool:
    """Reset the process's peak RSS to its current RSS (Linux: ``clear_refs`` 5), so the figure
    measures the federation, not loading torch and the data set. False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def child(method: str, clients: int, threads: int) -> dict:
    import torch

    from fedecouple.backends import SequentialBackend
    from fedecouple.data import load_dataset, make_partition
    from fedecouple.engine import Federation, FederationConfig
    from fedecouple.methods import make_method
    from fedecouple.methods.base import TrainConfig

    torch.set_num_threads(threads)
    ds = load_dataset("mnist5k")
    part = make_partition(ds.labels.numpy(), clients, "iid", seed=0)
    cfg = FederationConfig(rounds=1, seed=0, train=TrainConfig(lr=0.05, batch_size=10, local_epochs=1))
    process_peak = peak_kib()
    was_reset = reset_peak()
    phases = {}

    class Measured(SequentialBackend):
        def run_updates(self, *args):
            out = super().run_updates(*args)
            phases["updates_kib"] = peak_kib()
            return out

    method_obj = make_method(method)
    aggregate = method_obj.aggregate

    def measured_aggregate(*args):
        phases["uploads_kib"] = peak_kib()
        return aggregate(*args)

    method_obj.aggregate = measured_aggregate
    fed = Federation(method_obj, ds, part, cfg, backend=Measured())
    fed.run_round()
    peak = peak_kib()

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors.values())

    recorder = fed.channel.recorder
    kept_by_recorder = sum(nbytes(up.tensors) for hist in recorder._latest.values() for _, up in hist)
    return {"method": method, "clients": clients, "peak_rss_kib": peak, "peak_was_reset_after_loading": was_reset,
            "process_peak_before_federation_kib": process_peak, **phases,
            "client_state_bytes": sum(nbytes(s) for s in fed.clients.values()),
            "recorder_bytes": kept_by_recorder, "model_bytes": nbytes(dict(fed.model.named_parameters()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="fedper,fedecouple")
    ap.add_argument("--sizes", default="100,1000")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "CLIENTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.threads)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    slopes = {}
    for method in args.methods.split(","):
        points = []
        for n in sizes:
            out = subprocess.run([sys.executable, __file__, "--child", method, str(n), "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True).stdout
            points.append(json.loads(out.strip().splitlines()[-1]))
        for p in points:
            n = p["clients"]
            print(f"{method:>10} {n:>5} clients: peak RSS {p['peak_rss_kib'] / 1024:7.1f} MiB (after client updates "
                  f"{p.get('updates_kib', 0) / 1024:.1f}, uploads in {p.get('uploads_kib', 0) / 1024:.1f}); kept per "
                  f"client: state {p['client_state_bytes'] / n / 1024:.1f} KiB, server recorder "
                  f"{p['recorder_bytes'] / n / 1024:.1f} KiB (model {p['model_bytes'] / 1024:.1f} KiB)")
        lo, hi = points[0], points[-1]
        span = hi["clients"] - lo["clients"]
        slope = (hi["peak_rss_kib"] - lo["peak_rss_kib"]) / span
        kept = ((hi["client_state_bytes"] + hi["recorder_bytes"]) - (lo["client_state_bytes"] + lo["recorder_bytes"])) \
            / span / 1024
        slopes[method] = slope
        print(f"{method:>10} per added client: peak RSS {slope:.1f} KiB; after the updates "
              f"{(hi['updates_kib'] - lo['updates_kib']) / span:.1f} KiB, with the round's uploads "
              f"{(hi['uploads_kib'] - lo['uploads_kib']) / span:.1f} KiB; kept (state + recorder) {kept:.1f} KiB")
    if not all(p["peak_was_reset_after_loading"] for p in points):
        print("note: could not reset the peak after loading the data (no /proc/self/clear_refs): the 100-client "
              "peak may be the data loading's, which understates the slope")
    print(f"per_client_kib {max(slopes.values()):.1f}")


if __name__ == "__main__":
    main()
