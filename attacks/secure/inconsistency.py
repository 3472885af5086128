"""Model inconsistency: a malicious server isolates one client's update inside the secure sum.

Pasquini et al. 2022, "Eluding Secure Aggregation in Federated Learning via Model Inconsistency":
secure aggregation hides each update in the sum only if every client trains the same model. A
server that sends each participant a model of its own can make every non-target's update of the
attacked layers exactly zero, so that the sum holds the target's update alone (times its weight
w_t = n_t / max_weight), and then run the usual per-client attack on it.

The craft here (``isolate``):

* the target gets the binning craft sized to the protocol (``attacks.secure.sized_binning``);
* every other participant is *silenced*: its first linear layer (weight and bias) and the next
  linear layer's weight are zero. Then the first layer's output is LeakyReLU(0) = 0, the next
  layer's weight receives no gradient (its input is zero) and passes none back (it is zero), so
  neither layer ever leaves zero, over any number of local steps, momentum or weight decay: the
  client's summand of both is exactly 0, which the protocol quantises without error. The rest of
  its download (the layers before, the next layer's bias) is the honest one.

The server reads the target's first-layer update from the sum: it does not know w_t (the summed
weight holds the silenced clients' too), but the next layer's columns are zero in every silenced
model and barely move in the target's, so their sum is w_t times what was sent (``isolated_weight``);
the sum divided by w_t is then the target's upload, and ``recover_inputs`` reads it as one.

The variant ``neighbourhood`` sends the target's model also to the target's neighbours in the
protocol's masking graph (``fedecouple.secure_aggregation.neighbours``): against a client that
compares its download with its neighbours' (``defenses.consistency_check``) the target then sees
no mismatch, while those neighbours' updates join the target's in the sum unless they withhold them.
"""
from __future__ import annotations

import torch
from torch import nn

from attacks.malicious.craft import CraftRecord, first_linear, load, next_linear, not_reachable
from fedecouple.methods.facets import download_reach
from fedecouple.secure_aggregation import neighbours, weight_factor

from ..base import AttackResult, Budget, NotApplicable
from ..registry import CraftRequest, MaliciousRoundSpec
from .sized_binning import (ROLES, SPEC_COMMON, ClientPlan, RoundCraft, pick_target, rebuilt, request_plan,
                            read_sum, secure_binning, target_record)

