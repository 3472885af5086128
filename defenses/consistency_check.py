"""A download-consistency check under secure aggregation, against model inconsistency.

Secure aggregation hides one update among the others only if every client trained the same model:
a server that sends each participant a model of its own can zero the others' updates of a layer and
leave the target's alone in the sum (Pasquini et al. 2022, "Eluding Secure Aggregation in Federated
Learning via Model Inconsistency"; ``attacks.secure.inconsistency``). The check: once the download
has arrived and before it sends its masked upload, each client compares a digest (SHA-256) of its
download with those of its neighbours in the protocol's masking graph
(``fedecouple.secure_aggregation.neighbours``: every other participant under SecAgg, the SecAgg+
ring neighbours otherwise). A client that sees any mismatch flags the round and withholds its masked
upload; to the protocol it has dropped out, and the round is unmasked without it (or aborted below
the reconstruction threshold).

What is simulated: the digests travel inside the key agreement's authenticated messages, so the
server relays them but cannot forge them (a server that can, or whose sybils answer for the
neighbours, defeats the check). A flag is local: the client acts on what it saw, and no flag reaches
a client whose own neighbours all agree with it. So a server that sends the target's neighbours the
target's model too (``attacks.secure.inconsistency``'s ``neighbourhood`` craft) is flagged by those
neighbours, whose own neighbours got another model, but the target sees agreement and sends; under
SecAgg (every pair neighbours) that server must send everyone the target's model, and the attack
falls back to binning through the whole sum. The check tests consistency, not honesty: a crafted
model sent to everyone (``sum-binning``) passes it; ``defenses.download_check`` tests the weights.

``ConsistencyCheck`` is a channel interceptor: it must run after every interceptor that can change a
download (the last on the channel), since it digests what reaches the client, and it decides at the
upload, when the round's downloads are all out.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from fedecouple.channel import Download, Interceptor, Upload
from fedecouple.errors import UserError
from fedecouple.secure_aggregation import neighbours

from .registry import DefenseSpec


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every named tensor (name, dtype, shape and bytes, in name order)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        h.update(value.numpy().tobytes())
    return h.hexdigest()


@dataclass
class Verdict:
    """One client's check in one round: the neighbours whose download differs from its own, and
    whether it withheld its masked upload."""

    round: int
    client: int
    mismatches: list[int]
    withheld: bool


class ConsistencyCheck(Interceptor):
    """Compares each client's download with its masking-graph neighbours' under ``protocol`` (a
    ``SecureAggregation``); a client that sees a mismatch withholds its upload (``withhold``) and the
    round is flagged. ``verdicts`` logs every decision."""

    name = "consistency-check"

    def __init__(self, protocol, withhold: bool = True) -> None:
        if protocol is None:
            raise UserError("--defense consistency-check compares downloads during secure aggregation's key "
                            "agreement: add --secure-aggregation")
        self.protocol, self.withhold = protocol, bool(withhold)
        self.digests: dict[int, dict[int, str]] = {}
        self.verdicts: list[Verdict] = []

    def on_download(self, message: Download) -> Download:
        self.digests.setdefault(message.round, {})[message.client_id] = digest(dict(message.tensors))
        return message

    def on_upload(self, message: Upload) -> Upload | None:
        seen = self.digests.get(message.round, {})
        if message.client_id not in seen:
            return message  # a download this check never saw: nothing to compare
        graph = neighbours(self.protocol, message.round, sorted(seen))
        own = seen[message.client_id]
        mismatches = sorted(n for n in graph.get(message.client_id, ()) if seen[n] != own)
        withheld = bool(mismatches) and self.withhold
        self.verdicts.append(Verdict(message.round, message.client_id, mismatches, withheld))
        return None if withheld else message

    def flagged_rounds(self) -> set[int]:
        """The rounds in which some client saw a mismatch."""
        return {v.round for v in self.verdicts if v.mismatches}

    def withheld(self, round: int) -> list[int]:
        """The clients that withheld their upload in ``round``."""
        return sorted(v.client for v in self.verdicts if v.round == round and v.withheld)

    def inconsistent_rounds(self) -> set[int]:
        """The rounds in which not every participant got the same download (the harness's truth: it saw
        every digest, where each client sees only its neighbours')."""
        return {r for r, seen in self.digests.items() if len(set(seen.values())) > 1}

    def summary(self, inconsistent: set[int]) -> dict:
        """Detection on the ``inconsistent`` rounds (the server sent some participants another
        download), false alarms on the other rounds the check saw."""
        return detection_summary(self.verdicts, set(self.digests), inconsistent)


def detection_summary(verdicts: list[Verdict], rounds: set[int], inconsistent: set[int]) -> dict:
    """Flagged rounds among the ``inconsistent`` ones and among the others of ``rounds``."""
    flagged = {v.round for v in verdicts if v.mismatches}
    attacked, honest = sorted(rounds & inconsistent), sorted(rounds - inconsistent)
    hit, alarms = [r for r in attacked if r in flagged], [r for r in honest if r in flagged]
    return {"inconsistent_rounds": len(attacked), "detected": len(hit),
            "detection_rate": len(hit) / len(attacked) if attacked else None,
            "consistent_rounds": len(honest), "false_alarms": len(alarms),
            "false_alarm_rate": len(alarms) / len(honest) if honest else None,
            "withheld_uploads": sum(v.withheld for v in verdicts),
            "flags": [{"round": v.round, "client": v.client, "mismatches": v.mismatches} for v in verdicts
                      if v.mismatches]}


def _on(item: str) -> str:
    if item != "on":
        raise ValueError(f"is 'on' (the check has no knob), got {item}")
    return item


# the sweep's training (an honest server) gives the false alarms
CONSISTENCY_CHECK = DefenseSpec(
    "consistency-check", "on: under secure aggregation every client compares a digest of its download with its "
                         "masking-graph neighbours' and withholds its masked upload on a mismatch",
    acts="download", formal=False, parse=_on, build=lambda value, run: ConsistencyCheck(run.secure),
    report=lambda check, clients: {"kind": "consistency-check", **check.summary(set())})
