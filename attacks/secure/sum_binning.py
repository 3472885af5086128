"""``sum-binning``: Fowl et al. 2022, "Robbing the Fed: Directly Obtaining Private Data in Federated
Learning with Modified Models", through secure aggregation. Every client gets the same crafted first
linear layer, sized to the protocol (``sized_binning``); every bin of the round's sum that one image of
the whole round fell in reads that image's input out exactly, and each input is rebuilt into an image.
"""
from __future__ import annotations


from attacks.malicious.craft import not_reachable

from ..base import AttackResult, Budget, NotApplicable
from ..registry import MaliciousRoundSpec
from .sized_binning import SPEC_COMMON, read_sum, rebuilt, sum_binning_craft


def sum_binning(observation, budget: Budget, seed: int) -> AttackResult:
    """``MaliciousRoundSpec.attack_round``: every bin of the round's sum that holds any input read out
    (``read_sum``), each candidate rebuilt into an image."""
    records = list(observation.crafted.values())
    if not records:
        raise NotApplicable("no crafted download was sent in this round (the server must be malicious)")
    record = records[0]
    if f"{record.layer}.weight" not in observation.total:
        raise NotApplicable(f"the secure sum holds no {record.layer}: the crafted layer's update is not summed")
    inputs = read_sum(record, observation.total, error=len(observation.survivors) * observation.quantum).float()
    return rebuilt(observation, record, inputs, budget, seed, {"mode": "sum-binning"}, record.notes)


SPEC = MaliciousRoundSpec("sum-binning", crafts=("binning",), craft_download=sum_binning_craft,
                          unreachable=not_reachable, attack_round=sum_binning, **SPEC_COMMON)
