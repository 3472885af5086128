"""Library harness behind ``fedsec attack``: train, intercept through the channel recorder, attack,
score against the harness's ground truth, write the results.

Round r means "the uploads of round r": round 0 is the first round, answered at the federation's
initial weights, so attacking round 0 with training stopped right after it is the classic
gradient-inversion setting. Training runs max(attack rounds) + 1 rounds unless ``train_rounds``
says otherwise (later rounds cannot change what was recorded).

Threat model (written into summary.json): the server sees what the ``Recorder`` stored for each
attacked (round, client) — the download as sent, the upload as received — plus the client's
previous upload; optionally the local hyperparameters (lr, steps, batch size); optionally the
classifier ("head unknown" drops its update). ``make_model()`` gives the model at the
federation's initial weights (the server built it). The ``GroundTruth`` hook (which images the
client trained on) is read only after the attack returned, to score it.

Victim setting: with ``victim_batch`` B ≥ 1 the attacked clients train ``victim_steps`` T steps
per phase on B of their images in the attacked round (the textbook setting); ``victim_batch=0``
leaves their real local training untouched (then ``budget.batch`` images are reconstructed and
each is scored against its best match among all images the client trained on that round).

Outputs in ``out``: ``attack.csv`` (one row per reconstructed image: method, attack, mode, round,
client, image, psnr, ssim, prior_psnr, label_true, label_pred; for ``labels`` one row per class:
method, attack, mode, round, client, class, true_count, true_proportion, predicted_proportion),
``summary.json`` and ``reconstructions.png`` (ground truth above reconstruction, PSNR under each;
not for ``labels``), all written atomically.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
import torch

from attacks import ATTACKS, GRADIENT_ATTACKS, attack_many, plan_batches, score_label_distribution
from attacks.base import Budget, LocalHyperparameters, NotApplicable
from attacks.metrics import score_reconstructions, summarize_scores
from attacks.observation import MODES, observe
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.engine import GroundTruth, VictimSetting, derive_seed
from fedecouple.errors import UserError

from . import io
from .runner import RunConfig, build_federation, prepare
from .versions import package_versions

IMAGE_COLUMNS = ["method", "attack", "mode", "round", "client", "image", "psnr", "ssim", "prior_psnr",
                 "label_true", "label_pred"]
LABEL_COLUMNS = ["method", "attack", "mode", "round", "client", "class", "true_count", "true_proportion",
                 "predicted_proportion"]
# dlg/idlg: L-BFGS steps (the paper's 300, up to 20 evaluations each); ig: Adam steps (one evaluation each)
DEFAULT_ITERATIONS = {"dlg": 300, "idlg": 300, "ig": 1000, "proto": 300, "labels": 300}
MAX_PANELS = 16
# training and attacks run small models at small batches: on a shared 2-core machine one thread was
# 6-8x faster than two for IG on the 28x28 CNN (measured, see BENCHMARKS.md)
ATTACK_THREADS = 1


def default_out(attack: str, method: str) -> str:
    return f"runs/attack-{attack}-{method}"


def parse_rounds(text: str | Iterable[int]) -> list[int]:
    """``"0,2"`` → [0, 2] (sorted, unique, each ≥ 0)."""
    if isinstance(text, str):
        try:
            rounds = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
        except ValueError:
            raise UserError(f"--attack-rounds expects comma-separated integers, got {text!r}") from None
    else:
        rounds = [int(r) for r in text]
    if not rounds:
        raise UserError("--attack-rounds needs at least one round")
    if min(rounds) < 0:
        raise UserError(f"attack rounds count from 0 (the first round); got {min(rounds)}")
    return sorted(set(rounds))


def gradient_free_message(method, attack: str, model) -> str | None:
    """A one-line explanation when ``method`` uploads no model weights (nothing for ``attack``)."""
    manifest = method.manifest(model)
    if any(f.kind in ("extractor", "classifier") for f in manifest):
        return None
    words = {"prototype": "class prototypes", "class_counts": "class counts", "statistic": "statistics",
             "sample_count": "its sample count"}
    sent = sorted({words.get(f.kind, f.kind) for f in manifest}) or ["nothing"]
    return (f"{method.name} uploads no model weights (only {', '.join(sent)}), so there is no gradient for "
            f"{attack} to invert; use `fedsec attack proto --method {method.name}` (prototype inversion) or "
            f"`fedsec attack labels --method {method.name}`")


def pick_targets(participants: list[int], k: int, seed: int, round: int) -> list[int]:
    rng = np.random.default_rng(derive_seed(seed, round, 0xA77AC))
    k = min(k, len(participants))
    return sorted(int(c) for c in rng.choice(participants, size=k, replace=False))



def run_attack(config: RunConfig, attack: str, attack_rounds: Iterable[int] = (0,), targets: int = 2,
               budget: Budget | None = None, victim_batch: int = 1, victim_steps: int = 1, seed: int | None = None,
               out: str | Path | None = None, hyperparameters_known: bool = True, head_known: bool = True,
               mode: str = "auto", train_rounds: int | None = None, threads: int | None = None,
               progress: bool = True, interceptors: Iterable = (), dp=None, images: int | None = None,
               batched: bool = True) -> dict:
    """Train ``config``, attack ``targets`` clients in each of ``attack_rounds``, score, write; returns the summary.

    ``images`` is the number of images rebuilt per target (default: ``victim_batch``, or ``budget.batch``
    without a victim setting; e.g. 2 for one image trained as original + augmented copy).
    ``seed`` (default: ``config.seed``) picks the targets and seeds the attacks; ``threads`` sets
    torch's thread count for training and attack (default: ``config.threads``, else ``ATTACK_THREADS`` = 1).
    ``interceptors`` (e.g. a ``fedsec.defenses.FilterChain``) sit in the channel before the recorder,
    so the server sees their output; ``dp`` (a ``fedsec.defenses.DPConfig``) trains every client with
    DP-SGD and adds the per-client ε to the summary (``"dp"``). ``batched`` (default) optimises targets
    that share a model together (``attacks.batching``: every evaluation equal to one by one to float
    rounding, several times faster; a stalled optimisation can end in another local minimum); with ``config.backend == "ray"`` the batches run as Ray tasks."""
    start = time.perf_counter()
    if attack not in ATTACKS:
        raise UserError(f"unknown attack {attack!r}; choose one of: {', '.join(ATTACKS)}")
    if mode not in MODES:
        raise UserError(f"unknown --mode {mode!r}; choose one of: {', '.join(MODES)}")
    if mode == "replay" and not hyperparameters_known:
        raise UserError("--mode replay needs the local hyperparameters: drop --hyperparameters-unknown or use --mode scaled")
    rounds = parse_rounds(attack_rounds)
    if targets < 1:
        raise UserError(f"--targets must be at least 1, got {targets}")
    if victim_batch < 0 or victim_steps < 1:
        raise UserError(f"--victim-batch must be >= 0 and --victim-steps >= 1 (got {victim_batch}, {victim_steps})")
    budget = budget or Budget(iterations=DEFAULT_ITERATIONS[attack])
    if budget.iterations < 1 or budget.restarts < 1 or budget.batch < 1 or (images is not None and images < 1):
        bad = [f"{flag} {value}" for flag, value in (("--iterations", budget.iterations), ("--restarts", budget.restarts),
                                                      ("--images", images if images is not None else budget.batch))
               if value < 1]
        raise UserError(f"{', '.join(bad)}: must be at least 1")
    n_rounds = max(rounds) + 1 if train_rounds is None else int(train_rounds)
    if n_rounds <= max(rounds):
        raise UserError(f"--rounds {n_rounds} stops before attack round {max(rounds)} (rounds count from 0)")
    seed = config.seed if seed is None else int(seed)
    config = replace(config, rounds=n_rounds, threads=int(threads or config.threads or ATTACK_THREADS))
    previous_threads = torch.get_num_threads()
    try:
        return _run(config, attack, rounds, targets, budget, victim_batch, victim_steps, seed, out,
                    hyperparameters_known, head_known, mode, progress, start, interceptors=interceptors, dp=dp,
                    images=images, batched=batched)
    finally:
        torch.set_num_threads(previous_threads)


def _run(config: RunConfig, attack, rounds, targets, budget, victim_batch, victim_steps, seed, out,
         hyperparameters_known, head_known, mode, progress, start, interceptors=(), dp=None,
         images: int | None = None, batched: bool = True) -> dict:
    n_rounds = config.rounds

    prep = prepare(config)
    if dp is not None:
        from .defenses.dp import DPMethod

        prep = replace(prep, method=DPMethod(prep.method, dp))
    method = prep.method
    if not getattr(method, "communicates", True):
        raise UserError(f"{config.method} never communicates with the server: there is nothing to attack")
    recorder = Recorder(rounds=rounds)
    ground_truth = GroundTruth(rounds=rounds)
    fed = build_federation(prep, channel=ServerChannel(interceptors, recorder=recorder), ground_truth=ground_truth)
    try:
        initial_model = copy.deepcopy(fed.model)  # the server built it: it knows the initial weights
        if attack in GRADIENT_ATTACKS:
            message = gradient_free_message(method, attack, fed.model)
            if message is not None:
                raise UserError(message)

        chosen = {r: pick_targets(fed.sample_clients(r), targets, seed, r) for r in rounds}
        notes: list[str] = []
        for r in rounds:
            if len(chosen[r]) < targets:
                notes.append(f"round {r}: only {len(chosen[r])} clients take part, fewer than --targets {targets}")
        if victim_batch > 0:
            fed.victim = VictimSetting(batch=victim_batch, steps=victim_steps,
                                       targets={(r, c) for r in rounds for c in chosen[r]})

        from tqdm import tqdm

        bar = tqdm(total=n_rounds, desc=f"{config.method} rounds", unit="round", disable=not progress, leave=False)
        fed.run(n_rounds, on_round=lambda r, rows: bar.update(1))
        bar.close()
        train_seconds = time.perf_counter() - start

        dataset = prep.dataset
        prior = dataset.images.mean(dim=0)
        image_shape = tuple(dataset.images.shape[1:])
        make_model = lambda: copy.deepcopy(initial_model)  # noqa: E731
        rows: list[dict] = []
        label_scores: list[dict] = []
        panels: list[tuple] = []
        modes_used: set[str] = set()
        per_target: list[dict] = []
        pairs = [(r, c) for r in rounds for c in chosen[r]]
        target_notes: dict[str, list[tuple[int, int]]] = {}  # note → the targets it applies to
        jobs: list[tuple[int, int, object]] = []  # (round, client, observation)
        for r, c in pairs:
            upload = recorder.get(r, c)
            if upload is None or upload.upload is None:
                notes.append(f"round {r} client {c}: no upload was recorded (dropped)")
                continue
            sample_count = upload.upload.tensors.get("sample_count")
            hp = None
            if hyperparameters_known:
                if victim_batch > 0:
                    hp = LocalHyperparameters(lr=config.lr, steps=victim_steps, batch_size=victim_batch)
                else:
                    n = int(sample_count) if sample_count is not None else config.batch_size
                    steps = config.local_epochs * max(1, math.ceil(n / config.batch_size))
                    hp = LocalHyperparameters(lr=config.lr, steps=steps, batch_size=config.batch_size)
            jobs.append((r, c, observe(recorder, r, c, method=method, make_model=make_model, image_shape=image_shape,
                                       num_classes=dataset.num_classes, known_hyperparameters=hp,
                                       head_known=head_known)))
        results = _attack_jobs(fed.backend, attack, jobs, budget, images, victim_batch, seed, mode, batched,
                               config.threads, progress, f"{attack} on {config.method}")
        for (r, c, _), result in zip(jobs, results):
            if isinstance(result, NotApplicable):
                notes.append(f"round {r} client {c}: {result}")
                continue
            used = str(result.trace.get("mode", "n/a"))
            modes_used.add(used)
            for note in result.notes:
                target_notes.setdefault(note, []).append((r, c))
            per_target.append({"round": r, "client": c, "mode": used,
                               "objective": io.finite(float(result.trace.get("objective", float("nan")))),
                               "seconds": round(float(result.trace.get("seconds", float("nan"))), 3),
                               "batched_with": int(result.trace.get("batched_with", 1))})
            # ---- scoring: ground truth is read only here, after the attack returned ----
            idx = torch.from_numpy(ground_truth.samples(r, c))
            truths, truth_labels = dataset.images[idx], dataset.labels[idx]
            base = {"method": config.method, "attack": attack, "mode": used, "round": r, "client": c}
            if attack == "labels":  # the label distribution of the client's whole local training set
                predicted = torch.as_tensor(result.trace["label_distribution"], dtype=torch.float64)
                local = dataset.labels[torch.from_numpy(ground_truth.training_set(r, c))]
                true_counts = torch.bincount(local, minlength=dataset.num_classes)
                score = score_label_distribution(predicted, true_counts)
                label_scores.append(score)
                total = max(int(true_counts.sum()), 1)
                for k in range(dataset.num_classes):
                    rows.append({**base, "class": k, "true_count": int(true_counts[k]),
                                 "true_proportion": float(true_counts[k]) / total,
                                 "predicted_proportion": float(predicted[k])})
                continue
            if len(truths) > len(result.images) or attack == "proto":
                note = ("each reconstruction is scored against its best match among the images the client trained "
                        "on in that round (for proto: among the images of its class); the prior against the same image")
                if note not in notes:
                    notes.append(note)
            for i, j, row in _score(attack, result, truths, truth_labels, prior):
                rows.append({**base, "image": i, "psnr": row["psnr"], "ssim": row["ssim"],
                             "prior_psnr": row["prior_psnr"], "label_true": int(truth_labels[j]),
                             "label_pred": int(result.labels[i]) if i < len(result.labels) else -1})
                if len(panels) < MAX_PANELS:
                    panels.append((truths[j], result.images[i], row["psnr"], f"r{r} c{c}"))

        attacked = [(t["round"], t["client"]) for t in per_target]
        for text, where in target_notes.items():
            if where == attacked and len(attacked) > 0:
                notes.append(text if len(attacked) == 1 else f"every target: {text}")
            else:
                notes.append(", ".join(f"round {r} client {c}" for r, c in where) + f": {text}")

        columns = LABEL_COLUMNS if attack == "labels" else IMAGE_COLUMNS
        frame = pd.DataFrame(rows, columns=columns)
        summary = _summary(config, attack, rows, label_scores, budget, seed, rounds, chosen, victim_batch, victim_steps,
                           hyperparameters_known, head_known, mode, sorted(modes_used), notes, per_target,
                           time.perf_counter() - start, train_seconds)
        summary["budget"]["images_per_target"] = images or (victim_batch if victim_batch > 0 else budget.batch)
        summary["budget"]["batched"] = bool(batched)
        if dp is not None:
            from .defenses.dp import privacy_report

            summary["dp"] = io.finite(privacy_report(fed.clients, dp))
        if out is not None:
            out = Path(out)
            io.write_csv(out / "attack.csv", frame)
            if attack != "labels":
                write_figure(out / "reconstructions.png", panels, f"{attack} on {config.method}")
            io.write_json(out / "summary.json", summary)
        return summary
    finally:
        fed.close()  # e.g. shut down the Ray this run started


def _attack_jobs(backend, attack: str, jobs: list, budget: Budget, images: int | None, victim_batch: int, seed: int,
                 mode: str, batched: bool, threads: int, progress: bool, description: str) -> list:
    """Attack every (round, client, observation) job: grouped by ``attacks.plan_batches`` (targets that
    share a model are optimised together when ``batched``), each group run by ``backend.map`` (in this
    process, or as a Ray task). One ``AttackResult`` or ``NotApplicable`` per job, in job order."""
    from tqdm import tqdm

    observations = [obs for _, _, obs in jobs]
    seeds = [derive_seed(seed, r, c, 0xA7) % 2**31 for r, c, _ in jobs]
    target_budget = replace(budget, batch=images or (victim_batch if victim_batch > 0 else budget.batch))
    groups = plan_batches(attack, observations, mode, batched)
    bar = tqdm(total=len(jobs), desc=description, unit="target", disable=not progress)
    outcomes = backend.map(attack_many, [(attack, [observations[i] for i in g], target_budget, [seeds[i] for i in g],
                                          mode, batched) for g in groups],
                           threads=threads, on_result=lambda k: bar.update(len(groups[k])))
    bar.close()
    results: list = [None] * len(jobs)
    for group, outcome in zip(groups, outcomes):
        for i, result in zip(group, outcome):
            results[i] = result
    return results


def _score(attack: str, result, truths: torch.Tensor, truth_labels: torch.Tensor, prior: torch.Tensor):
    """(image index, truth index, score row) for each scored reconstruction."""
    if len(truths) == 0:
        return []
    if attack != "proto":
        return [(r["image"], r["truth_index"], r) for r in score_reconstructions(result.images, truths, prior)]
    out = []
    for i in range(len(result.images)):  # class-typical images: scored against the client's images of that class
        k = int(result.labels[i])
        pool = torch.nonzero(truth_labels == k).flatten()
        if len(pool) == 0:
            continue
        (row,) = score_reconstructions(result.images[i:i + 1], truths[pool], prior)
        out.append((i, int(pool[row["truth_index"]]), row))
    return out


def _summary(config: RunConfig, attack, rows, label_scores, budget, seed, rounds, chosen, victim_batch, victim_steps,
             hyperparameters_known, head_known, mode, modes_used, notes, per_target, seconds, train_seconds) -> dict:
    if attack == "labels":
        scores = {k: float("nan") for k in ("mean_psnr", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_ssim")}
        accs = [s["label_accuracy"] for s in label_scores if "label_accuracy" in s]
        label_accuracy = float(np.mean(accs)) if accs else float("nan")
    else:
        scores = summarize_scores(rows)
        pred = [(r["label_true"], r["label_pred"]) for r in rows if r["label_pred"] >= 0]
        label_accuracy = float(np.mean([t == p for t, p in pred])) if pred and attack != "proto" else float("nan")
        if attack == "proto":
            notes = notes + ["proto images are labelled by the prototype's class: label_accuracy does not apply"]
    summary = {
        "method": config.method, "attack": attack, "dataset": config.dataset,
        **{k: scores[k] for k in ("mean_psnr", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_ssim")},
        "label_accuracy": label_accuracy, "images_scored": len(rows) if attack != "labels" else 0,
        "seconds": round(seconds, 2), "train_seconds": round(train_seconds, 2),
        "seed": seed, "attack_rounds": rounds, "targets": {str(r): chosen[r] for r in rounds},
        "budget": {"iterations": budget.iterations, "restarts": budget.restarts},
        "victim": {"batch": victim_batch, "steps": victim_steps} if victim_batch > 0 else None,
        "threat_model": {"hyperparameters_known": hyperparameters_known, "head_known": head_known,
                         "mode_requested": mode, "modes_used": modes_used,
                         "server_sees": "download as sent, upload as received, the client's previous upload, "
                                        "the initial model"},
        "per_target": per_target,
        "config": config.to_dict(), "versions": package_versions(), "notes": notes,
    }
    if label_scores:
        summary["label_scores"] = label_scores
    return io.finite(summary)


def write_figure(path: Path, panels: list[tuple], title: str) -> None:
    """Ground truth (top row) above reconstruction (bottom row), PSNR under each reconstruction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(panels), 1)
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n + 0.6, 3.8), squeeze=False)
    for col in range(n):
        for row in range(2):
            ax = axes[row][col]
            ax.set_xticks([])
            ax.set_yticks([])
            if col >= len(panels):
                ax.axis("off")
                continue
            truth, recon, psnr, caption = panels[col]
            img = (truth if row == 0 else recon).detach().clamp(0, 1)
            if img.shape[0] == 1:
                ax.imshow(img[0].numpy(), cmap="gray", vmin=0, vmax=1)
            else:
                ax.imshow(img.permute(1, 2, 0).numpy())
            if row == 0:
                ax.set_title(caption, fontsize=8)
            else:
                ax.set_xlabel("inf dB" if math.isinf(psnr) else f"{psnr:.1f} dB", fontsize=9)
    axes[0][0].set_ylabel("truth", fontsize=9)
    axes[1][0].set_ylabel("reconstruction", fontsize=9)
    if not panels:
        axes[0][0].text(0.5, 0.5, "nothing to show", ha="center", va="center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
