"""A toy attack in one file: ``install()`` registers it with its facts, and nothing else anywhere is edited.

It returns a mid-grey image per target and no label (it uses no data of any client)."""
from __future__ import annotations

import torch

from attacks.base import AttackResult, Budget, Observation
from attacks.registry import WEIGHT_KINDS, AttackSpec, ClientAttackSpec, register, unregister


def grey(observation: Observation, budget: Budget, seed: int) -> AttackResult:
    images = torch.full((budget.batch, *observation.image_shape), 0.5)
    return AttackResult(images=images, labels=torch.full((budget.batch,), -1, dtype=torch.int64),
                        trace={"mode": "grey", "objective": 0.0, "seconds": 0.0}, notes=["a grey guess"])


SPEC = ClientAttackSpec("toy", attack_one=grey, default_victim_batch=1, applies_to=WEIGHT_KINDS, scoring="images",
                        needs="model weights")


def install() -> AttackSpec:
    return register(SPEC, summary="a grey guess (test only)", kind="image", default_iterations=1)


def uninstall() -> None:
    unregister("toy")
