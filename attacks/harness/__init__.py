"""The attack harness: one path from a recorded run to an attack's scored outcome, whatever the attack.

``attack_recorded(run, attack, targets, threat, budget, seed=..., batched=..., victim=...)`` observes what
the server held under the threat model, runs the attack, then scores the result against the run's ground
truth (read only after the attack returned), and returns an ``AttackOutcome`` (``outcome``): the scored
rows, the panels of the reconstruction figure and a typed ``AttackSummary`` whose ``record`` is
``summary.json``. ``fedsec attack``, ``fedsec audit``, ``fedsec report`` and ``fedsec flower attack`` all call
it and write what it returns.

An attack on one client's upload runs the per-client flow (``clients``: one target per attacked (round,
client), scored against the images that client trained on); a round-level attack (kind ``"aggregate"``: a
server under secure aggregation holds each round's sum) runs the round-level flow (``rounds``: one target
per attacked round, scored against the union of its survivors' images).
"""
from __future__ import annotations

from ..base import Budget
from ..recorded import RecordedRun, ThreatModel
from ..registry import AttackSpec, get
from .clients import attack_clients, nothing_scored
from .outcome import IMAGE_COLUMNS, LABEL_COLUMNS, MAX_PANELS, AttackOutcome, AttackSummary, check_summary
from .rounds import ROUND_LABEL_COLUMNS, RoundOutcome, attack_rounds

__all__ = ["IMAGE_COLUMNS", "LABEL_COLUMNS", "MAX_PANELS", "ROUND_LABEL_COLUMNS", "AttackOutcome", "AttackSummary",
           "RoundOutcome", "attack_clients", "attack_recorded", "attack_rounds", "check_summary", "nothing_scored"]


def attack_recorded(run: RecordedRun, attack: AttackSpec | str, targets: dict[int, list[int]], threat: ThreatModel,
                    budget: Budget, *, seed: int, batched: bool = True, victim=None, threads: int = 1,
                    progress: bool = True) -> AttackOutcome | RoundOutcome:
    """Attack the ``targets`` ({round: clients}) of a recorded run under ``threat`` with ``budget``, then
    score against its ground truth. ``seed`` seeds every target's starts and the statistics; ``batched``
    lets targets that share a model be optimised together; ``victim`` (batch, steps) is the victim setting
    the targets trained in (None: their real local training); ``threads`` the torch threads of each attack.
    A round-level attack attacks each round of ``targets`` as a whole (its clients: that round's
    participants)."""
    spec = get(attack) if isinstance(attack, str) else attack
    if spec.round_level:
        return attack_rounds(run, spec, sorted(targets), threat, budget, seed=seed, victim=victim, threads=threads,
                             progress=progress)
    return attack_clients(run, spec, targets, threat, budget, seed=seed, batched=batched, victim=victim,
                          threads=threads, progress=progress)
