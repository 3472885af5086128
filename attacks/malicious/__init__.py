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

What the crafted download reaches is the method's declaration (``Method.download_reaches``): a
method that trains nothing it downloads (FedProto) is refused before training.
"""
from __future__ import annotations

import torch

from ..base import AttackResult, Budget, NotApplicable, Observation
from ..registry import AttackSpec, register
from .craft import CRAFTS, CraftRecord, craft, first_linear
from .fishing import CRAFT as FISHING
from .fishing import COLUMNS as FISHING_COLUMNS
from .fishing import INVERSION_STEPS as FISHING_STEPS
from .fishing import FishingRecord, fish_attack, fishing_download
from .readout import match_inputs, rebuild_images, recover_inputs, relative_errors, true_inputs

# a recovered input counts as exact at or below this relative error
EXACT = 1e-3
INVERSION_STEPS = 300


def not_reachable(method, model, craft: str = "binning") -> str | None:
    """Why a crafted download cannot reach ``method``'s update (None: it can), from the method's
    declaration: the trap crafts' layer lies in the extractor, which the client must train from as
    sent; fishing needs the extractor trained from the download against the downloaded classifier."""
    reached = set(getattr(method, "download_reaches", ()) or ())
    if not reached:
        return (f"{method.name} trains nothing the server sends (its download holds no weights it trains from or "
                f"against): a crafted download cannot reach its update")
    if craft == FISHING:
        missing = sorted({"extractor", "classifier"} - reached)
        if not missing:
            return None
        return (f"{method.name} trains only {', '.join(sorted(reached))} as sent, not the downloaded "
                f"{' and '.join(missing)}: classifier fishing needs the client to train its extractor against the "
                f"classifier the server sends" + (" (it trains under its own head)" if missing == ["classifier"]
                                                  else ""))
    layer = first_linear(model)
    if layer.split(".", 1)[0] in reached:
        return None
    return (f"{method.name} trains only {', '.join(sorted(reached))} as sent, not {layer}: a crafted download "
            f"cannot reach that layer")


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


_COMMON = dict(kind="malicious", attack_one=attack_one, plan=None, default_iterations=INVERSION_STEPS,
               default_victim_batch=0, applies_to=frozenset({"extractor"}), scoring="images",
               needs="model weights",
               hint="a crafted download is read back from the uploaded weights; try "
                    "`fedsec attack proto --method {method}`")

register(AttackSpec(name="trap", summary="malicious server: trap weights in the first linear layer (--craft "
                                         "binning: Fowl et al.'s bins, exact; plain: Boenisch et al.'s random rows)",
                    crafts=CRAFTS, **_COMMON))
register(AttackSpec(name="binning", summary="malicious server: binning rows in the first linear layer (= trap "
                                            "--craft binning)", crafts=("binning",), **_COMMON))
register(AttackSpec(name="fish", summary="malicious server: classifier fishing (Wen et al.): the classifier sent "
                                         "isolates one image of the client's rarest class, rebuilt from the update",
                    crafts=(FISHING,), extra_columns=FISHING_COLUMNS, first_round=1,
                    **{**_COMMON, "attack_one": fish_attack, "default_iterations": FISHING_STEPS}))

__all__ = ["CRAFTS", "EXACT", "FISHING", "CraftRecord", "FishingRecord", "attack_one", "craft", "first_linear",
           "fishing_download", "match_inputs", "not_reachable", "recover_inputs", "relative_errors", "true_inputs"]
