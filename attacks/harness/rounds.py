"""The round-level flow of the harness (``attacks.harness.attack_recorded`` for an attack of kind
``"aggregate"``). Attacking the rounds of a run recorded under secure aggregation: build each attacked round's
``RoundObservation``, run a round-level attack (kind ``"aggregate"``) on it, then score the result
against the run's ground truth, read only after the attack returned.

``attack_rounds(run, attack, rounds, threat, budget, seed=...)`` is the one path from an
``attacks.recorded.RecordedRun`` (its recorder with ``secure`` set and every round up to the last
attacked one recorded) to a ``RoundOutcome``, which has the shape of the per-client harness's
``attacks.harness.outcome.AttackOutcome`` (``rows``, ``columns``, ``panels``, a typed ``summary`` whose
``record`` is ``summary.json``), so ``fedsec attack`` writes both the same way.

The ground truth of a round is the union of its survivors' training images (what the sum was made
of); a result that names other clients (``trace["clients"]``: e.g. gradient disaggregation rebuilds
every client of its window) is scored against those clients' images instead, each from the latest
recorded round up to the attacked one in which the client trained. What a result may carry, and how
it is scored:

* ``images`` (and ``labels``): each image against its best match among the ground-truth images
  (one-to-one, ``attacks.metrics.score_images``), beside the mean-image prior and the class prior;
  one ``attacks.harness.outcome.IMAGE_COLUMNS`` row per image, its ``client`` the owner of the matched image;
  the leakage statistics (``attacks.metrics.leakage_statistics``) over them;
* a malicious server's read-back of crafted-layer inputs (``variables["inputs"]``: ``sum-binning``,
  ``inconsistency``, ``sybil``) is scored as its per-client twin (``binning``) scores it
  (``AttackSpec.score_target``): one row per ground-truth image, its true input matched one-to-one to a
  recovered one with the relative error as ``input_error`` and the image rebuilt from that input scored
  against it, and the attack's own statistics (the share of inputs recovered exactly);
* ``trace["label_counts"]``: the round's histogram (C,) against the survivors' true one: exact or not,
  and the count error Σₖ|n̂ₖ − nₖ| (the summary's ``histogram``); one ``ROUND_LABEL_COLUMNS`` row per
  class with client −1;
* ``trace["client_label_counts"]``: {client: (C,) counts} against each client's own (the summary's
  ``client_counts``: how many clients' count vectors are exact, with a Clopper–Pearson interval); one
  row per client and class.

A label-only attack writes its label rows as ``attack.csv``; an attack that rebuilds images writes its
image rows there and its label rows (when it has any) as ``label_rows`` (``labels.csv``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fedecouple.engine import derive_seed

from ..base import AttackResult, Budget, NotApplicable
from ..metrics import (SUMMARY_KEYS, leakage_statistics, prediction_accuracy, psnr, score_images,
                       score_label_distribution, summarize_scores)
from ..recorded import RecordedRun, ThreatModel, auxiliary_data
from ..registry import AttackSpec, get
from ..statistics import bootstrap_mean, clopper_pearson
from ..secure.observation import observe_round
from ..secure.sized_binning import scored_record
from .outcome import (IMAGE_COLUMNS, MAX_PANELS, AttackSummary, budget_record, check_summary, threat_record,
                      victim_record)

ROUND_LABEL_COLUMNS = ["method", "attack", "mode", "round", "client", "class", "true_count", "predicted_count",
                       "true_proportion", "predicted_proportion"]
# what a round's result trace adds to its ``per_target`` entry (when it has them): the fit's rank and
# residuals, the per-client reading, the kept data term, where the labels came from, the quantisation bound
TRACE_KEYS = ("rank", "count_residual", "update_residual", "per_client", "data_term", "label_source",
              "count_error_bound")
SERVER_SEES = ("the decoded sum of each round's surviving summands, the masked uploads (uniform noise), who took "
               "part and who dropped out, the downloads it sent, the initial model")


def server_sees(protocol) -> str:
    """What the server held (``SERVER_SEES``), with the fields that travelled in the clear under
    ``protocol`` (a ``SecureAggregation``; None: not recorded)."""
    if protocol is None:
        return SERVER_SEES
    noise = ""
    if getattr(protocol, "private", False):  # distributed DP: the sum the server decodes carries noise
        noise = (f"; distributed DP: each survivor added Skellam noise (mu {protocol.dp_noise:.4g} per value, its "
                 f"values L2-clipped to {protocol.dp_l2_clip:g}) before masking, so the decoded sum carries the "
                 f"survivors' summed noise (its weight factor none)")
    if getattr(protocol, "clear_fields", "flower") == "flower":
        return (SERVER_SEES + noise + "; in the clear beside each masked upload, as Flower's SecAgg+ leaves them: "
                "each survivor's sample count and training metrics")
    return SERVER_SEES + noise + "; nothing in the clear (clear fields hidden, stricter than Flower's SecAgg+)"


@dataclass
class RoundTarget:
    """One attacked round and what came of it."""

    round: int
    observation: object = None
    result: AttackResult | NotApplicable | None = None
    rows: list[dict] = field(default_factory=list)
    label_rows: list[dict] = field(default_factory=list)
    scores: dict = field(default_factory=dict)  # the histogram's and the per-client counts' scores
    check: dict | None = None  # the forward-model check (``forward_check``), where the attack declares one


@dataclass(frozen=True)
class RoundOutcome:
    """``rows`` (``IMAGE_COLUMNS``, or for a label-only attack ``ROUND_LABEL_COLUMNS``), ``label_rows``
    (an image attack's label rows), ``panels`` (truth, reconstruction, PSNR, caption) and the summary."""

    spec: AttackSpec
    rows: list[dict]
    panels: list[tuple]
    summary: AttackSummary
    label_rows: list[dict] = field(default_factory=list)

    @property
    def columns(self) -> list[str]:
        return IMAGE_COLUMNS + list(self.spec.extra_columns) if self.spec.rebuilds_images else ROUND_LABEL_COLUMNS


def attack_rounds(run: RecordedRun, attack: AttackSpec | str, rounds: list[int], threat: ThreatModel, budget: Budget,
                  *, seed: int, victim=None, threads: int = 1, progress: bool = True) -> RoundOutcome:
    """Attack each of ``rounds`` of ``run`` with the round-level ``attack`` under ``threat`` (its
    hyperparameter switch and public data) and ``budget``; score against the ground truth (module
    docstring). ``seed`` seeds every round's attack (its own seed per round) and the statistics;
    ``victim`` is the victim setting the attacked rounds' participants trained in (None: their real
    local training), recorded in the summary."""
    from tqdm import tqdm

    spec = get(attack) if isinstance(attack, str) else attack
    if not spec.round_level:
        raise ValueError(f"{spec.name} attacks one client's upload: use attacks.harness.attack_clients")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    notes: list[str] = []
    auxiliary = public_data(run, threat)
    jobs = [RoundTarget(r) for r in sorted(rounds)]
    try:
        for job in tqdm(jobs, desc=f"{spec.name} on {run.label}", unit="round", disable=not progress):
            try:
                crafted = {c: rec for (r, c), rec in run.crafted.items() if r == job.round}
                job.observation = observe_round(run, job.round, hyperparameters_known=threat.hyperparameters_known,
                                                auxiliary=auxiliary, crafted=crafted, device=run.device)
                if job.observation.aborted:
                    raise NotApplicable(job.observation.aborted)
                job.result = spec.attack_round(job.observation, budget, derive_seed(seed, job.round, 0xA66) % 2**31)
            except NotApplicable as exc:
                job.result = exc
    finally:
        torch.set_num_threads(previous)
    prior, panels = run.dataset.images.mean(dim=0), []
    for job in jobs:
        if isinstance(job.result, NotApplicable):
            notes.append(f"round {job.round}: {job.result}")
            continue
        score_round(run, spec, job, prior, panels)  # ground truth is read only here, after the attack returned
    scored = [j for j in jobs if isinstance(j.result, AttackResult)]
    notes += _shared_notes(scored)
    rows = [row for j in scored for row in (j.rows if spec.rebuilds_images else j.label_rows)]
    label_rows = [row for j in scored for row in j.label_rows] if spec.rebuilds_images else []
    summary = _summary(run, spec, jobs, threat, budget, seed, rows, notes, victim)
    check = run.consistency_check
    if check is not None:  # detections on the rounds whose participants got different downloads
        summary.statistics["consistency_check"] = check.summary(check.inconsistent_rounds())
    return RoundOutcome(spec, rows, panels, summary, label_rows)


def public_data(run: RecordedRun, threat: ThreatModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's public images and labels: ``threat.aux_data``, else the pooled data set without any
    image a client trained on in a recorded round (the server's data is disjoint from theirs)."""
    used = [run.ground_truth.training_set(r, c) for r, c in sorted(run.ground_truth.batches)]
    exclude = np.unique(np.concatenate(used)) if used else np.zeros(0, dtype=np.int64)
    if threat.aux_data is not None:
        return auxiliary_data(threat.aux_data, run.dataset, exclude)
    keep = torch.ones(len(run.dataset), dtype=torch.bool)
    keep[torch.from_numpy(exclude)] = False
    return run.dataset.images[keep], run.dataset.labels[keep]


def training_round(run: RecordedRun, round: int, client: int) -> int | None:
    """The latest recorded round up to ``round`` in which ``client`` trained (None: none)."""
    rounds = [r for r, c in run.ground_truth.batches if c == client and r <= round]
    return max(rounds) if rounds else None


def ground_truth(run: RecordedRun, round: int, clients, whole_sets: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """(pool indices, owning client of each) of the images ``clients`` trained on, each in its latest
    recorded round up to ``round``; with ``whole_sets`` their whole local training sets instead (what a
    label histogram is measured on: class counts cover the images a ragged last batch left out)."""
    indices, owners = [], []
    for c in clients:
        r = training_round(run, round, int(c))
        if r is None:
            continue
        idx = (run.ground_truth.training_set if whole_sets else run.ground_truth.samples)(r, int(c))
        indices.append(idx)
        owners.append(np.full(len(idx), int(c)))
    if not indices:
        return torch.zeros(0, dtype=torch.int64), np.zeros(0, dtype=np.int64)
    return torch.from_numpy(np.concatenate(indices)), np.concatenate(owners)


def score_round(run: RecordedRun, spec: AttackSpec, job: RoundTarget, prior: torch.Tensor, panels: list) -> None:
    """Fill ``job``'s rows and scores from its result and the run's ground truth (module docstring)."""
    result, obs, dataset = job.result, job.observation, run.dataset
    base = {"method": run.method.name, "attack": spec.name, "mode": str(result.trace.get("mode", "n/a")),
            "round": job.round}
    if "label_counts" in result.trace:
        idx, _ = ground_truth(run, job.round, obs.survivors, whole_sets=True)
        true = torch.bincount(dataset.labels[idx], minlength=dataset.num_classes)
        predicted = torch.as_tensor(result.trace["label_counts"], dtype=torch.int64)
        job.label_rows += label_rows(base, -1, true, predicted)
        error = int((predicted - true).abs().sum())
        job.scores["histogram"] = {"exact": error == 0, "count_error": error,
                                   **score_label_distribution(predicted.double(), true)}
    if "client_label_counts" in result.trace:
        job.scores["client_counts"] = _client_counts(run, job, base, result.trace["client_label_counts"])
    record = scored_record(obs.crafted) if spec.score_target is not None and "inputs" in result.variables else None
    if spec.rebuilds_images and (len(result.images) or record is not None):
        clients = result.trace.get("clients", obs.survivors)
        idx, owners = ground_truth(run, job.round, clients)
        job.rows = (_image_rows(run, base, result, idx, owners, prior, panels) if record is None else
                    _recovered_rows(run, spec, base, result, record, idx, owners, prior, panels))
    job.check = forward_check(run, spec, job)


def forward_check(run: RecordedRun, spec: AttackSpec, job: RoundTarget) -> dict | None:
    """The attack's data term at the round's true images against its result's (``RoundAttackSpec.truth_objective``):
    truth lower, the optimiser stopped short (its figure a lower bound); truth higher, the attack's model of
    the sum is wrong (its figure says nothing). None where the attack declares no objective."""
    kept = job.result.trace.get("data_term")
    if spec.truth_objective is None or kept is None:
        return None
    idx, _ = ground_truth(run, job.round, job.observation.survivors)
    truth = float(spec.truth_objective(job.observation, run.dataset.images[idx], run.dataset.labels[idx]))
    return {"truth_data_term": truth, "mis_specified": truth > float(kept), "not_converged": truth < float(kept)}


def label_rows(base: dict, client: int, true: torch.Tensor, predicted: torch.Tensor) -> list[dict]:
    """One ``ROUND_LABEL_COLUMNS`` row per class."""
    t_total, p_total = max(int(true.sum()), 1), max(int(predicted.sum()), 1)
    return [{**base, "client": client, "class": k, "true_count": int(true[k]), "predicted_count": int(predicted[k]),
             "true_proportion": int(true[k]) / t_total, "predicted_proportion": int(predicted[k]) / p_total}
            for k in range(len(true))]


def _client_counts(run: RecordedRun, job: RoundTarget, base: dict, counts: dict) -> dict:
    """Each named client's recovered counts against its own (None: the attack could not resolve it)."""
    exact, errors, unresolved = [], [], []
    for client, predicted in sorted(counts.items(), key=lambda kv: int(kv[0])):
        r = training_round(run, job.round, int(client))
        if r is None:
            continue
        true = torch.bincount(run.dataset.labels[torch.from_numpy(run.ground_truth.training_set(r, int(client)))],
                              minlength=run.dataset.num_classes)
        if predicted is None:
            unresolved.append(int(client))
            exact.append(False)
            continue
        predicted = torch.as_tensor(predicted, dtype=torch.int64)
        job.label_rows += label_rows(base, int(client), true, predicted)
        errors.append(int((predicted - true).abs().sum()))
        exact.append(errors[-1] == 0)
    return {"clients": len(exact), "exact": int(sum(exact)), "unresolved": unresolved, "count_errors": errors}


def _image_rows(run: RecordedRun, base: dict, result: AttackResult, idx: torch.Tensor, owners: np.ndarray,
                prior: torch.Tensor, panels: list) -> list[dict]:
    dataset = run.dataset
    truths, truth_labels = dataset.images[idx], dataset.labels[idx]
    priors = _class_priors(dataset, idx)
    rows = []
    for i, j, row in score_images("images", result.images, result.labels, truths, truth_labels, prior, priors):
        rows.append({**base, "client": int(owners[j]), "image": i, "psnr": row["psnr"], "ssim": row["ssim"],
                     "prior_psnr": row["prior_psnr"], "class_prior_psnr": row["class_prior_psnr"],
                     "label_true": int(truth_labels[j]),
                     "label_pred": int(result.labels[i]) if i < len(result.labels) else -1})
        if len(panels) < MAX_PANELS:
            panels.append((truths[j], result.images[i], row["psnr"], f"r{base['round']} c{int(owners[j])}"))
    return rows


def _class_priors(dataset, idx: torch.Tensor) -> torch.Tensor:
    """(C, ...) class-mean images of every image but those scored against (``idx``)."""
    keep = torch.ones(len(dataset), dtype=torch.bool)
    keep[idx] = False
    sums = torch.zeros(dataset.num_classes, *dataset.images.shape[1:]).index_add_(0, dataset.labels[keep],
                                                                                  dataset.images[keep])
    counts = torch.bincount(dataset.labels[keep], minlength=dataset.num_classes).clamp_min(1)
    return sums / counts.view(-1, *([1] * (dataset.images.dim() - 1)))


def _recovered_rows(run: RecordedRun, spec: AttackSpec, base: dict, result: AttackResult, record, idx: torch.Tensor,
                    owners: np.ndarray, prior: torch.Tensor, panels: list) -> list[dict]:
    """One row per ground-truth image, as the per-client harness scores a malicious read-back
    (``attacks.harness.clients._score_malicious``): ``spec.score_target``'s row (its recovered input's relative
    error as ``input_error``), its owner as ``client``, the class prior's PSNR."""
    dataset = run.dataset
    truths, truth_labels = dataset.images[idx], dataset.labels[idx]
    priors = _class_priors(dataset, idx)
    rows = []
    for row in spec.score_target(run.make_model, record, result, truths, truth_labels, prior):
        j = row.pop("truth_index")
        rows.append({**base, "client": int(owners[j]), "image": j, "label_pred": -1, **row,
                     "class_prior_psnr": float(psnr(priors[int(row["label_true"])], truths[j]))})
        if len(panels) < MAX_PANELS and row["reconstruction"] >= 0:
            panels.append((truths[j], result.images[row["reconstruction"]], row["psnr"],
                           f"r{base['round']} c{int(owners[j])}"))
    return rows


def _shared_notes(scored: list[RoundTarget]) -> list[str]:
    """Each attack note once, saying which rounds it applies to."""
    where: dict[str, list[int]] = {}
    for job in scored:
        for note in job.result.notes:
            where.setdefault(note, []).append(job.round)
    rounds = [j.round for j in scored]
    return [text if len(rounds) == 1 else f"every round: {text}" if found == rounds else
            f"round{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}: {text}" for text, found in where.items()]


def round_statistics(jobs: list[RoundTarget], rows: list[dict], spec: AttackSpec, seed: int) -> dict:
    """The leakage statistics of the image rows, the histogram's exactness over rounds (with a
    Clopper–Pearson interval and the mean count error with a bootstrap interval) and the per-client
    counts' exactness."""
    out = leakage_statistics(rows, seed=seed) if spec.rebuilds_images else {}
    if spec.rebuilds_images and spec.statistics is not None:
        out.update(spec.statistics(rows, seed))  # e.g. a malicious read-back's share of exact inputs
    hist = [j.scores["histogram"] for j in jobs if "histogram" in j.scores]
    if hist:
        errors = np.array([h["count_error"] for h in hist], dtype=float)
        exact = int(sum(h["exact"] for h in hist))
        out["histogram"] = {"rounds": len(hist), "exact_rounds": exact,
                            "exact_rate_ci": list(clopper_pearson(exact, len(hist))),
                            "mean_count_error": float(errors.mean()),
                            "mean_count_error_ci": list(bootstrap_mean(errors, seed=seed)) if len(errors) > 1 else None,
                            "count_errors": errors.astype(int).tolist()}
    per_client = [j.scores["client_counts"] for j in jobs if "client_counts" in j.scores]
    if per_client:
        n, k = sum(c["clients"] for c in per_client), sum(c["exact"] for c in per_client)
        out["client_counts"] = {"clients": n, "exact": k, "exact_rate": k / n if n else None,
                                "exact_rate_ci": list(clopper_pearson(k, n)) if n else None,
                                "unresolved": sum(len(c["unresolved"]) for c in per_client)}
    return out


def _summary(run: RecordedRun, spec: AttackSpec, jobs: list[RoundTarget], threat: ThreatModel, budget: Budget,
             seed: int, rows: list[dict], notes: list[str], victim=None) -> AttackSummary:
    scored = [j for j in jobs if isinstance(j.result, AttackResult)]
    hist = [j.scores["histogram"] for j in scored if "histogram" in j.scores]
    images = spec.rebuilds_images
    label_accuracy = (prediction_accuracy([(r["label_true"], r["label_pred"]) for r in rows])
                      if images and rows else float("nan"))
    nothing = None if (rows or hist or any(j.label_rows for j in scored)) else \
        (notes[0].split(": ", 1)[-1] if notes else "nothing could be scored").strip().rstrip(".")
    return AttackSummary(
        method=run.method.name, attack=spec.name, dataset=run.dataset.name, run=run.label,
        scores=summarize_scores(rows) if images else {k: float("nan") for k in SUMMARY_KEYS},
        statistics=round_statistics(scored, rows if images else [], spec, seed), label_accuracy=label_accuracy,
        class_presence_accuracy=float(np.mean([h["class_presence_accuracy"] for h in hist])) if hist else float("nan"),
        images_scored=len(rows) if images else 0, seed=seed, attack_rounds=[j.round for j in jobs],
        targets={str(j.round): list(j.observation.survivors) for j in jobs if j.observation is not None},
        budget=budget_record(budget, batched=False), victim=victim_record(victim),
        threat_model=threat_record(threat, scored, server_sees(getattr(run.recorder, "secure", None)),
                                   f"malicious: crafts the attacked rounds' downloads ({threat.craft})"
                                   if spec.malicious else None,
                                   public_data=threat.aux_data or "the pooled data set without any client's "
                                                                  "training images"),
        per_target=[{"round": j.round, "client": -1, "survivors": len(j.observation.survivors),
                     "mode": str(j.result.trace.get("mode", "n/a")),
                     "objective": float(j.result.trace.get("objective", float("nan"))),
                     "seconds": round(float(j.result.trace.get("seconds", float("nan"))), 3),
                     **{k: j.result.trace[k] for k in TRACE_KEYS if k in j.result.trace},
                     **j.scores.get("histogram", {}), **(j.check or {})} for j in scored],
        checks=check_summary([j.check for j in scored if j.check is not None]), notes=notes, label_scores=hist or None, not_applicable=nothing)
