"""The per-client flow of the harness: observe each targeted client's upload under the threat model,
attack, then score against the run's ground truth (read only after the attack returned).

``attack_clients(run, attack, targets, threat, budget, seed=..., batched=..., victim=...)`` (reached through
``attacks.harness.attack_recorded``) turns a ``RecordedRun`` (``attacks.recorded``) into an
``AttackOutcome``: the scored rows (one per reconstructed image, ``IMAGE_COLUMNS``; for a label attack one
per class, ``LABEL_COLUMNS``), the panels of the reconstruction figure and a typed ``AttackSummary``.

Scoring: each reconstruction against the images the client trained on (``attacks.metrics``), beside
two priors (the pooled mean image, the class means of data the attacker could hold); the
forward-model check (``attacks.inversion.forward_check``) with the target's true images; a malicious
server's read-back by the attack's own ``AttackSpec.score_target``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedecouple.engine import VictimSetting, derive_seed

from .. import plan
from ..base import AttackResult, Budget, NotApplicable
from ..inversion.batching import Batch
from ..metrics import (SUMMARY_KEYS, leakage_statistics, prediction_accuracy, psnr, score_images,
                      score_label_distribution, summarize_scores)
from ..recorded import RecordedRun, ThreatModel, auxiliary_data
from ..registry import AttackSpec, get
from .outcome import (CHECK_KEYS, IMAGE_COLUMNS, MAX_PANELS, AttackOutcome, AttackSummary, budget_record,
                      check_summary, threat_record, victim_record)

@dataclass
class Target:
    """One attacked (round, client) and what came of it."""

    round: int
    client: int
    observation: object = None
    result: AttackResult | NotApplicable | None = None
    rows: list[dict] = field(default_factory=list)
    check: dict = field(default_factory=dict)  # the forward-model check (attacks.inversion.forward_check)


def attack_clients(run: RecordedRun, attack: AttackSpec | str, targets: dict[int, list[int]], threat: ThreatModel,
                    budget: Budget, *, seed: int, batched: bool = True, victim: VictimSetting | None = None,
                    threads: int = 1, progress: bool = True) -> AttackOutcome:
    """Attack the ``targets`` ({round: clients}) of a recorded run under ``threat`` with ``budget``,
    then score against its ground truth. ``seed`` seeds every target's starts and the statistics;
    ``batched`` lets targets that share a model be optimised together; ``victim`` (batch, steps) is
    the victim setting the targets trained in (None: their real local training); ``threads`` the
    torch threads of each attack batch."""
    spec = get(attack) if isinstance(attack, str) else attack
    notes: list[str] = []
    auxiliary = _auxiliary(run, threat, targets)
    # gradient attacks compute on the run's device; proto and labels (cheap, no vmap) on the CPU
    device = run.device if spec.kind == "gradient" else "cpu"
    jobs = []
    for r in sorted(targets):
        for c in targets[r]:
            exchange = run.recorder.get(r, c)
            if exchange is None or exchange.upload is None:
                notes.append(f"round {r} client {c}: no upload was recorded (dropped)")
                continue
            jobs.append(Target(r, c, run.observe(r, c, threat, victim, auxiliary=auxiliary, device=device)))
    _attack_targets(run, spec, jobs, budget, threat.mode, seed, batched, threads, progress)
    prior = run.dataset.images.mean(dim=0)
    panels: list[tuple] = []
    for job in jobs:
        if isinstance(job.result, NotApplicable):
            notes.append(f"round {job.round} client {job.client}: {job.result}")
            continue
        # ---- scoring: ground truth is read only here, after the attack returned ----
        job.rows = _score_target(run, spec, job, prior, panels, notes, auxiliary)
    scored = [j for j in jobs if isinstance(j.result, AttackResult)]
    notes += _shared_notes(scored)
    rows = [row for j in scored for row in j.rows]
    summary = _summary(run, spec, targets, threat, budget, seed, batched, victim, scored, rows, notes)
    return AttackOutcome(spec, rows, panels, summary)


def nothing_scored(spec: AttackSpec, scored: list[Target], rows: list[dict], notes: list[str]) -> str | None:
    """Why the attack scored nothing (the first target's reason: an upload not recorded, or the attack's
    ``NotApplicable``), or None when it scored something. The one place an attack's "not applicable"
    answers become its result: the report's cell and the audit's finding read it from the summary."""
    count = len(rows) if spec.rebuilds_images else sum("label_score" in j.result.trace for j in scored)
    if count:
        return None
    first = notes[0] if notes else "nothing could be scored"
    return (first.split(": ", 1)[-1] if first.startswith("round ") else first).strip().rstrip(".")


def _auxiliary(run: RecordedRun, threat: ThreatModel, targets: dict[int, list[int]]):
    """The public data ``threat.aux_data`` names, without the attacked clients' own images."""
    if threat.aux_data is None:
        return None
    attacked = [run.ground_truth.training_set(r, c) for r in targets for c in targets[r]]
    return auxiliary_data(threat.aux_data, run.dataset, np.concatenate(attacked) if attacked else None)


