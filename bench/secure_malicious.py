"""A malicious server through secure aggregation, and the clients' download-consistency check.

    python bench/secure_malicious.py [--seeds 5] [--rounds 20] [--out results/secure_malicious.json]

FedAvg on the embedded MNIST subset, the default CNN (cnn28), one local step per client (clients of
one batch), secure aggregation at the protocol's defaults unless a line says otherwise. It prints:

1. binning through the sum (``attacks.secure.sum_binning``): 10 clients x 10 images against binning
   on one client of the same 100 images without secure aggregation (one step on the batch of 100:
   the sum is that batch), the share of first-linear-layer inputs recovered exactly (relative error
   <= 1e-3, the nearest candidate), over ``--seeds`` draws of the clients' images; and the per-client
   craft through the sum (which the quantisation erases), the sized craft without the protocol, and
   the sized craft over a sweep of ``quantization_range`` 2**16 .. 2**30 (modulus 2**8 times it);
2. model inconsistency (``attacks.secure.inconsistency``): the target's images rebuilt from the sum
   against the same attack reading the target's upload without secure aggregation, paired per image
   (PSNR difference, mean and cluster-bootstrap interval over targets), beside the image rebuild's own
   scatter (the same inputs moved by 1e-7 of themselves: L-BFGS takes another path);
3. the consistency check (``defenses.consistency_check``): ``--rounds`` inconsistent and as many
   honest rounds under SecAgg (every pair neighbours), whether each was flagged and whether the
   target's update reached the sum; then what it does not catch: the ``neighbourhood`` craft (the
   target's masking-graph neighbours get its model) under SecAgg+ (30 clients, 4 neighbours) with
   the check on and off, and under SecAgg, where the server must send everyone the target's model.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attacks.malicious.craft import next_linear  # noqa: E402
from attacks.inversion.layer_inputs import relative_errors  # noqa: E402
from attacks.malicious.readout import recover_inputs, true_inputs  # noqa: E402
from attacks.metrics import psnr, rate_interval  # noqa: E402
from attacks.base import Budget  # noqa: E402
from attacks.secure import inconsistency, sized_binning, sum_binning  # noqa: E402
from attacks.secure.observation import RoundObservation  # noqa: E402
from attacks.statistics import clopper_pearson, cluster_bootstrap  # noqa: E402
from defenses.consistency_check import ConsistencyCheck  # noqa: E402
from fedecouple.channel import Interceptor, Recorder, ServerChannel  # noqa: E402
from fedecouple.data import load_dataset, make_partition  # noqa: E402
from fedecouple.data.partition import Partition  # noqa: E402
from fedecouple.engine import Federation, FederationConfig, GroundTruth  # noqa: E402
from fedecouple.methods import make_method  # noqa: E402
from fedecouple.methods.base import TrainConfig  # noqa: E402
from fedecouple.methods.facets import download_reach  # noqa: E402
from fedecouple.secure_aggregation import SecureAggregation  # noqa: E402
from fedsec.malicious import MaliciousServer, public_images  # noqa: E402

import attacks  # noqa: E402

EXACT = 1e-3
IMAGES = 10  # per client: one batch, one local step
LR = 0.05


@dataclass
class Run:
    """One federation as the bench drives it: the federation, its malicious server, the model at its
    initial weights."""

    fed: Federation
    server: MaliciousServer | None
    initial: torch.nn.Module

    def make_model(self):
        return copy.deepcopy(self.initial)


def build(data, partition: Partition, protocol, spec=None, craft=None, rounds: int = 1, batch: int = IMAGES,
          checks=(), seed: int = 0) -> Run:
    """A FedAvg federation of ``partition`` under ``protocol`` (None: off) whose malicious server
    crafts every participant's download of every round with ``spec``'s ``craft`` (None: honest);
    ``checks`` run last, on what reaches the clients."""
    train = TrainConfig(lr=LR, batch_size=batch, local_epochs=1)
    channel = ServerChannel([], recorder=Recorder(), secure=protocol)
    fed = Federation(make_method("fedavg"), data, partition, FederationConfig(rounds=rounds, seed=seed, train=train),
                     channel=channel, ground_truth=GroundTruth())
    initial = copy.deepcopy(fed.model)
    server = None
    if spec is not None:
        exclude = np.concatenate(partition.train)
        targets = {(r, c) for r in range(rounds) for c in fed.sample_clients(r)}
        server = MaliciousServer(spec, craft, targets, lambda: copy.deepcopy(initial),
                                 public_images(data.images, exclude, seed), download_reach(fed.method), seed,
                                 method=fed.method, train=train, secure=protocol)
        channel.interceptors.append(server)
    channel.interceptors.extend(checks)
    return Run(fed, server, initial)


def exact_share(candidates: torch.Tensor, truths: torch.Tensor) -> np.ndarray:
    """Per truth: whether some candidate is within ``EXACT`` relative error of it."""
    if len(candidates) == 0:
        return np.zeros(len(truths), dtype=bool)
    return relative_errors(candidates, truths).min(0).values.numpy() <= EXACT


def images_of(run: Run, round: int, clients) -> torch.Tensor:
    data, gt = run.fed.dataset, run.fed.ground_truth
    return torch.cat([data.images[torch.from_numpy(gt.samples(round, c))] for c in clients])


def plain_sum(run: Run, round: int) -> dict[str, torch.Tensor]:
    """Σ wᵢ·θᵢ and Σ wᵢ of the round's uploads, in float64, without the protocol."""
    ups = [u for u in run.fed.channel.recorder.uploads() if u.round == round]
    weights = [float(u.tensors["sample_count"]) / 1000.0 for u in ups]
    names = [k for k in ups[0].tensors if k != "sample_count"]
    total = {k: sum(w * u.tensors[k].double() for w, u in zip(weights, ups)) for k in names}
    total["sample_count"] = torch.tensor(sum(weights), dtype=torch.float64)
    return total


