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
