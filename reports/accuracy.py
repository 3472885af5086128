"""The accuracy table of ``fedsec compare``: pure rendering (a frame in, Markdown out)."""
from __future__ import annotations

import numpy as np
import pandas as pd


def accuracy_markdown(frame: pd.DataFrame, methods: list[str]) -> str:
    """Per method: the seeds, mean ± std over seeds of the per-run mean client accuracy (sample std,
    ddof = 1), and the mean per-client std. ``frame``: method, seed, mean_accuracy, std_accuracy."""
    lines = ["| method | seeds | accuracy (%) mean ± std over seeds | mean per-client std (%) |",
             "|---|---|---|---|"]
    for m in methods:
        sub = frame[frame["method"] == m]
        if sub.empty:
            continue
        acc = sub["mean_accuracy"].to_numpy(dtype=float) * 100
        spread = sub["std_accuracy"].to_numpy(dtype=float) * 100
        cell = f"{acc.mean():.2f} ± {acc.std(ddof=1):.2f}" if len(acc) > 1 else f"{acc.mean():.2f}"
        lines.append(f"| {m} | {', '.join(str(s) for s in sub['seed'])} | {cell} | {np.mean(spread):.2f} |")
    return "\n".join(lines) + "\n"
