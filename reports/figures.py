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

    ``panels``: (truth (C, H, W) tensor, reconstruction (C, H, W) tensor, PSNR in dB, caption). The images
    are tiled into one picture drawn on one axes (an axes per image made a report of many attacks spend
    most of its time laying out figures)."""
    import numpy as np
    from matplotlib.figure import Figure

    n = max(len(panels), 1)
    channels, height, width = panels[0][0].shape if panels else (1, 8, 8)
    gap = max(1, round(0.12 * max(height, width)))
    canvas = np.ones((2 * height + gap, n * width + (n - 1) * gap, 3))
    for col, (truth, recon, _, _) in enumerate(panels):
        x = col * (width + gap)
        for row, image in enumerate((truth, recon)):
            tile = image.detach().float().clamp(0, 1).cpu().numpy()
            y = row * (height + gap)
            canvas[y:y + height, x:x + width] = np.moveaxis(tile if channels == 3 else tile[:1].repeat(3, 0), 0, -1)
    # inches: the tiles 1.3 wide each; room for the row labels (left), captions and title (top), PSNR (bottom)
    image_width = 1.6 * n - 0.3
    image_height = image_width * canvas.shape[0] / canvas.shape[1]
    left, right, bottom, top = 0.45, 0.15, 0.35, 0.65
    fig_width = max(left + image_width + right, 0.08 * len(title) + 0.4)
    fig_height = bottom + image_height + top
    fig = Figure(figsize=(fig_width, fig_height))
    ax = fig.add_axes((left / fig_width, bottom / fig_height, (fig_width - left - right) / fig_width,
                       image_height / fig_height))
    ax.imshow(canvas, interpolation="nearest", vmin=0, vmax=1)
    ax.set_axis_off()
    for col, (_, _, psnr, caption) in enumerate(panels):
        centre = col * (width + gap) + (width - 1) / 2
        ax.text(centre, -0.04 * height - 0.5, caption, ha="center", va="bottom", fontsize=8)
        ax.text(centre, 2 * height + gap - 0.5 + 0.04 * height, "inf dB" if math.isinf(psnr) else f"{psnr:.1f} dB",
                ha="center", va="top", fontsize=9)
    ax.text(-0.5 - 0.06 * width, (height - 1) / 2, "truth", rotation=90, ha="right", va="center", fontsize=9)
    ax.text(-0.5 - 0.06 * width, height + gap + (height - 1) / 2, "reconstruction", rotation=90, ha="right",
            va="center", fontsize=9)
    if not panels:
        ax.text((width - 1) / 2, height + gap / 2, "nothing to show", ha="center", va="center")
    fig.suptitle(title, fontsize=10, y=1 - 0.08 / fig_height, va="top")
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