def _attack_targets(run: RecordedRun, spec: AttackSpec, jobs: list[Target], budget: Budget, mode: str, seed: int,
                    batched: bool, threads: int, progress: bool) -> None:
    """Attack every job: planned once by ``attacks.plan`` (targets that share a model are optimised
    together when batched), each batch run by ``run.backend.map`` (here, or as a Ray task)."""
    from tqdm import tqdm

    seeds = [derive_seed(seed, j.round, j.client, 0xA7) % 2**31 for j in jobs]
    batches, failed = plan(spec.name, [j.observation for j in jobs], budget, mode, batched)
    bar = tqdm(total=len(jobs), desc=f"{spec.name} on {run.label}", unit="target", disable=not progress)
    outcomes = run.backend.map(Batch.run, [(b, [seeds[i] for i in b.indices]) for b in batches],
                               threads=threads, on_result=lambda k: bar.update(len(batches[k].indices)))
    bar.close()
    for i, exc in failed.items():
        jobs[i].result = exc
    for batch, outcome in zip(batches, outcomes):
        for i, result in zip(batch.indices, outcome):
            jobs[i].result = _gathered(result)


def _gathered(result: AttackResult | NotApplicable) -> AttackResult | NotApplicable:
    """One target's answer as the scoring takes it: a result's images and labels on the CPU (its variables
    stay where they are, for the forward check); a ``NotApplicable`` (an attack may find, only once it
    runs, that a target has nothing to attack) as it is, reported as a note."""
    if isinstance(result, NotApplicable):
        return result
    return replace(result, images=result.images.cpu(), labels=result.labels.cpu())


def class_priors(run: RecordedRun, round: int, client: int, auxiliary) -> torch.Tensor:
    """(C, ...) class-mean images of data the attacker could hold: its public data when it has some,
    else every pooled image but the target client's own training images."""
    if auxiliary is not None:
        images, labels = auxiliary
    else:
        keep = torch.ones(len(run.dataset), dtype=torch.bool)
        keep[torch.from_numpy(run.ground_truth.training_set(round, client))] = False
        images, labels = run.dataset.images[keep], run.dataset.labels[keep]
    sums = torch.zeros(run.dataset.num_classes, *images.shape[1:]).index_add_(0, labels, images)
    counts = torch.bincount(labels, minlength=run.dataset.num_classes).clamp_min(1)
    return sums / counts.view(-1, *([1] * (images.dim() - 1)))


