"""Reading the loosely typed cells of result tables (CSV strings, None, NaN) as numbers and flags."""
from __future__ import annotations

import math
from typing import Any


def finite_or_none(x: Any) -> float | None:
    """``x`` as a float when it is a finite number, else None (missing, text, NaN, ±inf)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def is_true(x: Any) -> bool:
    """A boolean cell: True, or the text "true" in any case (as a CSV round trip leaves it)."""
    return x is True or str(x).lower() == "true"


def is_lower_bound(mean_psnr: Any, prior_psnr: Any, stopped_short: Any) -> bool:
    """The LOWER BOUND rule: at or below the prior on average while the optimiser stopped short of the
    truth (``not_converged``) on some target; then the PSNR is set by the attack's budget, not by the
    method."""
    mean, prior = finite_or_none(mean_psnr), finite_or_none(prior_psnr)
    return bool(stopped_short) and mean is not None and prior is not None and mean <= prior


NO_INTERVAL = "too few targets for an interval"


def interval_text(low: Any, high: Any, digits: int = 2, scale: float = 1.0) -> str:
    """" [low, high]" for a finite interval, else the sentence that says why there is none (an
    interval over one or two attacked clients is too wide to mean anything: ``attacks.metrics``)."""
    lo, hi = finite_or_none(low), finite_or_none(high)
    if lo is None or hi is None:
        return f" ({NO_INTERVAL})"
    return f" [{scale * lo:.{digits}f}, {scale * hi:.{digits}f}]"


def forward_check_verdict(mis_specified_targets: Any, not_converged_targets: Any, n_targets: Any) -> str:
    """The forward-model check in words, for the end of a result line: empty when clean."""
    n = int(finite_or_none(n_targets) or 0)
    wrong, short = int(finite_or_none(mis_specified_targets) or 0), int(finite_or_none(not_converged_targets) or 0)
    if wrong:
        return (f"MIS-SPECIFIED on {wrong} of {n} targets: the attack's forward model does not reproduce their uploads, "
                f"so these numbers say nothing about the method")
    if short:
        return f"the optimiser stopped short of the truth on {short} of {n} targets: a lower bound"
    return ""
