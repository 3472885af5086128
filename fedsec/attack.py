"""Library harness behind ``fedsec attack``: train, intercept through the channel recorder, attack,
score against the harness's ground truth, write the results.

Round r means "the uploads of round r": round 0 is the first round, answered at the federation's
initial weights, so attacking round 0 with training stopped right after it is the classic
gradient-inversion setting. Training runs max(attack rounds) + 1 rounds unless
``AttackSettings.train_rounds`` says otherwise (later rounds cannot change what was recorded).

Threat model (written into summary.json): the server sees what the ``Recorder`` stored for each
attacked (round, client) — the download as sent, the upload as received — plus the client's
previous upload; optionally the local hyperparameters (lr, steps, batch size); optionally the
classifier ("head unknown" drops its update). ``make_model()`` gives the model at the
federation's initial weights (the server built it). The ``GroundTruth`` hook (which images the
client trained on) is read only after the attack returned, to score it.

Victim setting: with ``victim_batch`` B ≥ 1 the attacked clients train ``victim_steps`` T steps
per phase on B of their images in the attacked round (the textbook setting); ``victim_batch=0``
leaves their real local training untouched (then ``images`` images are reconstructed and each is
scored against its best match among all images the client trained on that round).

Two halves: ``run_attack`` trains a federation in fedsec's engine and hands the recorded run
(``fedsec.recorded.RecordedRun``) to ``attack_recorded``, which attacks, scores and writes; a
federation recorded elsewhere (a Flower app) goes straight to ``attack_recorded``.

Outputs in ``out``: ``attack.csv`` (one row per reconstructed image: ``IMAGE_COLUMNS``, i.e. method,
attack, mode, round, client, image, psnr, ssim, prior_psnr, class_prior_psnr, label_true, label_pred
and the target's forward-model check: mis_specified, not_converged, replay_cosine, objective_truth,
objective_reconstruction; label_count_error: Σ_k |n̂_k − n_k| of the closed-form label counts
(``attacks.closed_form``) against the images the client trained on, empty without counts; input_error: for a
malicious-server attack, the relative error of the image's recovered first-linear-layer input; for a label
attack one row per
class: method, attack, mode, round, client, class, true_count, true_proportion,
predicted_proportion), ``summary.json`` and ``reconstructions.png`` (ground truth above
reconstruction, PSNR under each; not for label attacks), all written atomically.
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
import torch

import attacks
from attacks.base import AttackResult, Budget, KnownSchedule, LocalHyperparameters, NotApplicable
from attacks.metrics import (SUMMARY_KEYS, leakage_statistics, prediction_accuracy, psnr, score_images,
                             score_label_distribution, summarize_scores)
from attacks.inversion.observation import AUGMENTATION_MODELS, MODES, observe
from attacks.registry import AttackSpec
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.devices import device_record
from fedecouple.engine import GroundTruth, VictimSetting, derive_seed
from fedecouple.data.registry import EMBEDDED
from fedecouple.errors import UserError
from fedecouple.methods.base import phase_steps
from fedecouple.methods.replay import Step
from reports.figures import reconstruction_grid

from . import io
from .recorded import RecordedRun
from .runner import Prepared, RunConfig, build_federation, prepare
from .versions import provenance

IMAGE_COLUMNS = ["method", "attack", "mode", "round", "client", "image", "psnr", "ssim", "prior_psnr",
                 "class_prior_psnr", "label_true", "label_pred", "mis_specified", "not_converged", "replay_cosine",
                 "objective_truth", "objective_reconstruction", "label_count_error", "input_error"]
CHECK_KEYS = ("mis_specified", "not_converged", "replay_cosine", "replay_relative_error", "objective_truth", "objective_reconstruction")
LABEL_COLUMNS = ["method", "attack", "mode", "round", "client", "class", "true_count", "true_proportion",
                 "predicted_proportion"]
MAX_PANELS = 16
# training and attacks run small models at small batches: on a shared 2-core machine one thread was
# 6-8x faster than two for IG on the 28x28 CNN (measured, see BENCHMARKS.md)
ATTACK_THREADS = 1


@dataclass
class AttackSettings:
    """How one attack runs. ``None`` fields take the attack's declared defaults (``AttackSpec``) or
    the run's (``seed``, ``threads``) when ``resolved``."""

    attack: str = "dlg"
    rounds: tuple[int, ...] = (0,)
    targets: int = 2  # clients attacked per attacked round (seeded choice)
    iterations: int | None = None
    restarts: int | None = None  # default: the attack's declared restarts
    images: int | None = None  # images rebuilt per target (default: victim_batch, or 1)
    victim_batch: int | None = None
    victim_steps: int = 1
    seed: int | None = None  # target choice and attack starts (default: the run's seed)
    hyperparameters_known: bool = True
    head_known: bool = True
    # how the attacker models the augmented copies a client trains on: "free" (unknown images),
    # "family" (transforms of the image, parameters unknown), "oracle" (the client's batch order and
    # draws are known: an upper bound). free was the stronger of the two without the draws on the
    # tuning federation (seed 1; BENCHMARKS.md, "Attacks")
    augmentations: str = "free"
    mode: str = "auto"
    start: str = "noise"  # DLG's dummy images: noise or the per-channel mean
    aux_data: str | None = None  # public data the server holds (an embedded data set's name)
    batched: bool = True
    train_rounds: int | None = None  # default: max(rounds) + 1
    threads: int | None = None  # default: the run's, else ATTACK_THREADS
    craft: str | None = None  # a malicious-server attack's crafted download (default: the attack's first)
    download_check: bool = False  # clients test every download and refuse a crafted one (fedsec.defenses)

    @property
    def spec(self) -> AttackSpec:
        if self.attack not in attacks.ATTACKS:
            raise UserError(f"unknown attack {self.attack!r}; choose one of: {', '.join(attacks.ATTACKS)}")
        return attacks.ATTACKS[self.attack]

    @property
    def images_per_target(self) -> int:
        if self.images is not None:  # 0 is a value to refuse (validate), not "the default"
            return self.images
        return self.victim_batch if self.victim_batch else 1

    def budget(self) -> Budget:
        return Budget(iterations=self.iterations, restarts=self.restarts, batch=self.images_per_target,
                      start=self.start)

    def resolved(self, seed: int = 0, threads: int | None = None) -> "AttackSettings":
        """Defaults filled in and every value checked (one-line ``UserError``s): the attack's declared
        iterations and victim setting; ``seed`` and ``threads`` (the run's) where none was given."""
        spec = self.spec
        out = replace(self, rounds=tuple(parse_rounds(self.rounds)),
                      iterations=spec.default_iterations if self.iterations is None else int(self.iterations),
                      restarts=spec.default_restarts if self.restarts is None else int(self.restarts),
                      victim_batch=spec.default_victim_batch if self.victim_batch is None else int(self.victim_batch),
                      seed=int(seed) if self.seed is None else int(self.seed),
                      threads=int(self.threads or threads or ATTACK_THREADS),
                      craft=self.craft if self.craft is not None or not spec.malicious else spec.crafts[0])
        out.validate()
        return out

    def validate(self) -> None:
        if self.craft is not None and self.craft not in self.spec.crafts:
            raise UserError(f"--craft {self.craft}: {self.attack} crafts " +
                            (", ".join(self.spec.crafts) if self.spec.malicious else "no download (an honest server)"))
        if self.mode not in MODES:
            raise UserError(f"unknown --mode {self.mode!r}; choose one of: {', '.join(MODES)}")
        if self.mode in ("replay", "method") and not self.hyperparameters_known:
            raise UserError(f"--mode {self.mode} needs the local hyperparameters: drop --hyperparameters-unknown or "
                            f"use --mode scaled")
        if self.aux_data is not None and self.aux_data not in EMBEDDED:
            raise UserError(f"--aux-data {self.aux_data!r}: not an embedded data set; choose one of: "
                            f"{', '.join(EMBEDDED)}")
        if self.augmentations not in AUGMENTATION_MODELS:
            raise UserError(f"unknown --augmentations {self.augmentations!r}; choose one of: "
                            f"{', '.join(AUGMENTATION_MODELS)}")
        if self.augmentations == "oracle" and not self.hyperparameters_known:
            raise UserError("--augmentations oracle needs the local hyperparameters: drop --hyperparameters-unknown")
        if self.targets < 1:
            raise UserError(f"--targets must be at least 1, got {self.targets}")
        if self.victim_batch < 0 or self.victim_steps < 1:
            raise UserError(f"--victim-batch must be >= 0 and --victim-steps >= 1 "
                            f"(got {self.victim_batch}, {self.victim_steps})")
        bad = [f"{flag} {value}" for flag, value in (("--iterations", self.iterations), ("--restarts", self.restarts),
                                                      ("--images", self.images_per_target)) if value < 1]
        if bad:
            raise UserError(f"{', '.join(bad)}: must be at least 1")
        if self.train_rounds is not None and self.train_rounds <= max(self.rounds):
            raise UserError(f"--rounds {self.train_rounds} stops before attack round {max(self.rounds)} "
                            f"(rounds count from 0)")

    @property
    def rounds_to_train(self) -> int:
        return max(self.rounds) + 1 if self.train_rounds is None else int(self.train_rounds)


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


