"""Scoring a malicious server's read-back against the images the client trained on: each image's
crafted-layer input matched to a recovered one, and the shares recovered exactly."""
from __future__ import annotations

import torch

from ..metrics import input_shares, psnr, ssim
from ..inversion.layer_inputs import match_inputs
from .readout import true_inputs

# a recovered input counts as exact at or below this relative error
EXACT = 1e-3


def score_recovered(make_model, record, result, truths: torch.Tensor, truth_labels: torch.Tensor,
                    prior: torch.Tensor) -> list[dict]:
    """One row per image the client trained on (``AttackSpec.score_target``): its crafted-layer input
    (under ``record.sent``, at ``record.layer``) matched one-to-one to a recovered one
    (``result.variables["inputs"]``; relative error, inf where none was left), and the image rebuilt
    from that input scored against it (PSNR, SSIM, the prior's PSNR; an unmatched image is scored as
    the prior); no label is predicted."""
    truth_inputs = true_inputs(make_model(), record, truths)
    chosen, errors = match_inputs(result.variables["inputs"], truth_inputs)
    rows = []
    for j in range(len(truths)):
        rebuilt = result.images[chosen[j]] if chosen[j] >= 0 else prior
        rows.append({"truth_index": j, "reconstruction": int(chosen[j]), "input_error": float(errors[j]),
                     "psnr": psnr(rebuilt, truths[j]), "ssim": ssim(rebuilt, truths[j]),
                     "prior_psnr": psnr(prior, truths[j]), "label_true": int(truth_labels[j])})
    return rows


def input_statistics(rows: list[dict], seed: int) -> dict:
    """Shares of images whose crafted-layer input was recovered exactly (relative error ≤ 1e-3) and
    within 5 %, each with a 95 % interval that resamples attacked clients."""
    if not rows:
        return {"inputs_exact_share": None, "inputs_exact_share_ci": None}
    return {**input_shares(rows, seed, {"inputs_exact": lambda e, _: e <= EXACT,
                                        "inputs_within_5pct": lambda e, _: e <= 0.05}),
            "inputs_exact_rule": f"relative error of the recovered first-linear-layer input <= {EXACT:g}"}