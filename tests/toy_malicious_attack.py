"""A toy malicious-server attack in one file: ``install()`` registers it, and nothing else anywhere is edited.

The craft ("open row"): the server sends the first linear layer of the extractor with row 0 zeroed and
its bias set to ``OPEN_BIAS`` > 0, so that the unit fires (in the linear part of its LeakyReLU) for
every input. One SGD step on one image a then changes that row by ΔW_0 = −η δ a and its bias by
Δb_0 = −η δ (δ the upstream gradient of the unit), so ΔW_0 / Δb_0 is the layer's input a, exactly; on
several images it is their δ-weighted mean. The readout divides the two updates and rebuilds the image
from the recovered input by inverting the layers before it (``attacks.malicious.readout``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attacks.base import AttackResult, Budget, NotApplicable, Observation
from attacks.malicious import first_linear, not_reachable
from attacks.malicious.craft import load
from attacks.malicious.readout import rebuild_images
from attacks.malicious.scoring import input_statistics, score_recovered
from attacks.registry import AttackSpec, CraftRequest, MaliciousSpec, register, unregister

NAME = "toy-open"
CRAFT = "open-row"
OPEN_BIAS = 1.0
# seconds per L-BFGS step of the image rebuild and per image: 10 digits images rebuilt at the default 50
# steps took 0.84 s on the shared 2-core machine, one thread
STEP_SECONDS = 0.0017


@dataclass
class OpenRowRecord:
    """What the server sent one client: the crafted layer, the download as sent, and the public mean
    image (where the rebuild starts)."""

    craft: str
    layer: str
    sent: dict[str, torch.Tensor]
    public_mean: torch.Tensor
    notes: list[str] = field(default_factory=list)


def open_row(request: CraftRequest) -> tuple[dict[str, torch.Tensor], OpenRowRecord]:
    """The crafted download: the honest one with row 0 of the first linear layer opened."""
    layer = first_linear(load(request.make_model(), request.download))
    sent = {k: v.detach().clone() for k, v in request.download.items()}
    sent[f"{layer}.weight"][0] = 0.0
    sent[f"{layer}.bias"][0] = OPEN_BIAS
    return {k: v.clone() for k, v in sent.items()}, OpenRowRecord(request.craft, layer, sent, request.public.mean(0))


def read_open_row(observation: Observation, budget: Budget, seed: int) -> AttackResult:
    """ΔW_0 / Δb_0 of the open row, and the image rebuilt from it."""
    record = getattr(observation, "crafted", None)
    if not isinstance(record, OpenRowRecord):
        raise NotApplicable("no open-row download was sent to this client (the server must be malicious)")
    weight, bias = f"{record.layer}.weight", f"{record.layer}.bias"
    if weight not in observation.upload:
        raise NotApplicable(f"the upload holds no {record.layer}")
    dw = observation.upload[weight][0].double() - record.sent[weight][0].double()
    db = float(observation.upload[bias][0].double() - record.sent[bias][0].double())
    inputs = (dw / db).float()[None] if db != 0.0 else torch.zeros(0, dw.numel())
    images = rebuild_images(observation.make_model(), record, inputs, observation.image_shape, budget.iterations, seed)
    result = AttackResult(images, torch.full((len(images),), -1, dtype=torch.long),
                          trace={"mode": CRAFT, "bias_update": db}, notes=list(record.notes))
    result.variables["inputs"] = inputs
    return result


def score(make_model, record, result, truths, truth_labels, prior) -> list[dict]:
    """``score_recovered``'s rows, with the open row's bias update (this attack's extra column)."""
    return [{**row, "bias_update": result.trace["bias_update"]}
            for row in score_recovered(make_model, record, result, truths, truth_labels, prior)]


def lines(summary: dict) -> list[str]:
    share = summary.get("inputs_exact_share")
    return [] if share is None else [f"  open row: input recovered exactly for {share:.0%} of the images"]


SPEC = MaliciousSpec(NAME, attack_one=read_open_row, default_victim_batch=0, applies_to=frozenset({"extractor"}),
                     scoring="images", needs="model weights", crafts=(CRAFT,), extra_columns=("bias_update",),
                     craft_download=open_row, unreachable=not_reachable, score_target=score,
                     statistics=input_statistics, summary_lines=lines, estimate_rate=STEP_SECONDS, estimate_per="image")


def install() -> AttackSpec:
    return register(SPEC, summary="malicious server: one open row of the first linear layer (test only)",
                    default_iterations=50)


def uninstall() -> None:
    unregister(NAME)
