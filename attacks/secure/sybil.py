"""Sybils: the server controls every participant of a round but the target, and subtracts them.

Secure aggregation hides an update among the others only if the others are honest. A server that
runs (or has bought) every other participant knows each of their summands, so the sum minus theirs
is the target's summand w_t·θ_t and its weight w_t (the FedAvg family sums Σ wᵢ too): the target's
upload, as if the protocol were off. The attack is then the per-client binning craft sized to the
protocol (``attacks.secure.sized_binning``) on the target; the sybils train honestly on the download
as sent.

This is a stated upper bound on what a server under secure aggregation can read of one client,
not a separate weakness: it equals the per-client attack without secure aggregation, up to the
target's own quantisation (and the sybils', since the server subtracts their float summands, not
the integers the protocol rounded them to: each value stays within ``len(survivors) * quantum``).
Against sybils a download-consistency check (``defenses.consistency_check``) is void: a sybil
reports whatever digest the server wants.

Under distributed DP (``SecureAggregation.private``) each client adds its own noise before masking. A
sybil is the server's: it knows the noise its sybils drew, so it subtracts that too (``sybil_noise``), and
the target's own noise is all that remains on its summand: the isolated client's ε applies
(``defenses.distributed_dp``), not the sum's.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from attacks.malicious.craft import first_linear, load, not_reachable
from fedecouple.channel import Upload
from fedecouple.methods.facets import SecureSummation
from fedecouple.secure_aggregation import Layout, skellam_noise, with_flower_weight

from ..base import AttackResult, Budget, NotApplicable
from ..registry import CraftRequest, MaliciousRoundSpec
from .sized_binning import (SPEC_COMMON, ClientPlan, RoundCraft, pick_target, rebuilt, request_plan,
                            read_sum, secure_binning, target_record)

CRAFTS = ("sybil",)


def sybil_craft(download: dict[str, torch.Tensor], model: nn.Module, public: torch.Tensor, reached: tuple[str, ...],
                protocol, plan: ClientPlan, client: int, round_clients, round: int,
                seed: int = 0) -> tuple[dict[str, torch.Tensor], RoundCraft]:
    """The download for ``client`` of the round's ``round_clients``: the sized binning craft for the
    round's target (``pick_target``), the honest download for a sybil, whose record keeps its upload."""
    target = pick_target(round_clients, round)
    if client == target:
        sent, record = secure_binning(download, model, public, reached, protocol, plan, seed)
        return sent, RoundCraft("target", target, record.layer, record.sent, record, notes=list(record.notes))
    sent = {k: v.detach().clone() for k, v in download.items()}
    layer = first_linear(load(model, download))
    return sent, RoundCraft("sybil", target, layer, {k: v.clone() for k, v in sent.items()}, keeps_upload=True)


def without_sybils(total: dict[str, torch.Tensor], sybil_summands: list[dict[str, torch.Tensor]]) -> dict:
    """``total`` minus every sybil's summand: the target's summand (float64)."""
    rest = {k: v.double().clone() for k, v in total.items()}
    for summand in sybil_summands:
        for k, v in summand.items():
            rest[k] = rest[k] - v.double()
    return rest


def sybil_summands(method, crafted: dict[int, RoundCraft], survivors, round: int, max_weight: float,
                   num_classes: int, protocol=None) -> list[dict[str, torch.Tensor]]:
    """What each surviving sybil added to the sum (``SecureSummation.secure_summands`` of the upload its record
    kept, weighted at Flower's rounded weight as the protocol sends it, ``with_flower_weight``, where
    ``protocol`` is given); ``NotApplicable`` when a survivor is neither a sybil with its upload nor the
    target."""
    if not isinstance(method, SecureSummation):
        raise NotApplicable(f"{method.name} has no secure-aggregation variant")
    out = []
    for client in survivors:
        record = crafted.get(int(client))
        role = getattr(record, "role", None)
        if role == "target":
            continue
        if role != "sybil" or record.upload is None:
            raise NotApplicable(f"client {client} survived the round but is not a sybil whose upload the server "
                                f"holds: the sum cannot be stripped down to the target")
        upload = Upload(round, int(client), {k: v for k, v in record.upload.items()}, {})
        summands = method.secure_summands(upload, max_weight, num_classes)
        out.append(summands if protocol is None else with_flower_weight(protocol, summands))
    return out