def binning_case(data, seed: int, craft: str, clients: int, protocol=None) -> np.ndarray:
    """Exact-input hits of one draw of 100 images: ``craft`` ("per-client" or "sized") sent to 10
    clients of 10 images, or to one client of the same 100 taking one step on them (module docstring)."""
    part = make_partition(data.labels.numpy(), 10, "iid", train_images=IMAGES, seed=seed)
    if clients == 1:
        part = Partition(part.scheme, part.num_classes, [np.concatenate(part.train)], [np.concatenate(part.test)])
    spec = attacks.get("binning") if craft == "per-client" else sum_binning.SPEC
    run = build(data, part, protocol, spec, "binning", batch=10 * IMAGES // clients, seed=seed)
    run.fed.run_round()
    record = run.server.records[(0, 0)]
    if protocol is None:
        total, error = plain_sum(run, 0), 0.0
    else:
        aggregate = run.fed.channel.recorder.aggregates[0]
        total, error = aggregate.total, len(aggregate.survivors) * aggregate.quantum
    truths = true_inputs(run.make_model(), record, images_of(run, 0, range(clients)))
    return exact_share(sized_binning.read_sum(record, total, error=error), truths)


def binning_figures(data, seeds: int) -> dict:
    """Part 1: the exact shares of each case, and the quantisation sweep."""
    cases = [("per-client", 1, None), ("sized", 1, None), ("per-client", 10, SecureAggregation()),
             ("sized", 10, None), ("sized", 10, SecureAggregation())]
    cases += [("sized", 10, SecureAggregation(quantization_range=2 ** q, modulus=2 ** (q + 8)))
              for q in range(16, 31, 2) if q != 22]
    out = []
    for craft, clients, protocol in cases:
        hits = [binning_case(data, s, craft, clients, protocol) for s in range(seeds)]
        flat, clusters = np.concatenate(hits), np.repeat(np.arange(seeds), [len(h) for h in hits])
        low, high = rate_interval(flat, clusters)
        row = {"craft": craft, "clients": clients, "images": len(flat),
               "secure": None if protocol is None else protocol.describe(),
               "exact_share": float(flat.mean()), "interval": [low, high]}
        out.append(row)
        where = "no secure aggregation" if protocol is None else \
            f"secure, quantization_range 2**{protocol.quantization_range.bit_length() - 1}"
        print(f"  {craft:10s} craft, {clients:2d} x {100 // clients:3d}, {where:34s} exact {100 * row['exact_share']:5.1f} % "
              f"[{100 * low:.1f}, {100 * high:.1f}]  n = {len(flat)}", flush=True)
    return {"cases": out}


class Plaintext(Interceptor):
    """The uploads as they leave the clients, before secure aggregation masks them: what a server
    without the protocol would read (the comparison's other arm; no attack reads it)."""

    name = "plaintext"

    def __init__(self) -> None:
        self.uploads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def on_upload(self, message):
        self.uploads[(message.round, message.client_id)] = {k: v.clone() for k, v in message.tensors.items()}
        return message


def observe(run: Run, round: int) -> RoundObservation:
    """The server's view of ``round`` under secure aggregation (``attacks.secure.observation``)."""
    recorder, fed = run.fed.channel.recorder, run.fed
    record = recorder.aggregates[round]
    crafted = {c: rec for (r, c), rec in run.server.records.items() if r == round}
    downloads = {c: dict(recorder.get(round, c).download.tensors) for c in record.participants}
    return RoundObservation(fed.method, round, record.participants, record.survivors, record.dropped, record.total,
                            recorder.secure.max_weight, downloads, run.make_model,
                            tuple(fed.dataset.images.shape[1:]), fed.dataset.num_classes, quantum=record.quantum,
                            aborted=record.aborted, crafted=crafted)


def nearest_psnr(images: torch.Tensor, inputs: torch.Tensor, truth_inputs: torch.Tensor,
                 truths: torch.Tensor) -> np.ndarray:
    """Per truth image: the PSNR of the image rebuilt from the candidate input nearest its own."""
    nearest = relative_errors(inputs, truth_inputs).argmin(0).numpy()
    return np.array([psnr(images[k], truths[j]) for j, k in enumerate(nearest)])


def inconsistency_target(data, seed: int, iterations: int) -> dict:
    """One model-inconsistency round (10 clients x 10 images): the target's images from the sum, and
    from its own upload as a server without the protocol would read it."""
    part = make_partition(data.labels.numpy(), 10, "iid", train_images=IMAGES, seed=seed)
    plain = Plaintext()
    run = build(data, part, SecureAggregation(), inconsistency.SPEC, "isolate", seed=seed)
    run.fed.channel.interceptors.insert(0, plain)
    run.fed.run_round()
    result = inconsistency.inconsistency(observe(run, 0), Budget(iterations=iterations), seed)
    target = result.trace["clients"][0]
    record = run.server.records[(0, target)].binning
    truths = images_of(run, 0, [target])
    truth_inputs = true_inputs(run.make_model(), record, truths)
    direct = recover_inputs(record, plain.uploads[(0, target)])
    shape = tuple(truths.shape[1:])
    images = sized_binning.rebuild_each(run.make_model, record, direct, shape, iterations, seed)
    # the control: the same inputs moved by 1e-7 of themselves, the optimiser's own scatter at that distance
    moved = direct * (1 + 1e-7 * torch.randn(direct.shape, generator=torch.Generator().manual_seed(seed)))
    control = sized_binning.rebuild_each(run.make_model, record, moved, shape, iterations, seed)
    near_sum = relative_errors(result.variables["inputs"], truth_inputs).argmin(0)
    near_plain = relative_errors(direct, truth_inputs).argmin(0)
    gap = (result.variables["inputs"][near_sum].double() - direct[near_plain].double()).norm(dim=1) / \
        direct[near_plain].double().norm(dim=1)
    return {"target": target, "weight": result.trace["target_weight"], "input_gap": gap.numpy(),
            "exact_sum": exact_share(result.variables["inputs"], truth_inputs),
            "exact_plain": exact_share(direct, truth_inputs),
            "psnr_sum": nearest_psnr(result.images, result.variables["inputs"], truth_inputs, truths),
            "psnr_plain": nearest_psnr(images, direct, truth_inputs, truths),
            "psnr_control": nearest_psnr(control, moved, truth_inputs, truths)}


def inconsistency_figures(data, seeds: int, iterations: int) -> dict:
    """Part 2: paired PSNR of the target's images, with and without secure aggregation."""
    rows = [inconsistency_target(data, s, iterations) for s in range(seeds)]
    diff = np.concatenate([r["psnr_sum"] - r["psnr_plain"] for r in rows])
    scatter = np.concatenate([r["psnr_control"] - r["psnr_plain"] for r in rows])
    gap = np.concatenate([r["input_gap"] for r in rows])
    clusters = np.repeat(np.arange(seeds), [len(r["psnr_sum"]) for r in rows])
    low, high = cluster_bootstrap(diff, clusters, np.mean)
    c_low, c_high = cluster_bootstrap(scatter, clusters, np.mean)
    with_sa, without = np.concatenate([r["psnr_sum"] for r in rows]), np.concatenate([r["psnr_plain"] for r in rows])
    exact_sa, exact_plain = np.concatenate([r["exact_sum"] for r in rows]), np.concatenate([r["exact_plain"] for r in rows])
    out = {"images": len(diff), "targets": seeds, "psnr_sum_mean": float(with_sa.mean()),
           "psnr_plain_mean": float(without.mean()), "psnr_difference_mean": float(diff.mean()),
           "psnr_difference_interval": [float(low), float(high)], "max_abs_difference": float(np.abs(diff).max()),
           "exact_sum": float(exact_sa.mean()), "exact_plain": float(exact_plain.mean()),
           "target_weights": [r["weight"] for r in rows], "input_gap_median": float(np.median(gap)),
           "control_difference_mean": float(scatter.mean()), "control_difference_interval": [c_low, c_high],
           "control_max_abs_difference": float(np.abs(scatter).max())}
    print(f"  target's images, n = {len(diff)} over {seeds} targets: through the sum {with_sa.mean():.2f} dB, "
          f"its own upload without secure aggregation {without.mean():.2f} dB; paired difference "
          f"{diff.mean():+.3f} dB [{low:+.3f}, {high:+.3f}], largest |difference| {np.abs(diff).max():.3f} dB", flush=True)
    print(f"  the optimiser's own scatter (its inputs moved by 1e-7): {scatter.mean():+.3f} dB [{c_low:+.3f}, "
          f"{c_high:+.3f}], largest |difference| {np.abs(scatter).max():.3f} dB", flush=True)
    print(f"  exact inputs: {100 * exact_sa.mean():.1f} % through the sum, {100 * exact_plain.mean():.1f} % without; "
          f"the two readouts differ by a median {np.median(gap):.1e} of the input", flush=True)
    return out


def check_rounds(data, protocol, clients: int, rounds: int, craft: str | None, check: bool, seed: int = 0) -> dict:
    """``rounds`` rounds of ``clients`` clients under ``protocol`` with the ``craft`` of model
    inconsistency every round (None: an honest server) and the consistency check on or off: per round,
    whether it was flagged, the target's update reached the sum, and its inputs read exactly."""
    part = make_partition(data.labels.numpy(), clients, "iid", train_images=IMAGES, seed=seed)
    checks = [ConsistencyCheck(protocol)] if check else []
    spec = inconsistency.SPEC if craft else None
    run = build(data, part, protocol, spec, craft, rounds=rounds, checks=checks, seed=seed)
    flagged, in_sum, exact, aborted = [], [], [], 0
    for r in range(rounds):
        run.fed.run_round()
        flagged.append(bool(checks) and r in checks[0].flagged_rounds())
        if craft is None:
            continue
        obs = observe(run, r)
        target, record = inconsistency.target_record(obs.crafted)
        aborted += bool(obs.aborted)
        in_sum.append(target in obs.survivors and not obs.aborted)
        if in_sum[-1]:
            inputs, _ = inconsistency.read_isolated(record, obs.total, next_linear(run.make_model(), record.layer),
                                                    len(obs.survivors) * obs.quantum)
            truth_inputs = true_inputs(run.make_model(), record, images_of(run, r, [target]))
            exact.append(exact_share(inputs, truth_inputs))
    return {"rounds": rounds, "flagged": int(sum(flagged)), "flagged_interval": list(clopper_pearson(sum(flagged), rounds)),
            "target_in_sum": int(sum(in_sum)), "aborted": aborted,
            "target_exact_share": float(np.concatenate(exact).mean()) if exact else None,
            "target_images_in_sum": int(sum(len(e) for e in exact))}


def check_figures(data, rounds: int) -> dict:
    """Part 3: detection and false alarms under SecAgg, then the neighbourhood craft."""
    secagg, plus = SecureAggregation(), SecureAggregation(num_shares=5)  # 4 neighbours
    cases = [("isolate, SecAgg, 10 clients, check on", secagg, 10, "isolate", True),
             ("honest server, SecAgg, 10 clients, check on", secagg, 10, None, True),
             ("isolate, SecAgg, 10 clients, check off", secagg, 10, "isolate", False),
             ("neighbourhood, SecAgg+ k=4, 30 clients, check on", plus, 30, "neighbourhood", True),
             ("neighbourhood, SecAgg+ k=4, 30 clients, check off", plus, 30, "neighbourhood", False),
             ("neighbourhood, SecAgg, 10 clients, check on", secagg, 10, "neighbourhood", True)]
    out = {}
    for name, protocol, clients, craft, check in cases:
        row = check_rounds(data, protocol, clients, rounds, craft, check)
        out[name] = row
        low, high = row["flagged_interval"]
        line = f"  {name:50s} " + (f"flagged {row['flagged']}/{rounds} [{100 * low:.0f}, {100 * high:.0f}] %, "
                                   if check else "")
        if craft is not None:
            share = row["target_exact_share"]
            line += (f"target's update in the sum {row['target_in_sum']}/{rounds} (aborted {row['aborted']})"
                     + ("" if share is None else f", its inputs exact {100 * share:.1f} % of "
                                                 f"{row['target_images_in_sum']}"))
        print(line.rstrip(", "), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="draws of the clients' images (targets in part 2)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of each consistency-check case")
    parser.add_argument("--iterations", type=int, default=attacks.ATTACKS.facts("sum-binning")["default_iterations"],
                        help="L-BFGS steps rebuilding the target's images")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run (module docstring)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset("mnist5k")
    print(f"$ python bench/secure_malicious.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread; FedAvg, mnist5k, cnn28, lr {LR}, "
          f"one local step per client; exact: relative error <= {EXACT:g}")
    start, figures = time.perf_counter(), {}
    parts = {p.strip() for p in args.parts.split(",")}
    if "1" in parts:
        print("1. binning: share of first-linear-layer inputs recovered exactly (95 % interval over draws)")
        figures["binning"] = binning_figures(data, args.seeds)
    if "2" in parts:
        print("2. model inconsistency: the target's images, through the sum vs its own upload")
        figures["inconsistency"] = inconsistency_figures(data, args.seeds, args.iterations)
    if "3" in parts:
        print(f"3. consistency check, {args.rounds} rounds each (flagged: some client saw a mismatch)")
        figures["check"] = check_figures(data, args.rounds)
    print(f"{time.perf_counter() - start:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1, default=float), encoding="utf-8")


if __name__ == "__main__":
    main()
