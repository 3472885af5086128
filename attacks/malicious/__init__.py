"""A malicious server: crafted downloads, and the attacks that read the client's answer back.

Every other attack assumes an honest-but-curious server. These assume a server that controls the
weights it sends (never the architecture, the client's code or a secure aggregation): for the
attacked clients of the attacked round it rewrites the download (``craft``), and reads the crafted
layer's inputs out of the upload (``readout``), then rebuilds each image from its input.

Registered attacks (``fedsec attack trap|binning|fish``):

* ``trap``: the trap-weights family, ``--craft binning`` (default) or ``--craft plain`` (Boenisch
  et al.'s random trap rows; on LeakyReLU models approximate, never exact);
* ``binning``: the same as ``trap --craft binning``;
* ``fish``: classifier fishing (Wen et al., ICML 2022; ``fishing``): the classifier sent makes one
  class's (or one feature's) images the only ones whose gradient reaches the extractor, and the
  fished images are rebuilt from the update. It needs an earlier upload of the client (its label
  counts pick the class), so an attacked round >= 1.

What the crafted download reaches is the method's declaration (``DownloadReach.download_reaches``): a
method that trains nothing it downloads (FedProto) is refused before training.

Each attack declares the server's side in its ``MaliciousSpec``: the craft (``craft_download``, which
the harness's interceptor calls for every attacked client), what it cannot reach (``unreachable``),
how its read-back is scored and summed up (``score_target``, ``statistics``: ``scoring``, or
``fishing``'s own) and its time per step; nothing outside its file names it.
"""
from __future__ import annotations

import torch

from ..base import AttackResult, Budget, NotApplicable, Observation
from ..registry import MaliciousSpec
from .craft import CRAFTS, CraftRecord, craft, craft_request, first_linear, not_reachable
from .fishing import CRAFT as FISHING
from .fishing import COLUMNS as FISHING_COLUMNS
from .fishing import (FishingRecord, fish_attack, fishing_craft, fishing_download, fishing_lines, fishing_statistics,
                      fishing_unreachable, score_fished)
from ..inversion.layer_inputs import match_inputs, relative_errors
from .readout import rebuild_images, recover_inputs, true_inputs
from .scoring import EXACT, input_statistics, score_recovered

# seconds per L-BFGS step of the image rebuild and per image the client trained on, on the reference
# machine: the audit preset's eight trap stages (4 targets x 300 steps, clients of 10 and of 50 images,
# four methods) took 408 s together. Per stage the time depends less on the client size than this
# scales it (10-69 s at 10 images, 52-66 s at 50)
TRAP_STEP_SECONDS = 0.0014
# seconds per inversion step of one target (its one or two fished images): 9 s per 1000 steps on the
# shared 2-core machine, FedAvg, seed 1
FISH_STEP_SECONDS = 0.009


def attack_one(observation: Observation, budget: Budget, seed: int) -> AttackResult:
    """Recover the crafted layer's inputs from the upload, rebuild an image from each."""
    record: CraftRecord | None = getattr(observation, "crafted", None)
    if record is None:
        raise NotApplicable("no crafted download was sent to this client (the server must be malicious)")
    if record.layer + ".weight" not in observation.upload:
        raise NotApplicable(f"the upload holds no {record.layer}: the crafted layer's update is not sent")
    inputs = recover_inputs(record, dict(observation.upload))
    images = rebuild_images(observation.make_model(), record, inputs, observation.image_shape,
                            budget.iterations, seed)
    result = AttackResult(images, torch.full((len(images),), -1, dtype=torch.long),
                          trace={"mode": record.craft, "candidates": len(inputs)}, notes=list(record.notes))
    result.variables["inputs"] = inputs
    return result


_COMMON = dict(attack_one=attack_one, default_victim_batch=0, applies_to=frozenset({"extractor"}), scoring="images",
               needs="model weights",
               hint="a crafted download is read back from the uploaded weights; try "
                    "`fedsec attack proto --method {method}`",
               craft_download=craft_request, unreachable=not_reachable, score_target=score_recovered,
               statistics=input_statistics, estimate_rate=TRAP_STEP_SECONDS, estimate_per="image")


TRAP = MaliciousSpec("trap", crafts=CRAFTS, **_COMMON)
BINNING = MaliciousSpec("binning", crafts=("binning",), **_COMMON)
FISH = MaliciousSpec("fish", crafts=(FISHING,), extra_columns=FISHING_COLUMNS,
                     **{**_COMMON, "attack_one": fish_attack, "craft_download": fishing_craft,
                        "unreachable": fishing_unreachable, "score_target": score_fished,
                        "statistics": fishing_statistics, "summary_lines": fishing_lines,
                        "estimate_rate": FISH_STEP_SECONDS, "estimate_per": "target"})

__all__ = ["CRAFTS", "EXACT", "FISHING", "CraftRecord", "FishingRecord", "attack_one", "craft", "first_linear",
           "fishing_download", "match_inputs", "not_reachable", "recover_inputs", "relative_errors", "true_inputs"]
