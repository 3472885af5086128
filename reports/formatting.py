"""Reading the loosely typed cells of result tables (CSV strings, None, NaN) as numbers and flags."""
from __future__ import annotations

import math
from typing import Any

# the marker of a cell whose server holds no model of the client: its figure is an estimate
NO_MODEL = "NO MODEL (estimate)"


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


NO_INTERVAL = "too few targets for an interval"


def interval_text(low: Any, high: Any, digits: int = 2, scale: float = 1.0) -> str:
    """" [low, high]" for a finite interval, else the sentence that says why there is none (an
    interval over one or two attacked clients is too wide to mean anything: ``attacks.metrics``)."""
    lo, hi = finite_or_none(low), finite_or_none(high)
    if lo is None or hi is None:
        return f" ({NO_INTERVAL})"
    return f" [{scale * lo:.{digits}f}, {scale * hi:.{digits}f}]"