def _score_target(run: RecordedRun, spec: AttackSpec, job: Target, prior: torch.Tensor, panels: list,
                  notes: list[str], auxiliary=None) -> list[dict]:
    result, dataset = job.result, run.dataset
    base = {"method": run.method.name, "attack": spec.name, "mode": str(result.trace.get("mode", "n/a")),
            "round": job.round, "client": job.client}
    if spec.scoring == "labels":  # the label distribution of the client's whole local training set
        predicted = torch.as_tensor(result.trace["label_distribution"], dtype=torch.float64)
        local = dataset.labels[torch.from_numpy(run.ground_truth.training_set(job.round, job.client))]
        true_counts = torch.bincount(local, minlength=dataset.num_classes)
        result.trace["label_score"] = score_label_distribution(predicted, true_counts)
        total = max(int(true_counts.sum()), 1)
        return [{**base, "class": k, "true_count": int(true_counts[k]), "true_proportion": float(true_counts[k]) / total,
                 "predicted_proportion": float(predicted[k])} for k in range(dataset.num_classes)]
    if spec.matching is not None or spec.scoring == "class-images":
        job.check = forward_check(run, spec, job)
    idx = torch.from_numpy(run.ground_truth.samples(job.round, job.client))
    truths, truth_labels = dataset.images[idx], dataset.labels[idx]
    if spec.score_target is not None:  # a malicious server's read-back, or an attack that scores its own rows
        return _score_malicious(run, spec, job, base, truths, truth_labels, prior, panels, auxiliary)
    if len(truths) > len(result.images) or spec.scoring == "class-images":
        note = ("each reconstruction is scored against its best match among the images the client trained "
                "on in that round (for proto: among the images of its class); the prior against the same image")
        if note not in notes:
            notes.append(note)
    rows = []
    priors = class_priors(run, job.round, job.client, auxiliary)
    counts = (result.trace.get("closed_form") or {}).get("label_counts")
    count_error = (None if counts is None else
                   int((torch.tensor(counts) - torch.bincount(truth_labels, minlength=len(counts))).abs().sum()))
    for i, j, row in score_images(spec.scoring, result.images, result.labels, truths, truth_labels, prior, priors):
        rows.append({**base, "image": i, "psnr": row["psnr"], "ssim": row["ssim"], "prior_psnr": row["prior_psnr"],
                     "class_prior_psnr": row["class_prior_psnr"],
                     "label_true": int(truth_labels[j]),
                     "label_pred": int(result.labels[i]) if i < len(result.labels) else -1,
                     **{k: job.check.get(k) for k in IMAGE_COLUMNS if k in CHECK_KEYS}, "label_count_error": count_error,
                     "input_error": job.check.get("input_error")})
        if len(panels) < MAX_PANELS:
            panels.append((truths[j], result.images[i], row["psnr"], f"r{job.round} c{job.client}"))
    return rows


def _score_malicious(run: RecordedRun, spec: AttackSpec, job: Target, base: dict, truths, truth_labels, prior,
                     panels: list, auxiliary) -> list[dict]:
    """The rows of a malicious server's read-back, as the attack scores it (``AttackSpec.score_target``:
    e.g. every image the client trained on with its recovered input's relative error, or the images
    a classifier-fishing craft isolated), each with its class prior's PSNR."""
    priors = class_priors(run, job.round, job.client, auxiliary)
    record = run.crafted.get((job.round, job.client))  # None: an honest server's record
    rows = []
    for row in spec.score_target(run.make_model, record, job.result, truths, truth_labels, prior):
        j = row.pop("truth_index")
        rows.append({**base, "image": j, "label_pred": -1, **row,
                     "class_prior_psnr": float(psnr(priors[int(row["label_true"])], truths[j]))})
        if len(panels) < MAX_PANELS and row["reconstruction"] >= 0:
            panels.append((truths[j], job.result.images[row["reconstruction"]], row["psnr"],
                           f"r{job.round} c{job.client}"))
    return rows


