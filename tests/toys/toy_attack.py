"""A toy attack in one file: a mid-grey image per target and no label (it uses no data of any client).

Declared with ``attacks.declare("toy", "toys.toy_attack:SPEC", "a grey guess", "image", default_iterations=1)``."""
from __future__ import annotations

import torch

from attacks.base import AttackResult, Budget, Observation
from attacks.registry import WEIGHT_KINDS, ClientAttackSpec


def grey(observation: Observation, budget: Budget, seed: int) -> AttackResult:
    images = torch.full((budget.batch, *observation.image_shape), 0.5)
    return AttackResult(images=images, labels=torch.full((budget.batch,), -1, dtype=torch.int64),
                        trace={"mode": "grey", "objective": 0.0, "seconds": 0.0}, notes=["a grey guess"])


SPEC = ClientAttackSpec("toy", attack_one=grey, applies_to=WEIGHT_KINDS, scoring="images", needs="model weights",
                        default_victim_batch=1)
