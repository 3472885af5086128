"""A malicious SecAgg+ server on Flower's simulation of ``examples/flower_secagg``: how precise the update it
unmasks is, and what each client defence stops.

1. ``fedsec flower attack unmask-dropout examples/flower_secagg --nodes 8 --iterations 1000``, once as the app
   ships (max weight 2000) and once with ``--run-config 'max-weight=1.0'`` (the nodes' sample count, as
   Flower's documentation advises). Round 0 in the textbook setting: one SGD step on one image per node. For
   each it prints the relative error of the unmasked parameters against the node's true ones and of their
   change from the download (medians over the nodes), IG's mean PSNR on the unmasked and on the true update
   with 95 % intervals over the targets, and their paired difference with its interval and n.
2. The defence matrix, with ``--image-attack none`` (only whether the target was unmasked): ``unmask-dropout``
   and ``key-substitution`` on 4 nodes, ``split-view`` on 5 nodes with 5 shares (threshold 2: two disjoint
   groups fit), each with ``--client-defense none``, ``unmask-check`` and ``signed-consistency``; and ``sybil``
   on 5 nodes, 2 of them the server's, over rounds 0-2 (0, 1 and 2 sybil neighbours of the target) behind
   ``signed-consistency``, the strongest check (no client check can tell a sybil from a node). The matrix's
   ``unmask-dropout`` without a defence is the first run of part 1 (8 nodes).

Each run is the command line in its own process (Ray's simulation engine does not restart cleanly in one).
About 7 minutes on 2 cores; ``--no-matrix`` runs part 1 alone.

    python bench/flower_malicious.py [--nodes 8] [--iterations 1000] [--no-matrix]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = "examples/flower_secagg"
DEFENCES = ("none", "unmask-check", "signed-consistency")
# (attack, extra arguments): the settings in which each attack is feasible at all
MATRIX = [("unmask-dropout", ["--nodes", "4"]),
          ("split-view", ["--nodes", "5", "--run-config", "num-shares=5"]),
          ("key-substitution", ["--nodes", "4"])]
SYBIL = ("sybil", ["--nodes", "5", "--sybils", "2"])


def fedsec_flower(args: list[str], out: Path) -> dict:
    """Run ``fedsec flower attack ARGS`` in a process of its own; print the command (without its scratch
    folder) and return its summary."""
    print("$ fedsec flower attack " + shlex.join(args), flush=True)
    exe = Path(sys.executable).with_name("fedsec")
    head = [str(exe)] if exe.exists() else [sys.executable, "-c", "from fedsec.cli import main; main()"]
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([*head, "flower", "attack", *args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = next((x.strip() for x in reversed((done.stdout + done.stderr).splitlines()) if x.strip()), "no output")
        raise SystemExit(f"fedsec flower attack {args[0]} failed (exit {done.returncode}): {last}")
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


def _ci(pair, sign: str = "") -> str:
    return f"[{pair[0]:{sign}.2f}, {pair[1]:{sign}.2f}]" if pair and None not in pair else "[n/a]"


def precision(summary: dict, label: str) -> None:
    """Part 1's lines for one run."""
    rel, delta = summary.get("relative_error") or {}, summary.get("delta_relative_error") or {}
    print(f"{label}: unmasked {summary['recovered']} of {summary['targets']}", flush=True)
    if rel:
        bound = "within" if summary.get("within_bound") else "NOT within"
        print(f"  relative error of the parameters: median {rel['median']:.2g} (max {rel['max']:.2g}, {bound} the "
              f"quantisation bound); of their change from the download: median {delta['median']:.2g}")
    image = summary.get("image_attack")
    if image:
        un, true, paired = image["unmasked_update"], image["plain_update"], image["paired_psnr_difference"]
        print(f"  {image['attack']} on the unmasked update: mean PSNR {un['mean_psnr']:.2f} dB "
              f"{_ci(un['mean_psnr_ci'])}; on the true update: {true['mean_psnr']:.2f} dB {_ci(true['mean_psnr_ci'])}; "
              f"prior {un['mean_prior_psnr']:.2f} dB")
        print(f"  paired difference (unmasked - true): {paired['mean_difference']:+.2f} dB "
              f"{_ci(paired['ci'], '+')}, n = {paired['n_pairs']}")


def outcome(summary: dict, nodes: str) -> str:
    """Whether the target was unmasked, whether the round completed, and how many nodes refused."""
    refused = sum(len(v) for v in (summary.get("refusals") or {}).values())
    rounds = summary.get("attack_rounds") or []
    done = summary.get("rounds_completed") or []
    text = f"{nodes} nodes: unmasked {summary['recovered']} of {summary['targets']}"
    if summary.get("leakage"):  # sybil: one line per round, by the target's sybil neighbours
        text += "; " + ", ".join(f"round {x['round']} ({x['sybil_neighbours']} sybil neighbour"
                                 f"{'s' if x['sybil_neighbours'] != 1 else ''}): "
                                 f"{'unmasked' if x['unmasked'] else 'not unmasked'}" for x in summary["leakage"])
    text += f"; {refused} refusal{'s' if refused != 1 else ''}; "
    if len(rounds) == 1:
        return text + ("the round completed" if rounds[0] in done else "SecAgg+ halted: the round did not complete")
    return text + ("every round completed" if set(rounds) <= set(done) else
                   f"rounds completed: {', '.join(map(str, done)) or 'none'} of {', '.join(map(str, rounds))}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8, help="nodes of part 1's runs")
    parser.add_argument("--iterations", type=int, default=1000, help="IG's steps in part 1")
    parser.add_argument("--no-matrix", action="store_true", help="skip part 2, the defence matrix")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flower-malicious-") as scratch:
        folder = Path(scratch)
        print(f"== 1. unmask-dropout, {args.nodes} nodes, IG {args.iterations} iterations, round 0 (one step on "
              f"one image per node)", flush=True)
        base = ["unmask-dropout", APP, "--nodes", str(args.nodes), "--iterations", str(args.iterations)]
        shipped = fedsec_flower(base, folder / "max-weight-2000")
        precision(shipped, f"max weight {shipped['protocol']['max_weight']:g} (the app's)")
        one = fedsec_flower([*base, "--run-config", "max-weight=1.0"], folder / "max-weight-1")
        precision(one, f"max weight {one['protocol']['max_weight']:g}")
        if not args.no_matrix:
            print("== 2. defence matrix (--image-attack none): was the target unmasked?", flush=True)
            rows = [("unmask-dropout", "none", outcome(shipped, str(args.nodes)) + " (part 1's first run)")]
            for attack, extra in MATRIX:
                for defence in DEFENCES:
                    if (attack, defence) == ("unmask-dropout", "none"):
                        continue
                    summary = fedsec_flower([attack, APP, *extra, "--client-defense", defence, "--image-attack",
                                             "none"], folder / f"{attack}-{defence}")
                    rows.append((attack, defence, outcome(summary, extra[1])))
            attack, extra = SYBIL
            summary = fedsec_flower([attack, APP, *extra, "--client-defense", "signed-consistency",
                                     "--image-attack", "none"], folder / "sybil")
            rows.append((attack, "signed-consistency", outcome(summary, extra[1])))
            for attack, defence, text in rows:
                print(f"  {attack:17s} {defence:19s} {text}")
    print(f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
