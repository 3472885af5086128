"""A client-side check of the download against a malicious server: before training, a client tests the weights it
received and refuses (drops) a download that looks crafted; it then sits the round out.

Three tests on the extractor's first linear layer (``attacks.malicious.first_linear``), the layer a
weight-only malicious server crafts:

* **one direction**: the share of row pairs whose weights have cosine > ``SAME_DIRECTION`` (binning
  sends every row along one direction; honest rows, random or trained, are far from parallel);
* **dead units**: the median over units of the share of the client's own images that activate it
  (trap rows fire for few inputs; honest units fire for a sizeable share);
* **jump**: ‖W_t − W_prev‖ / ‖W_prev‖ against the previous download this client accepted (an honest
  round moves the weights a little; a crafted layer replaces them).

and one on the classifier, where the download carries one (classifier fishing crafts it):

* **classifier jump**: the same relative jump of the classifier's weights and biases together
  (fishing zeroes rows and sets biases of 1000, or one sharp row: far beyond a round's training).

``DownloadCheck`` is a channel interceptor: it runs after the server's (and a malicious server's)
interceptors, i.e. on what reaches the client, and logs every decision (``decisions``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from attacks.malicious import first_linear
from attacks.malicious.craft import layer_inputs, load
from fedecouple.channel import Download, Interceptor

from .registry import DefenseSpec

SAME_DIRECTION = 0.99
MAX_PARALLEL_SHARE = 0.05
MIN_ACTIVE_SHARE = 0.1
MAX_JUMP = 2.0


@dataclass
class Decision:
    round: int
    client: int
    refused: bool
    reasons: list[str]
    parallel_share: float
    active_share: float
    jump: float | None
    classifier_jump: float | None = None


def inspect(download: dict[str, torch.Tensor], previous: dict[str, torch.Tensor] | None, model,
            images: torch.Tensor) -> tuple[list[str], dict]:
    """The reasons to refuse ``download`` (empty: accept) and the four statistics."""
    layer = first_linear(model)
    weight = download.get(f"{layer}.weight")
    classifier_jump = relative_jump(download, previous, ("classifier.weight", "classifier.bias"))
    reasons = ([] if classifier_jump is None or classifier_jump <= MAX_JUMP else
               [f"the classifier moved {classifier_jump:.1f}x its norm since the last download"])
    if weight is None:
        return reasons, {"parallel_share": float("nan"), "active_share": float("nan"), "jump": None,
                         "classifier_jump": classifier_jump}
    unit = weight / weight.norm(dim=1, keepdim=True).clamp_min(1e-12)
    cosines = unit @ unit.T
    off = ~torch.eye(len(unit), dtype=torch.bool)
    parallel = float((cosines[off] > SAME_DIRECTION).float().mean())
    inputs = layer_inputs(load(model, download), layer, images)
    pre = inputs @ weight.T + download[f"{layer}.bias"]
    active = float((pre > 0).float().mean(0).median())
    old = None if previous is None else previous.get(f"{layer}.weight")
    jump = None if old is None else float((weight - old).norm() / old.norm().clamp_min(1e-12))
    if parallel > MAX_PARALLEL_SHARE:
        reasons.append(f"{100 * parallel:.0f} % of {layer}'s row pairs point one way (cosine > {SAME_DIRECTION})")
    if active < MIN_ACTIVE_SHARE:
        reasons.append(f"the median unit of {layer} fires for {100 * active:.1f} % of my images")
    if jump is not None and jump > MAX_JUMP:
        reasons.append(f"{layer} moved {jump:.1f}x its norm since the last download")
    return reasons, {"parallel_share": parallel, "active_share": active, "jump": jump,
                     "classifier_jump": classifier_jump}


def relative_jump(download: dict[str, torch.Tensor], previous: dict[str, torch.Tensor] | None,
                  names: tuple[str, ...]) -> float | None:
    """‖x − x_prev‖ / ‖x_prev‖ over the tensors ``names`` (None: not in both downloads)."""
    if previous is None or not all(n in download and n in previous for n in names):
        return None
    new = torch.cat([download[n].double().flatten() for n in names])
    old = torch.cat([previous[n].double().flatten() for n in names])
    return float((new - old).norm() / old.norm().clamp_min(1e-12))


class DownloadCheck(Interceptor):
    """Refuses crafted downloads on the client's side. ``images_of(client)`` gives the client's own
    training images (the check runs on the client); ``make_model()`` a model of the architecture."""

    name = "download-check"

    def __init__(self, images_of: Callable[[int], torch.Tensor], make_model: Callable) -> None:
        self.images_of, self.make_model = images_of, make_model
        self.previous: dict[int, dict[str, torch.Tensor]] = {}
        self.decisions: list[Decision] = []

    def on_download(self, message: Download) -> Download | None:
        tensors = dict(message.tensors)
        reasons, stats = inspect(tensors, self.previous.get(message.client_id), self.make_model(),
                                 self.images_of(message.client_id))
        self.decisions.append(Decision(message.round, message.client_id, bool(reasons), reasons, **stats))
        if reasons:
            return None
        self.previous[message.client_id] = {k: v.clone() for k, v in tensors.items()}
        return message

    def summary(self, attacked: set[tuple[int, int]]) -> dict:
        """``detection_summary`` of every decision so far (what an attack's summary reports)."""
        return detection_summary(self.decisions, attacked)


def detection_summary(decisions: list[Decision], attacked: set[tuple[int, int]]) -> dict:
    """Detection rate on the attacked (round, client) downloads, false alarms on the others."""
    hit = [d.refused for d in decisions if (d.round, d.client) in attacked]
    honest = [d.refused for d in decisions if (d.round, d.client) not in attacked]
    return {"attacked_downloads": len(hit), "detected": int(sum(hit)),
            "detection_rate": sum(hit) / len(hit) if hit else None,
            "honest_downloads": len(honest), "false_alarms": int(sum(honest)),
            "false_alarm_rate": sum(honest) / len(honest) if honest else None,
            "refusals": [{"round": d.round, "client": d.client, "reasons": d.reasons} for d in decisions if d.refused]}


def _on(item: str) -> str:
    if item != "on":
        raise ValueError(f"is 'on' (the check has no knob), got {item}")
    return item


# the sweep's defense: its training (an honest server) gives the false alarms, a malicious server's attack the
# detections (the attack installs its own check after the crafting server)
DOWNLOAD_CHECK = DefenseSpec(
    "download-check", "on: every client tests each download before training and refuses one that looks crafted",
    acts="download", formal=False, parse=_on, build=lambda value, run: DownloadCheck(run.images_of, run.model),
    report=lambda check, clients: {"kind": "download-check", **check.summary(set())})
