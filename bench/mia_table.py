"""Print the membership-inference tables from `fedsec mia` output folders.

    python bench/mia_table.py [--attack lira] DIR [DIR ...]

One row per folder (its summary.json): AUC and TPR at 1 % FPR [95 % client-bootstrap interval]
of --attack on the personal, global and uploaded models, the server's update test, and the
empirical vs accounted ε where DP-SGD ran; then every attack's AUC on the personal models.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from reports.mia import METHOD_COLUMNS, metric_cell, markdown_table, method_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--attack", default="lira")
    args = parser.parse_args()
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in args.folders]
    print(markdown_table(method_rows(summaries, args.attack), METHOD_COLUMNS))
    attacks = ("loss", "entropy", "population", "rmia", "lira")
    rows = []
    for summary in summaries:
        name = summary["method"] + (" (DP)" if summary.get("dp") else "")
        rows.append({"method": name, **{a: metric_cell(summary, "personal", a, "auc") for a in attacks},
                     **{f"{a} TPR@1%": metric_cell(summary, "personal", a, "tpr_at_1pct_fpr") for a in attacks}})
    print()
    print(markdown_table(rows, ("method",) + attacks + tuple(f"{a} TPR@1%" for a in attacks)))


if __name__ == "__main__":
    main()
