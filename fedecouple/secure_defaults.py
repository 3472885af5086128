"""Secure aggregation's defaults, readable without torch.

``fedecouple.secure_aggregation.SecureAggregation`` takes its fields' defaults from ``DEFAULTS`` (Flower's
``SecAggPlusWorkflow``'s own, with every pair masking), and the command line shows them as its options'
defaults; ``CLEAR_FIELDS`` are the choices of its ``clear_fields``.
"""
from __future__ import annotations

# what travels unmasked beside a masked upload: Flower's FitRes fields, or nothing
CLEAR_FIELDS = ("flower", "hidden")

# SecureAggregation's fields (its ``seed`` aside, the federation's): their defaults
DEFAULTS = {"clipping_range": 8.0, "quantization_range": 2 ** 22, "modulus": 2 ** 32, "num_shares": 1.0,
            "reconstruction_threshold": 0.5, "max_weight": 1000.0, "clear_fields": CLEAR_FIELDS[0],
            "dp_noise": 0.0, "dp_l2_clip": None, "dp_delta": 1e-5}