def sybil_noise(protocol, total: dict[str, torch.Tensor], crafted: dict, survivors, round: int
                ) -> list[dict[str, torch.Tensor]]:
    """Under distributed DP, the noise each surviving sybil added to the sum, in value units (the server
    drew it: ``skellam_noise`` with the sybil's seed), laid out as the sum is (Flower's weight factor, which
    carries none, first); no entries otherwise."""
    if protocol is None or not protocol.private:
        return []
    layout = Layout.of(total)
    dimension = layout.size - (1 if layout.weighted else 0)
    step = 2 * protocol.clipping_range / protocol.quantization_range
    out = []
    for client in survivors:
        if getattr(crafted.get(int(client)), "role", None) != "sybil":
            continue
        noise = skellam_noise(protocol, dimension, round, int(client)).astype("float64") * step
        if layout.weighted:
            noise = np.concatenate([[0.0], noise])
        out.append({k: v.to(total[k].device) for k, v in layout.unflatten(noise).items()})
    return out


def read_target(record, total: dict[str, torch.Tensor], summands: list[dict[str, torch.Tensor]],
                error: float = 0.0):
    """(candidate inputs of the target's crafted layer, its weight w_t) from the sum and the sybils'
    summands; ``error``: how far each summed value may lie from the exact sum (``sized_binning.denoise``)."""
    rest = without_sybils(total, summands)
    weight = float(rest.get("sample_count", torch.tensor(0.0)))
    if not weight > 0:
        raise NotApplicable("nothing of the target is left in the sum: it did not survive the round")
    names = {f"{record.layer}.weight", f"{record.layer}.bias"}  # the crafted layer: all the readout reads
    return read_sum(record, {k: v for k, v in rest.items() if k in names}, weight, error), weight


def sybil_request(request: CraftRequest) -> tuple[dict[str, torch.Tensor], RoundCraft]:
    """``MaliciousRoundSpec.craft_download``: ``sybil_craft`` for the request's client among the round's."""
    protocol, plan, notes = request_plan(request)
    sent, record = sybil_craft(dict(request.download), request.make_model(), request.public, request.reached,
                               protocol, plan, request.client, request.round_clients or (request.client,),
                               request.round, request.seed)
    for kept in (record, record.binning):
        if kept is not None:
            kept.notes[:0] = notes
    return sent, record


def sybil(observation, budget: Budget, seed: int) -> AttackResult:
    """``MaliciousRoundSpec.attack_round``: the target's summand (the sum minus the sybils'), read and rebuilt."""
    target, record = target_record(observation.crafted)
    summands = sybil_summands(observation.method, observation.crafted, observation.survivors, observation.round,
                              observation.max_weight, observation.num_classes, observation.protocol)
    summands += sybil_noise(observation.protocol, observation.total, observation.crafted, observation.survivors,
                            observation.round)
    inputs, weight = read_target(record, observation.total, summands,
                                 len(observation.survivors) * observation.quantum)
    notes = list(record.notes) + ["sybils: every other participant is the server's, an upper bound on one round's "
                                  "leakage under secure aggregation (the per-client attack without it)"]
    return rebuilt(observation, record, inputs.float(), budget, seed,
                   {"mode": "sybil", "clients": [target], "target_weight": weight}, notes)


SPEC = MaliciousRoundSpec("sybil", crafts=CRAFTS, craft_download=sybil_request, unreachable=not_reachable,
                          attack_round=sybil, **SPEC_COMMON)

__all__ = ["CRAFTS", "SPEC", "read_target", "sybil", "sybil_craft", "sybil_noise", "sybil_summands", "without_sybils"]
