"""The ``labels`` attack: label-distribution inference (which classes a client holds, and in what
proportions) from the most direct source its upload carries: class counts, label statistics, the
classes of its prototypes, or its classifier's update. The inference itself, and how each source is
read, is ``attacks.inversion.label_distribution.label_inference``.
"""
from __future__ import annotations

from ..registry import ClientAttackSpec
from .label_distribution import label_inference

SPEC = ClientAttackSpec("labels", attack_one=label_inference, default_victim_batch=0, scoring="labels",
                        applies_to=frozenset({"classifier", "class_counts", "statistic", "prototype"}),
                        needs="label information (class counts, label statistics, prototypes or a classifier update)",
                        hint="label inference has nothing to read")