def parse_attacks(text: str | Iterable[str]) -> list[str]:
    """Registered attack names from ``"dlg,ig"`` (or a list); unknown names are one-line errors."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if str(t).strip()]
    if not items:
        raise UserError("--attacks needs at least one attack (comma-separated)")
    unknown = [a for a in items if a not in attacks.ATTACKS]
    if unknown:
        raise UserError(f"unknown attack{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"choose from: {', '.join(attacks.ATTACKS)}")
    return list(dict.fromkeys(items))


def pick_targets(participants: list[int], k: int, seed: int, round: int) -> list[int]:
    rng = np.random.default_rng(derive_seed(seed, round, 0xA77AC))
    k = min(k, len(participants))
    return sorted(int(c) for c in rng.choice(participants, size=k, replace=False))


def check_applicable(spec: AttackSpec, prep: Prepared) -> None:
    """A one-line UserError, before anything trains, when the method uploads nothing the attack uses."""
    model, reason = model_for(prep), None
    if spec.malicious and prep.method.communicates:  # first what a crafted download can reach
        from attacks.malicious import not_reachable

        reason = not_reachable(prep.method, model)
    reason = reason or spec.not_applicable(prep.method.name, prep.method.upload_kinds(model))
    if reason is not None:
        raise UserError(reason)


def model_for(prep: Prepared):
    """A model of the configured architecture (for a method's manifest: shapes, not weights)."""
    from fedecouple.models import build_model, default_architecture

    ds = prep.dataset
    arch = prep.config.federation.arch or default_architecture(ds.channels, ds.image_size)
    return build_model(arch, ds.channels, ds.image_size, ds.num_classes, ds.mean, ds.std)


# ----------------------------------------------------------------------------------------------
# training a federation for the attack
# ----------------------------------------------------------------------------------------------
def run_attack(config: RunConfig, settings: AttackSettings, out: str | Path | None = None, progress: bool = True,
               interceptors: Iterable = (), dp=None, trainings: "TrainingCache | None" = None) -> dict:
    """Train ``config``, attack ``settings.targets`` clients in each attacked round, score, write
    (when ``out`` is given); returns the summary.

    ``interceptors`` (e.g. a ``fedsec.defenses.FilterChain``) sit in the channel before the recorder,
    so the server sees their output; ``dp`` (a ``fedsec.defenses.DPConfig``) trains every client with
    DP-SGD and adds the per-client ε to the summary (``"dp"``). ``trainings`` (without interceptors
    and dp) keeps the recorded federation for the next attack whose training is the same
    (``training_key``), so a report trains it once for all of them."""
    start = time.perf_counter()
    settings = settings.resolved(config.federation.seed, config.execution.threads)
    config = config.updated(rounds=settings.rounds_to_train, threads=settings.threads)
    previous_threads = torch.get_num_threads()
    key = (training_key(config, settings) if trainings is not None and dp is None and not interceptors
           and not settings.spec.malicious else None)
    try:
        prep = prepare(config)
        if dp is not None:
            from .defenses.dp import DPMethod

            prep = replace(prep, method=DPMethod(prep.method, dp))
        check_applicable(settings.spec, prep)
        kept = trainings.get(key, settings.rounds) if key is not None else None
        if kept is None:
            fed, run, _ = train_recorded(prep, settings, interceptors, progress)
            context = {"train_seconds": round(time.perf_counter() - start, 2), "config": config.to_dict(),
                       **device_record(config.federation.device)}
            if key is not None:
                trainings.put(key, (fed, run, context["train_seconds"]))
        else:
            fed, run, seconds = kept
            torch.set_num_threads(settings.threads)
            context = {"train_seconds": seconds, "training_shared": True, "config": config.to_dict(),
                       **device_record(config.federation.device)}
        targets = {r: pick_targets(fed.sample_clients(r), settings.targets, settings.seed, r) for r in settings.rounds}
        try:
            if dp is not None:
                from .defenses.dp import privacy_report

                context["dp"] = io.finite(privacy_report(fed.clients, dp))
            return attack_recorded(run, settings, targets, out, progress=progress, context=context, start=start)
        finally:
            if key is None:
                fed.close()  # e.g. shut down the Ray this run started
    finally:
        torch.set_num_threads(previous_threads)


def training_key(config: RunConfig, settings: AttackSettings | None = None) -> str:
    """What a recorded training is, as far as results go: the run's result key with the rounds
    trained, and the victim setting (with its targets; real local training does not depend on
    them). ``settings`` None: plain training of ``config``'s rounds."""
    victim = ({"batch": settings.victim_batch, "steps": settings.victim_steps, "targets": settings.targets,
               "seed": settings.seed} if settings is not None and settings.victim_batch > 0 else None)
    rounds = config.federation.rounds if settings is None else settings.rounds_to_train
    return json.dumps({"config": config.updated(rounds=rounds).result_key(), "victim": victim}, sort_keys=True)


class TrainingCache:
    """Recorded trainings (federation, ``RecordedRun``, training seconds) kept for later stages with
    the same ``training_key`` whose rounds the record covers: a report runs one method's stages in a
    row, and its train stage (recording every round), audit and real-training attacks share one
    federation. ``close`` releases them all."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple] = {}

    def get(self, key: str, rounds: Iterable[int] | None = None) -> tuple | None:
        """The kept training under ``key`` if its record holds ``rounds`` (None: every round)."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        recorded = [kept[1].recorder.rounds, kept[1].ground_truth.rounds]
        if all(r is None for r in recorded) or (rounds is not None and all(set(rounds) <= r for r in recorded)):
            return kept
        return None

    def put(self, key: str, value: tuple) -> None:
        old = self._kept.pop(key, None)
        if old is not None:
            old[0].close()
        self._kept[key] = value

    def close(self) -> None:
        for fed, *_ in self._kept.values():
            fed.close()
        self._kept.clear()


def train_recorded(prep: Prepared, settings: AttackSettings, interceptors: Iterable = (),
                   progress: bool = True) -> tuple:
    """Train with a recorder on the attacked rounds; the chosen targets train in the victim setting.
    Returns (federation, its ``RecordedRun``, {round: targets})."""
    from tqdm import tqdm

    fed, run, targets = recording_federation(prep, settings, interceptors)
    try:
        bar = tqdm(total=settings.rounds_to_train, desc=f"{prep.method.name} rounds", unit="round",
                   disable=not progress, leave=False)
        fed.run(settings.rounds_to_train, on_round=lambda r, rows: bar.update(1))
        bar.close()
    except BaseException:
        fed.close()
        raise
    return fed, run, targets


def recording_federation(prep: Prepared, settings: AttackSettings | None = None, interceptors: Iterable = ()) -> tuple:
    """An untrained federation whose channel records the attacked rounds (``settings`` None: every
    round) and the harness's ground truth, the chosen targets in the victim setting: (federation,
    its ``RecordedRun``, {round: targets}). Whoever trains it (``train_recorded``, or a report's
    train stage) fills the record."""
    rounds = None if settings is None else settings.rounds
    recorder, ground_truth = Recorder(rounds=rounds), GroundTruth(rounds=rounds)
    fed = build_federation(prep, channel=ServerChannel(interceptors, recorder=recorder), ground_truth=ground_truth)
    initial_model = copy.deepcopy(fed.model).cpu()  # the server built it (observations move it to the device)
    targets = {} if settings is None else {r: pick_targets(fed.sample_clients(r), settings.targets, settings.seed, r)
                                           for r in settings.rounds}
    if settings is not None and settings.victim_batch > 0:
        fed.victim = VictimSetting(batch=settings.victim_batch, steps=settings.victim_steps,
                                   targets={(r, c) for r in settings.rounds for c in targets[r]})
    run = RecordedRun(recorder, ground_truth, prep.dataset, prep.method, lambda: copy.deepcopy(initial_model),
                      prep.config.federation.train, prep.config.method, fed.backend,
                      device=prep.config.federation.device)
    if settings is not None and settings.spec.malicious:
        run.crafted = _malicious_server(prep, settings, targets, fed, run).records
    if settings is not None and settings.download_check:
        from .defenses.download_check import DownloadCheck

        run.download_check = DownloadCheck(lambda c: prep.dataset.images[torch.from_numpy(prep.partition.train[c])],
                                           run.make_model)
        fed.channel.interceptors.append(run.download_check)  # last: it sees what reaches the client
    return fed, run, targets


def _malicious_server(prep: Prepared, settings: AttackSettings, targets: dict, fed, run: RecordedRun):
    """The crafting interceptor for the attacked (round, client) pairs, last in the channel; it crafts
    from public images: ``--aux-data``, else the pooled data without the attacked clients' own."""
    from .malicious import MaliciousServer, public_images

    attacked = [prep.partition.train[c] for r in targets for c in targets[r]]
    exclude = np.concatenate(attacked) if attacked else np.zeros(0, dtype=np.int64)
    if settings.aux_data is not None:
        pool = auxiliary_data(settings.aux_data, prep.dataset, exclude)[0]
        public = public_images(pool, np.zeros(0, dtype=np.int64), settings.seed)
    else:
        public = public_images(prep.dataset.images, exclude, settings.seed)
    server = MaliciousServer(settings.craft, {(r, c) for r in targets for c in targets[r]}, run.make_model, public,
                             prep.method.download_reaches, settings.seed)
    fed.channel.interceptors.append(server)
    return server


# ----------------------------------------------------------------------------------------------
# attacking a recorded run
# ----------------------------------------------------------------------------------------------
@dataclass
class _Target:
    """One attacked (round, client) and what came of it."""

    round: int
    client: int
    observation: object = None
    result: AttackResult | NotApplicable | None = None
    rows: list[dict] = field(default_factory=list)
    check: dict = field(default_factory=dict)  # the forward-model check (attacks.forward_check)


def attack_recorded(run: RecordedRun, settings: AttackSettings, targets: dict[int, list[int]],
                    out: str | Path | None = None, progress: bool = True, context: dict | None = None,
                    start: float | None = None) -> dict:
    """Attack the ``targets`` ({round: clients}) of a recorded run, score against its ground truth,
    write ``attack.csv``, ``summary.json`` and ``reconstructions.png`` into ``out``; returns the
    summary. ``settings`` must be ``resolved``; ``context`` adds run facts to the summary."""
    start = time.perf_counter() if start is None else start
    spec = settings.spec
    notes = [f"round {r}: only {len(cs)} clients take part, fewer than --targets {settings.targets}"
             for r, cs in targets.items() if len(cs) < settings.targets]
    jobs = _observe_targets(run, settings, targets, notes)
    auxiliary = jobs[0].observation.auxiliary if jobs else None
    _attack_targets(run, settings, jobs, progress)
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
    summary = _summary(run, settings, targets, scored, rows, notes, time.perf_counter() - start, context or {})
    if out is not None:
        _write_outputs(Path(out), spec, rows, panels, summary, f"{spec.name} on {run.label}")
    return summary


def _known_hyperparameters(run: RecordedRun, settings: AttackSettings, upload) -> LocalHyperparameters | None:
    """The "hyperparameters known" threat model: the client's lr, batch size and epochs (or, in the
    victim setting, its steps and images), and its number of samples from its upload; the steps
    are derived the way the client takes them (``phase_steps``: a ragged last batch is dropped)."""
    if not settings.hyperparameters_known:
        return None
    train = run.train
    if settings.victim_batch > 0:
        return LocalHyperparameters(lr=train.lr, steps=settings.victim_steps, batch_size=settings.victim_batch,
                                    epochs=train.local_epochs, samples=settings.victim_batch,
                                    steps_per_phase=settings.victim_steps)
    sample_count = upload.tensors.get("sample_count")
    n = int(sample_count) if sample_count is not None else train.batch_size
    steps = sum(phase_steps(epochs, n, train.batch_size) for _, epochs, _ in run.method.local_phases(train.local_epochs))
    return LocalHyperparameters(lr=train.lr, steps=steps, batch_size=train.batch_size, epochs=train.local_epochs,
                                samples=n)


def _known_schedule(run: RecordedRun, round: int, client: int) -> KnownSchedule:
    """The oracle threat model: the client's true batch order and augmentation draws (harness-only
    ground truth handed to the attacker on purpose, for an upper bound)."""
    records = run.ground_truth.schedule(round, client)
    return KnownSchedule([Step(r.phase, tuple(int(p) for p in r.positions)) for r in records],
                         [r.draws for r in records])


def auxiliary_data(name: str, like, exclude: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedded data set ``name`` as public data of ``like``'s domain: resized (bilinear) to its
    image size and converted to its number of channels. When it is ``like`` itself, the images at
    ``exclude`` (the attacked clients' own) are left out: the server's data is disjoint from theirs."""
    data = EMBEDDED[name]()
    x, labels = data.images, data.labels
    if name == like.name and exclude is not None and len(exclude):
        keep = torch.ones(len(labels), dtype=torch.bool)
        keep[torch.from_numpy(exclude)] = False
        x, labels = x[keep], labels[keep]
    if x.shape[-1] != like.image_size:
        x = torch.nn.functional.interpolate(x, size=(like.image_size, like.image_size), mode="bilinear",
                                            align_corners=False).clamp(0, 1)
    if x.shape[1] != like.channels:
        x = x.mean(dim=1, keepdim=True).expand(-1, like.channels, -1, -1).contiguous()
    return x, labels


def round_prototypes(run: RecordedRun, round: int) -> dict[int, torch.Tensor]:
    """Per class, the mean of the prototypes every client uploaded in ``round`` (the server sees them
    all; equal weights)."""
    from attacks.inversion.proto import per_class_values

    specs = [s for s in run.method.manifest(run.make_model()) if s.kind == "prototype" and s.per_class]
    sums: dict[int, list[torch.Tensor]] = {}
    for (r, _), exchange in sorted(run.recorder.exchanges.items()):
        if r == round and exchange.upload is not None:
            for k, proto in per_class_values(dict(exchange.upload.tensors), specs).items():
                sums.setdefault(k, []).append(proto.float().flatten())
    return {k: torch.stack(v).mean(0) for k, v in sorted(sums.items())}


def _observe_targets(run: RecordedRun, settings: AttackSettings, targets: dict[int, list[int]],
                     notes: list[str]) -> list[_Target]:
    image_shape = tuple(run.dataset.images.shape[1:])
    # gradient attacks compute on the run's device; proto and labels (cheap, no vmap) on the CPU
    device = run.device if settings.spec.kind == "gradient" else "cpu"
    attacked = [run.ground_truth.training_set(r, c) for r in targets for c in targets[r]]
    auxiliary = None if settings.aux_data is None else auxiliary_data(
        settings.aux_data, run.dataset, np.concatenate(attacked) if attacked else None)
    jobs = []
    for r in sorted(targets):
        for c in targets[r]:
            exchange = run.recorder.get(r, c)
            if exchange is None or exchange.upload is None:
                notes.append(f"round {r} client {c}: no upload was recorded (dropped)")
                continue
            hp = _known_hyperparameters(run, settings, exchange.upload)
            obs = observe(run.recorder, r, c, method=run.method, make_model=run.make_model, image_shape=image_shape,
                          num_classes=run.dataset.num_classes, known_hyperparameters=hp, head_known=settings.head_known,
                          device=device)
            if settings.augmentations == "oracle":
                obs.known_schedule = _known_schedule(run, r, c)
            else:
                obs.copies = settings.augmentations
            if auxiliary is not None:
                obs.auxiliary, obs.round_prototypes = auxiliary, round_prototypes(run, r)
            obs.crafted = run.crafted.get((r, c))
            jobs.append(_Target(r, c, obs))
    return jobs


def _attack_targets(run: RecordedRun, settings: AttackSettings, jobs: list[_Target], progress: bool) -> None:
    """Attack every job: planned once by ``attacks.plan`` (targets that share a model are optimised
    together when batched), each batch run by ``run.backend.map`` (here, or as a Ray task)."""
    from tqdm import tqdm

    seeds = [derive_seed(settings.seed, j.round, j.client, 0xA7) % 2**31 for j in jobs]
    batches, failed = attacks.plan(settings.attack, [j.observation for j in jobs], settings.budget(), settings.mode,
                                   settings.batched)
    bar = tqdm(total=len(jobs), desc=f"{settings.attack} on {run.label}", unit="target", disable=not progress)
    outcomes = run.backend.map(attacks.Batch.run, [(b, [seeds[i] for i in b.indices]) for b in batches],
                               threads=settings.threads, on_result=lambda k: bar.update(len(batches[k].indices)))
    bar.close()
    for i, exc in failed.items():
        jobs[i].result = exc
    for batch, outcome in zip(batches, outcomes):
        for i, result in zip(batch.indices, outcome):  # scored on the CPU (its variables stay for the check)
            jobs[i].result = replace(result, images=result.images.cpu(), labels=result.labels.cpu())


def _class_priors(run: RecordedRun, job: _Target, auxiliary) -> torch.Tensor:
    """(C, ...) class-mean images of data the attacker could hold: its public data when it has some,
    else every pooled image but the target client's own training images."""
    if auxiliary is not None:
        images, labels = auxiliary
    else:
        keep = torch.ones(len(run.dataset), dtype=torch.bool)
        keep[torch.from_numpy(run.ground_truth.training_set(job.round, job.client))] = False
        images, labels = run.dataset.images[keep], run.dataset.labels[keep]
    sums = torch.zeros(run.dataset.num_classes, *images.shape[1:]).index_add_(0, labels, images)
    counts = torch.bincount(labels, minlength=run.dataset.num_classes).clamp_min(1)
    return sums / counts.view(-1, *([1] * (images.dim() - 1)))


def _score_target(run: RecordedRun, spec: AttackSpec, job: _Target, prior: torch.Tensor, panels: list,
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
        job.check = _forward_check(run, spec, job)
    idx = torch.from_numpy(run.ground_truth.samples(job.round, job.client))
    truths, truth_labels = dataset.images[idx], dataset.labels[idx]
    if spec.malicious:
        return _score_malicious(run, job, base, truths, truth_labels, prior, panels, auxiliary)
    if len(truths) > len(result.images) or spec.scoring == "class-images":
        note = ("each reconstruction is scored against its best match among the images the client trained "
                "on in that round (for proto: among the images of its class); the prior against the same image")
        if note not in notes:
            notes.append(note)
    rows = []
    class_priors = _class_priors(run, job, auxiliary)
    counts = (result.trace.get("closed_form") or {}).get("label_counts")
    count_error = (None if counts is None else
                   int((torch.tensor(counts) - torch.bincount(truth_labels, minlength=len(counts))).abs().sum()))
    for i, j, row in score_images(spec.scoring, result.images, result.labels, truths, truth_labels, prior,
                                  class_priors):
        rows.append({**base, "image": i, "psnr": row["psnr"], "ssim": row["ssim"], "prior_psnr": row["prior_psnr"],
                     "class_prior_psnr": row["class_prior_psnr"],
                     "label_true": int(truth_labels[j]),
                     "label_pred": int(result.labels[i]) if i < len(result.labels) else -1,
                     **{k: job.check.get(k) for k in IMAGE_COLUMNS if k in CHECK_KEYS}, "label_count_error": count_error})
        if len(panels) < MAX_PANELS:
            panels.append((truths[j], result.images[i], row["psnr"], f"r{job.round} c{job.client}"))
    return rows


def _score_malicious(run: RecordedRun, job: _Target, base: dict, truths, truth_labels, prior, panels: list,
                     auxiliary) -> list[dict]:
    """Every image the client trained on: its recovered input's relative error and the image rebuilt
    from it (``fedsec.malicious.score_recovered``)."""
    from .malicious import score_recovered

    class_priors = _class_priors(run, job, auxiliary)
    rows = []
    for row in score_recovered(run.make_model, run.crafted[(job.round, job.client)], job.result, truths, prior):
        j = row["truth_index"]
        rows.append({**base, "image": j, "psnr": row["psnr"], "ssim": row["ssim"], "prior_psnr": row["prior_psnr"],
                     "class_prior_psnr": float(psnr(class_priors[int(truth_labels[j])], truths[j])),
                     "label_true": int(truth_labels[j]), "label_pred": -1, "input_error": row["input_error"]})
        if len(panels) < MAX_PANELS and row["reconstruction"] >= 0:
            panels.append((truths[j], job.result.images[row["reconstruction"]], row["psnr"],
                           f"r{job.round} c{job.client}"))
    return rows


def _forward_check(run: RecordedRun, spec: AttackSpec, job: _Target) -> dict:
    """``attacks.forward_check.check`` (prototype inversion: ``prototype_check``) with the target's ground
    truth (its training set in order, its batches): read here, after the attack returned."""
    from attacks.inversion.forward_check import check, prototype_check

    idx = torch.from_numpy(run.ground_truth.training_set(job.round, job.client))
    if spec.matching is None:  # prototype inversion: the client's true class images against the inverted sets
        return prototype_check(job.observation, job.result, run.dataset.images[idx], run.dataset.labels[idx])
    mode = str(job.result.trace.get("mode", "auto")).replace("scaled-gradient", "scaled")
    device = job.observation.device
    return check(job.observation, mode, spec.matching, job.result, run.dataset.images[idx].to(device),
                 run.dataset.labels[idx].to(device), run.ground_truth.schedule(job.round, job.client))


def _shared_notes(scored: list[_Target]) -> list[str]:
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


def _summary(run: RecordedRun, settings: AttackSettings, targets: dict, scored: list[_Target], rows: list[dict],
             notes: list[str], seconds: float, context: dict) -> dict:
    spec = settings.spec
    label_scores = [j.result.trace["label_score"] for j in scored if "label_score" in j.result.trace]
    scores = summarize_scores(rows) if spec.rebuilds_images else {k: float("nan") for k in SUMMARY_KEYS}
    if spec.scoring == "images":
        label_accuracy = prediction_accuracy([(r["label_true"], r["label_pred"]) for r in rows])
    else:
        label_accuracy = float("nan")
        if spec.scoring == "class-images":
            notes = notes + [f"{spec.name} images are labelled by the prototype's class: label_accuracy does not apply"]
    presence = [s["class_presence_accuracy"] for s in label_scores]
    statistics = leakage_statistics(rows, seed=settings.seed) if spec.rebuilds_images else {}
    if spec.malicious:
        from .malicious import input_statistics

        statistics.update(input_statistics(rows, settings.seed))
    if run.download_check is not None:
        from .defenses.download_check import detection_summary

        attacked = set(run.crafted) if spec.malicious else set()
        statistics["download_check"] = detection_summary(run.download_check.decisions, attacked)
    summary = {
        "method": run.method.name, "attack": spec.name, "dataset": run.dataset.name, "run": run.label,
        **{k: scores[k] for k in SUMMARY_KEYS},
        **statistics, "label_accuracy": label_accuracy,
        "class_presence_accuracy": float(np.mean(presence)) if presence else float("nan"),
        "images_scored": len(rows) if spec.rebuilds_images else 0,
        "seconds": round(seconds, 2), "seed": settings.seed, "attack_rounds": list(settings.rounds),
        "targets": {str(r): targets[r] for r in settings.rounds if r in targets},
        "budget": {"iterations": settings.iterations, "restarts": settings.restarts,
                   "images_per_target": settings.images_per_target, "batched": settings.batched},
        "victim": {"batch": settings.victim_batch, "steps": settings.victim_steps} if settings.victim_batch > 0 else None,
        "threat_model": {"hyperparameters_known": settings.hyperparameters_known, "head_known": settings.head_known,
                         "mode_requested": settings.mode,
                         "modes_used": sorted({str(j.result.trace.get("mode", "n/a")) for j in scored}),
                         "server_sees": "download as sent, upload as received, the client's previous upload, "
                                        "the initial model",
                         **({"server": f"malicious: sends the attacked clients a crafted download ({settings.craft})"}
                            if spec.malicious else {})},
        "per_target": [{"round": j.round, "client": j.client, "mode": str(j.result.trace.get("mode", "n/a")),
                        "objective": float(j.result.trace.get("objective", float("nan"))),
                        "seconds": round(float(j.result.trace.get("seconds", float("nan"))), 3),
                        "batched_with": int(j.result.trace.get("batched_with", 1)), **j.check} for j in scored],
        **_check_summary([j.check for j in scored if j.check]),
        "settings": asdict(settings), **context, **provenance(), "notes": notes,
    }
    if label_scores:
        summary["label_scores"] = label_scores
    return io.finite(summary)


def _check_summary(checks: list[dict]) -> dict:
    """The forward-model check over all targets: whether any was mis-specified, how many stopped short
    of the truth's objective (``not_converged``), the worst replay."""
    if not checks:
        return {"mis_specified": None, "mis_specified_targets": None, "not_converged_targets": None,
                "replay_cosine_min": None}
    flags = [c["mis_specified"] for c in checks if c.get("mis_specified") is not None]
    short = [c["not_converged"] for c in checks if c.get("not_converged") is not None]
    cosines = [c["replay_cosine"] for c in checks if c.get("replay_cosine") is not None]
    return {"mis_specified": any(flags) if flags else None, "mis_specified_targets": sum(flags) if flags else None,
            "not_converged_targets": sum(short) if short else None,
            "replay_cosine_min": min(cosines) if cosines else None}


def _write_outputs(out: Path, spec: AttackSpec, rows: list[dict], panels: list, summary: dict, title: str) -> None:
    columns = IMAGE_COLUMNS if spec.rebuilds_images else LABEL_COLUMNS
    io.write_csv(out / "attack.csv", pd.DataFrame(rows, columns=columns))
    if spec.rebuilds_images:
        io.write_bytes(out / "reconstructions.png", reconstruction_grid(panels, title))
    io.write_json(out / "summary.json", summary)
