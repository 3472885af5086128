"""Figures of reconstructions: pure rendering (tensors in, PNG bytes out; nothing touches the disk)."""
from __future__ import annotations

import io
import math

from .formatting import is_true


def png_bytes(fig, dpi: int) -> bytes:
    """A matplotlib ``Figure`` (object API, no pyplot) as PNG bytes, with no software tag, so the
    same figure gives the same bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def reconstruction_grid(panels: list[tuple], title: str) -> bytes:
    """Ground truth (top row) above reconstruction (bottom row), PSNR under each reconstruction.

    ``panels``: (truth (C, H, W) tensor, reconstruction (C, H, W) tensor, PSNR in dB, caption)."""
    from matplotlib.figure import Figure

    n = max(len(panels), 1)
    fig = Figure(figsize=(1.6 * n + 0.6, 3.8))
    axes = fig.subplots(2, n, squeeze=False)
    for col in range(n):
        for row in range(2):
            ax = axes[row][col]
            ax.set_xticks([])
            ax.set_yticks([])
            if col >= len(panels):
                ax.axis("off")
                continue
            truth, recon, psnr, caption = panels[col]
            img = (truth if row == 0 else recon).detach().clamp(0, 1)
            if img.shape[0] == 1:
                ax.imshow(img[0].numpy(), cmap="gray", vmin=0, vmax=1)
            else:
                ax.imshow(img.permute(1, 2, 0).numpy())
            if row == 0:
                ax.set_title(caption, fontsize=8)
            else:
                ax.set_xlabel("inf dB" if math.isinf(psnr) else f"{psnr:.1f} dB", fontsize=9)
    axes[0][0].set_ylabel("truth", fontsize=9)
    axes[1][0].set_ylabel("reconstruction", fontsize=9)
    if not panels:
        axes[0][0].text(0.5, 0.5, "nothing to show", ha="center", va="center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return png_bytes(fig, 110)


def _rounds_flagged(group, column: str, rounds):
    """The rounds where some row of ``group`` has ``column`` true (none without the column)."""
    if column not in group:
        return []
    flagged = group[column].map(is_true).groupby(rounds).any()
    return flagged[flagged].index


def leakage_by_round(results, psnr_cap_db: float) -> bytes:
    """Mean PSNR above the prior per attacked round, one line per method and image attack (results:
    the report's per-image rows: method, attack, round, psnr, prior_psnr, mis_specified, model_unknown);
    rounds where the attack was mis-specified on some target are crossed out, rounds where the server held
    no model of some target (NO MODEL: a surrogate-model estimate) are ringed with a dashed circle."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    rows = results.dropna(subset=["psnr", "prior_psnr"])
    flagged_label = "mis-specified (the attack's forward model was wrong)"
    estimate_label = "NO MODEL (estimate: the server holds no model of the client)"
    for (method, attack), group in rows.groupby(["method", "attack"], sort=False):
        gain = np.minimum(group["psnr"].astype(float), psnr_cap_db) - group["prior_psnr"].astype(float)
        rounds = group["round"].astype(int)
        by_round = gain.groupby(rounds).mean()
        ax.plot(by_round.index, by_round.values, marker="o", label=f"{method} ({attack})")
        if "mis_specified" in group:  # a point that says nothing about the method: crossed out
            wrong = group["mis_specified"].map(is_true).groupby(rounds).any()
            wrong = wrong[wrong].index
            if len(wrong):
                ax.scatter(wrong, by_round.loc[wrong].values, marker="x", s=80, color="black", zorder=4,
                           label=flagged_label)
                flagged_label = None
        unknown = _rounds_flagged(group, "model_unknown", rounds)
        if len(unknown):  # an estimate, not a wrong model: ringed, not crossed out
            ax.scatter(unknown, by_round.loc[unknown].values, marker="o", s=160, facecolors="none",
                       edgecolors="black", linestyles="--", zorder=4, label=estimate_label)
            estimate_label = None
    ax.axhline(0.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("attacked round")
    ax.set_ylabel("mean PSNR above the prior (dB)")
    ax.set_title("Leakage across training", fontsize=10)
    if len(rows):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig, 100)
