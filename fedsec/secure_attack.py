"""``fedsec attack`` under ``--secure-aggregation``: which attacks apply, what is recorded, and what
distributed DP bought in a round-level attack's outcome (the harness, ``attacks.harness.attack_recorded``,
runs both kinds).

Under secure aggregation the server holds each round's sum, never one client's upload, so a
per-client attack (dlg, ig, labels, ...) has nothing to read and a round-level attack (kind
``"aggregate"``: sum-labels, sum-inversion, sum-disaggregation, ...) needs the protocol on: each
refuses the other case with one line before anything trains (``refusal``). A round-level attack's
targets are every participant of each attacked round (a malicious one crafts all their downloads),
and the record keeps every round from 0 (``record_rounds``: a multi-round attack reads the earlier
rounds' sums, and each round's downloads tell it what the server sent).
"""
from __future__ import annotations

import attacks
from attacks.registry import AttackSpec


def round_level_names() -> list[str]:
    """The registered round-level attacks."""
    return attacks.names("aggregate")


def refusal(spec: AttackSpec, method: str, secure: bool) -> str | None:
    """Why ``spec`` cannot run on ``method`` with secure aggregation ``secure`` on or off (one line), or None."""
    if spec.round_level and not secure:
        return (f"{spec.name} attacks the sum a server holds under secure aggregation, which this {method} run does "
                f"not use: add --secure-aggregation (without it the server sees every upload: attack them one by one)")
    if not spec.round_level and secure:
        return (f"{spec.name} attacks one client's upload, but under --secure-aggregation the server holds only the "
                f"sum of each round's uploads; use a round-level attack ({', '.join(round_level_names())}) or drop "
                f"--secure-aggregation")
    return None


def record_rounds(spec: AttackSpec, rounds) -> list[int] | None:
    """The rounds the recorder and the ground truth keep: every round for a round-level attack (None),
    else the attacked ones."""
    return None if spec.round_level else list(rounds)


def round_targets(participants, rounds) -> dict[int, list[int]]:
    """{round: every client that takes part in it} (``participants(round)``: the federation's sampled clients)."""
    return {r: sorted(int(c) for c in participants(r)) for r in rounds}


def with_distributed_privacy(outcome, run, rounds) -> None:
    """Under distributed DP, what the noise bought, added to a round-level ``outcome`` of ``run``
    (``attacks.harness.attack_recorded``'s): the ε spent up to each attacked round
    (``defenses.distributed_dp.recorded_privacy``) as ``distributed_dp``, in each round's ``per_target`` entry
    and as the first note. Without distributed DP, nothing."""
    from defenses.distributed_dp import privacy_note, recorded_privacy

    privacy = recorded_privacy(run.recorder, rounds)
    if privacy is not None:
        spent = {row["round"]: row for row in privacy["per_round"]}
        for entry in outcome.summary.per_target:
            entry.update({k: v for k, v in spent.get(entry["round"], {}).items() if k.startswith("epsilon")})
        outcome.summary.statistics["distributed_dp"] = privacy
        outcome.summary.notes.insert(0, privacy_note(privacy))
