"""What the malicious-server section adds to ``fedsec report --preset audit``: its stages alone
(``trap`` at the preset's client sizes, the download check off and on, every method), run one after
the other as the report runs them, with the wall and CPU seconds of each.

    python bench/malicious_section.py [--methods fedecouple,fedper,fedpac,fedproto] [--out DIR]

The rest of the audit (its train, audit and honest-server attack stages) is not run: the section's
stages train their own one-round federations of clients of N images, so they cost the same inside
the audit as here. Stages already complete in ``--out`` are skipped (and cost nothing), as in a report.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    import torch

    from fedsec.jobs import report as rep
    from fedsec.jobs.report.stages import plan, run_stage
    from fedsec.runner import AUDIT_FEDERATION, RunConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(rep.DEFAULT_METHODS))
    parser.add_argument("--out", type=Path, default=Path("runs/malicious-section"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = RunConfig.of(dataset="mnist5k", threads=1, **AUDIT_FEDERATION)
    settings = rep.audit_preset()
    cells = settings.malicious_cells(rep.AUDIT_ATTACKS)
    stages = [s for s in plan(base, args.methods.split(","), {}, args.out, malicious=cells) if s.kind == "attack"]
    print("| method | stage | status | wall s | CPU s |\n|---|---|---|---:|---:|")
    totals = [0.0, 0.0]
    for stage in stages:
        if stage.resumable.complete():
            continue
        wall, cpu = time.perf_counter(), time.process_time()
        status, _ = run_stage(stage)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        totals[0] += wall
        totals[1] += cpu
        print(f"| {stage.method} | {stage.name} | {status} | {wall:.1f} | {cpu:.1f} |", flush=True)
    print(f"| all | {len(stages)} stages | | {totals[0]:.1f} | {totals[1]:.1f} |")


if __name__ == "__main__":
    main()
