"""How long ``fedsec --help`` and ``fedsec <command> --help`` take, as a user sees it: each a fresh
process (the interpreter's start included), run several times; prints the median and the range.

    python bench/cli_start.py [--runs 5] [COMMAND ...]

With no COMMAND it times the top-level help and every command's. The target is under 1 s on a
2-core machine: the help reads names from ``fedsec.catalog`` and imports no torch.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = ["", "train", "compare", "attack", "audit", "report", "defend", "mia", "flower attack", "flower audit"]


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedsec.cli", *args, "--help"], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("commands", nargs="*", default=COMMANDS)
    args = parser.parse_args()
    print(f"{'command':<30} {'median s':>9} {'min s':>7} {'max s':>7}  ({args.runs} runs, python {sys.version.split()[0]})")
    for command in args.commands:
        times = [timed(command.split()) for _ in range(args.runs)]
        print(f"{('fedsec ' + command).strip() + ' --help':<30} {statistics.median(times):9.2f} {min(times):7.2f} "
              f"{max(times):7.2f}")


if __name__ == "__main__":
    main()