def forward_check(run: RecordedRun, spec: AttackSpec, job: Target) -> dict:
    """``attacks.inversion.forward_check.check`` (prototype inversion: ``prototype_check``) with the
    target's ground truth (its training set in order, its batches): read here, after the attack returned."""
    from ..inversion.forward_check import check, prototype_check

    idx = torch.from_numpy(run.ground_truth.training_set(job.round, job.client))
    if spec.matching is None:  # prototype inversion: the client's true class images against the inverted sets
        return prototype_check(job.observation, job.result, run.dataset.images[idx], run.dataset.labels[idx])
    mode = str(job.result.trace.get("mode", "auto")).replace("scaled-gradient", "scaled")
    device = job.observation.device
    return check(job.observation, mode, spec.matching, job.result, run.dataset.images[idx].to(device),
                 run.dataset.labels[idx].to(device), run.ground_truth.schedule(job.round, job.client))


def _shared_notes(scored: list[Target]) -> list[str]:
    """Each attack note once, saying which targets it applies to."""
    where: dict[str, list[tuple[int, int]]] = {}
    for job in scored:
        for note in job.result.notes:
            where.setdefault(note, []).append((job.round, job.client))
    attacked = [(j.round, j.client) for j in scored]
    out = []
    for text, pairs in where.items():
        if pairs == attacked:
            out.append(text if len(attacked) == 1 else f"every target: {text}")
        else:
            out.append(", ".join(f"round {r} client {c}" for r, c in pairs) + f": {text}")
    return out


def _statistics(run: RecordedRun, spec: AttackSpec, rows: list[dict], seed: int) -> dict:
    """The leakage statistics (``attacks.metrics.leakage_statistics``), the attack's own
    (``AttackSpec.statistics``: e.g. a malicious server's input shares), and the clients' download
    check when one ran."""
    statistics = leakage_statistics(rows, seed=seed) if spec.rebuilds_images else {}
    if spec.statistics is not None:
        statistics.update(spec.statistics(rows, seed))
    if run.download_check is not None:
        attacked = set(run.crafted) if spec.malicious else set()
        statistics["download_check"] = run.download_check.summary(attacked)
    return statistics


def _summary(run: RecordedRun, spec: AttackSpec, targets: dict, threat: ThreatModel, budget: Budget, seed: int,
             batched: bool, victim: VictimSetting | None, scored: list[Target], rows: list[dict],
             notes: list[str]) -> AttackSummary:
    label_scores = [j.result.trace["label_score"] for j in scored if "label_score" in j.result.trace]
    scores = summarize_scores(rows) if spec.rebuilds_images else {k: float("nan") for k in SUMMARY_KEYS}
    if spec.scoring == "images":
        label_accuracy = prediction_accuracy([(r["label_true"], r["label_pred"]) for r in rows])
    else:
        label_accuracy = float("nan")
        if spec.scoring == "class-images":
            notes = notes + [f"{spec.name} images are labelled by the prototype's class: label_accuracy does not apply"]
    presence = [s["class_presence_accuracy"] for s in label_scores]
    rounds = sorted(targets)
    return AttackSummary(
        method=run.method.name, attack=spec.name, dataset=run.dataset.name, run=run.label, scores=scores,
        statistics=_statistics(run, spec, rows, seed), label_accuracy=label_accuracy,
        class_presence_accuracy=float(np.mean(presence)) if presence else float("nan"),
        images_scored=len(rows) if spec.rebuilds_images else 0, seed=seed, attack_rounds=rounds,
        targets={str(r): targets[r] for r in rounds},
        budget=budget_record(budget, batched), victim=victim_record(victim),
        threat_model=threat_record(threat, scored, "download as sent, upload as received, the client's previous "
                                                   "upload, the initial model",
                                   f"malicious: sends the attacked clients a crafted download ({threat.craft})"
                                   if spec.malicious else None),
        per_target=[{"round": j.round, "client": j.client, "mode": str(j.result.trace.get("mode", "n/a")),
                     "objective": float(j.result.trace.get("objective", float("nan"))),
                     "seconds": round(float(j.result.trace.get("seconds", float("nan"))), 3),
                     "batched_with": int(j.result.trace.get("batched_with", 1)), **j.check} for j in scored],
        checks=check_summary([j.check for j in scored if j.check]), notes=notes,
        label_scores=label_scores or None, not_applicable=nothing_scored(spec, scored, rows, notes))