CRAFTS = ("isolate", "neighbourhood")
def silence(download: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``download`` with the first linear layer's weight and bias and the next linear layer's
    weight set to zero: a fixed point of local training (module docstring)."""
    layer = first_linear(model)
    following = next_linear(model, layer)
    sent = {k: v.detach().clone() for k, v in download.items()}
    for name in (f"{layer}.weight", f"{layer}.bias", f"{following}.weight"):
        sent[name] = torch.zeros_like(sent[name])
    return sent


def silence_unreachable(method, model: nn.Module) -> str | None:
    """Why silencing cannot zero ``method``'s update of the first linear layer (None: it can): the
    client must train the next linear layer as sent, else its own passes a gradient back."""
    layer = first_linear(model)
    following = next_linear(model, layer)
    # the attack runs under secure aggregation only, where a method may download less (FedPAC: no head)
    if following.split(".", 1)[0] in set(download_reach(method, secure=True)):
        return None
    return (f"{method.name}'s clients train against their own {following}: a silenced client still updates {layer}, "
            f"so model inconsistency cannot isolate one update in the sum")


def isolate(craft: str, download: dict[str, torch.Tensor], model: nn.Module, public: torch.Tensor,
            reached: tuple[str, ...], protocol, plan: ClientPlan, client: int, round_clients, round: int,
            seed: int = 0) -> tuple[dict[str, torch.Tensor], RoundCraft]:
    """The download for ``client``, one of the round's ``round_clients``, under ``craft``
    (``CRAFTS``), and the server's record of it."""
    if craft not in CRAFTS:
        raise ValueError(f"unknown craft {craft!r}; one of {CRAFTS}")
    target = pick_target(round_clients, round)
    close = neighbours(protocol, round, list(round_clients)).get(target, set()) if craft == "neighbourhood" else set()
    if client == target or client in close:
        sent, record = secure_binning(download, model, public, reached, protocol, plan, seed)
        role = "target" if client == target else "neighbour"
        return sent, RoundCraft(role, target, record.layer, record.sent, record, notes=list(record.notes))
    model = load(model, download)
    sent = silence(download, model)
    return sent, RoundCraft("silenced", target, first_linear(model), {k: v.clone() for k, v in sent.items()})


def isolated_weight(record: CraftRecord, total: dict[str, torch.Tensor], following: str) -> float:
    """w_t, the weight the target's update carries in ``total``: the least-squares ratio of the summed
    ``following`` weight (the next linear layer, silenced to zero everywhere but in the target's model)
    to the columns sent. The target's training moves those columns by less than float32 resolves
    (their inputs, the crafted layer's outputs, are kept below one over the column size), and the
    readout needs w_t only to remove the sent biases, whose differences are about 1e-6 of one
    sample's update: a w_t off by a percent would still read every input exactly."""
    name = f"{following}.weight"
    if name not in total or name not in record.sent:
        raise NotApplicable(f"the secure sum holds no {name}: the target's weight in the sum cannot be read")
    sent = record.sent[name].double()
    return float((total[name].double() * sent).sum() / (sent * sent).sum().clamp_min(1e-300))


def read_isolated(record: CraftRecord, total: dict[str, torch.Tensor], following: str,
                  error: float = 0.0, weight: float | None = None) -> tuple[torch.Tensor, float]:
    """(candidate inputs of the target's crafted layer, its weight w_t) from a round's sum in which
    every other survivor was silenced; ``following``: the linear layer after the crafted one;
    ``error``: how far each summed value may lie from the exact sum (``sized_binning.denoise``);
    ``weight``: w_t where the server knows it (from the target's sample count in the clear), else read
    from the sum (``isolated_weight``)."""
    weight = isolated_weight(record, total, following) if weight is None else float(weight)
    if not weight > 0:
        raise NotApplicable("the target's update is not in the sum (it did not survive, or withheld it)")
    names = {f"{record.layer}.weight", f"{record.layer}.bias"}  # the crafted layer: all the readout reads
    return read_sum(record, {k: v for k, v in total.items() if k in names}, weight, error), weight


def clear_weight(observation, client: int) -> float | None:
    """The weight ``client``'s summands carry in the sum, from its sample count in the clear: Flower's
    round(n / max_weight · Q) / Q (None: its count was hidden, or the protocol not handed over)."""
    count = observation.clear.get(int(client), {}).get("sample_count")
    protocol = observation.protocol
    if count is None or protocol is None:
        return None
    return weight_factor(protocol, int(count) / protocol.max_weight) / protocol.quantization_range


def inconsistency_craft(request: CraftRequest) -> tuple[dict[str, torch.Tensor], RoundCraft]:
    """``MaliciousRoundSpec.craft_download``: ``isolate`` for the request's client among the round's."""
    protocol, plan, notes = request_plan(request)
    sent, record = isolate(request.craft, dict(request.download), request.make_model(), request.public,
                           request.reached, protocol, plan, request.client, request.round_clients or (request.client,),
                           request.round, request.seed)
    for kept in (record, record.binning):
        if kept is not None:
            kept.notes[:0] = notes
    return sent, record


def unreachable(method, model: nn.Module) -> str | None:
    """Why the craft cannot reach, or a silenced client's update cannot vanish for, ``method``."""
    return not_reachable(method, model) or silence_unreachable(method, model)


def inconsistency(observation, budget: Budget, seed: int) -> AttackResult:
    """``MaliciousRoundSpec.attack_round``: the target's inputs read from the sum (``read_isolated``), rebuilt."""
    target, record = target_record(observation.crafted)
    if target not in observation.survivors:
        raise NotApplicable(f"the target (client {target}) withheld its upload or dropped out: it is not in the sum")
    following = next_linear(observation.make_model(), record.layer)
    known = clear_weight(observation, target)
    inputs, weight = read_isolated(record, observation.total, following,
                                   len(observation.survivors) * observation.quantum, known)
    roles = [getattr(r, "role", "") for r in observation.crafted.values()]
    notes = list(record.notes)
    if known is not None:
        notes.append("the target's weight is its sample count in the clear (Flower's SecAgg+ leaves num_examples "
                     "unmasked) at Flower's rounding, not read from the silenced layer")
    if "neighbour" in roles:
        notes.append("the target's neighbours got its model too: their surviving updates share its bins")
    return rebuilt(observation, record, inputs.float(), budget, seed,
                   {"mode": "inconsistency", "clients": [target], "target_weight": weight}, notes)


SPEC = MaliciousRoundSpec("inconsistency", crafts=CRAFTS, craft_download=inconsistency_craft, unreachable=unreachable,
                          attack_round=inconsistency, **SPEC_COMMON)

__all__ = ["CRAFTS", "ROLES", "SPEC", "RoundCraft", "inconsistency", "isolate", "isolated_weight", "pick_target",
           "read_isolated", "silence", "silence_unreachable", "target_record"]
