"""The verdict rules, in one place: when a reconstructed image counts as recovered (the success
rule), when measured leakage is at chance level (the leak gap), when a label attack's class-presence
accuracy is low (the presence threshold), and the forward-model check in words, NO MODEL included: a target whose server holds no
model of the client (FedProto uploads prototypes only), so that its figure is a surrogate-model
estimate and the forward check does not apply (``model_unknown``), kept apart from MIS-SPECIFIED (the
attack's model of what the server does hold was wrong).

Read by the attacks' scoring (``attacks.metrics``), the audit's severities (``fedsec.jobs.audit``), the
report (``fedsec.jobs.report``) and the console (``fedsec.console``). ``reports`` imports nothing of
``attacks``: it receives what these rules decided (the report's ``<cell>_lower_bound`` flags, the
``success_rule`` and ``leak_gap_db`` values in its ``meta``). Standard library only.
"""
from __future__ import annotations

import math
from typing import Any

# an image counts as recovered when its PSNR is this far above the prior's on that image
SUCCESS_MARGIN_DB = 6.0
SUCCESS_SSIM = 0.5
SUCCESS_RULE = f"PSNR at least {SUCCESS_MARGIN_DB:g} dB above the prior (the data set's mean image) on that image"
SUCCESS_RULE_SSIM = f"SSIM at least {SUCCESS_SSIM:g}"
# measured leakage less than this far above the prior is at chance level: a finding's severity "low"
LEAK_GAP_DB = 3.0
# a label attack's class-presence accuracy below this does not make labels inferable: "low"
PRESENCE_THRESHOLD = 0.8


def _number(x: Any) -> float | None:
    """A finite float, or None for anything else (missing, text, NaN, infinite): table cells are loose."""
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def psnr_gap(summary: dict | None) -> float | None:
    """Mean PSNR minus mean prior PSNR of an attack summary (None when not measured)."""
    mean, prior = _number((summary or {}).get("mean_psnr")), _number((summary or {}).get("mean_prior_psnr"))
    return None if mean is None or prior is None else mean - prior


def model_unknown_targets(summary: dict | None) -> int | None:
    """How many targets of an attack summary were attacked with a model the server does not hold for
    that client (``model_unknown`` in the forward check): the summary's ``model_unknown_targets`` when
    it has one, else counted over its ``per_target`` checks; None when no target says either way."""
    summary = summary or {}
    given = _number(summary.get("model_unknown_targets"))
    if given is not None:
        return int(given)
    flags = [t.get("model_unknown") for t in summary.get("per_target") or [] if isinstance(t, dict)]
    flags = [f for f in flags if f is not None]
    return sum(bool(f) for f in flags) if flags else None


def at_chance(summary: dict | None) -> bool | None:
    """Whether an attack's measured leakage is at chance level (within LEAK_GAP_DB of the prior). Never
    for a mis-specified attack (its forward model was wrong), one whose optimiser stopped short of the
    truth (a lower bound), nor one whose server holds no model of the client (a surrogate's estimate:
    a better surrogate may reach more): none is evidence of low leakage."""
    gap = psnr_gap(summary)
    if gap is None or (summary or {}).get("mis_specified") or (summary or {}).get("not_converged_targets") \
            or model_unknown_targets(summary):
        return None
    return gap < LEAK_GAP_DB


def presence_is_low(accuracy: float | None) -> bool:
    """Whether a measured class-presence accuracy is below the presence threshold (None: not measured)."""
    return accuracy is not None and accuracy < PRESENCE_THRESHOLD


def no_model_words(unknown: Any, n_targets: Any) -> str:
    """The NO MODEL verdict for ``unknown`` of ``n_targets`` targets (empty for none)."""
    k, n = int(_number(unknown) or 0), int(_number(n_targets) or 0)
    if not k:
        return ""
    return (f"NO MODEL on {k} of {n} targets: the server holds no model of these clients (their method uploads no "
            f"extractor), so the figure is a surrogate-model estimate of what it can rebuild, not a measurement with "
            f"the model that computed their uploads")


def forward_check_verdict(mis_specified_targets: Any, not_converged_targets: Any, n_targets: Any,
                          model_unknown_targets: Any = None) -> str:
    """The forward-model check in words, for the end of a result line: empty when clean. MIS-SPECIFIED
    (the tool's model was wrong) before NO MODEL (the method gives the server none; the forward check
    does not apply to those targets) before a lower bound."""
    n = int(_number(n_targets) or 0)
    wrong, short = int(_number(mis_specified_targets) or 0), int(_number(not_converged_targets) or 0)
    if wrong:
        return (f"MIS-SPECIFIED on {wrong} of {n} targets: the attack's forward model does not reproduce their uploads, "
                f"so these numbers say nothing about the method")
    if int(_number(model_unknown_targets) or 0):
        return no_model_words(model_unknown_targets, n)
    if short:
        return f"the optimiser stopped short of the truth on {short} of {n} targets: a lower bound"
    return ""
