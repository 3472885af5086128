"""A toy defense in one file: each upload's update Δ of the model weights shrunk by a factor in [0, 1].

Declared with ``defenses.DEFENSES.declare("toy", "toys.toy_defense:SHRINK", summary=...)``."""
from __future__ import annotations

from defenses.filters import UploadFilter, weight_filter
from defenses.registry import DefenseSpec, number


class Shrink(UploadFilter):
    name = "shrink"

    def __init__(self, factor: float, **kw):
        super().__init__(**kw)
        self.factor = factor

    def params(self) -> dict:
        return {"factor": self.factor}

    def transform(self, deltas, generator):
        return {n: d * self.factor for n, d in deltas.items()}, {}


def _factor(item: str) -> float:
    value = number(item)
    if not 0 <= value <= 1:
        raise ValueError(f"is a factor in [0, 1], got {item}")
    return value


SHRINK = DefenseSpec("toy", "factor each upload's update Δ is multiplied by", acts="upload", formal=False,
                     parse=_factor, build=weight_filter(lambda value, run: Shrink(float(value))),
                     report=lambda chain, clients: {"kind": "filter", "filters": chain.summary()})
