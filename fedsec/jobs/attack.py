"""``fedsec attack``: train a federation, intercept through the channel recorder, attack the
recorded run with the library (``attacks.harness.attack_recorded``), write the results.

Round r means "the uploads of round r": round 0 is the first round, answered at the federation's
initial weights, so attacking round 0 with training stopped right after it is the classic
gradient-inversion setting. Training runs max(attack rounds) + 1 rounds unless
``AttackSettings.train_rounds`` says otherwise (later rounds cannot change what was recorded).

This module keeps what belongs to the command: the settings (``AttackSettings``, taken apart once by
``AttackSettings.split`` into the threat model, the budget, the victim setting, seed, batching and
threads), running the attack (``run_attack``) and writing (``write_attack``). Training the federation
with the recorder on (``train_recorded``: the chosen targets train in the victim setting), and the
trainings a report shares (``TrainingCache``), are ``fedsec.recording``'s. The threat model
(``attacks.recorded.ThreatModel``, written into summary.json), the observation of each target, the
attack and its scoring against the harness's ground truth live in ``attacks.recorded`` and
``attacks.harness``; a federation recorded elsewhere (a Flower app, ``fedsec.flower.harness``) goes
through the same library function.

Victim setting: with ``victim_batch`` B ≥ 1 the attacked clients train ``victim_steps`` T steps
per phase on B of their images in the attacked round (the textbook setting); ``victim_batch=0``
leaves their real local training untouched (then ``images`` images are reconstructed and each is
scored against its best match among all images the client trained on that round).

Outputs in ``out``: ``attack.csv`` (one row per reconstructed image: ``IMAGE_COLUMNS``, i.e. method,
attack, mode, round, client, image, psnr, ssim, prior_psnr, class_prior_psnr, label_true, label_pred
and the target's forward-model check: mis_specified, not_converged, replay_cosine, objective_truth,
objective_reconstruction; label_count_error: Σ_k |n̂_k − n_k| of the closed-form label counts
(``attacks.inversion.closed_form``) against the images the client trained on, empty without counts; input_error: for a
malicious-server attack that recovers its crafted layer's inputs, the relative error of the image's recovered input;
for a gradient attack on one image whose classifier step's features the closed form solved (FedeCouple), their
relative error against the image's true features; a malicious-server attack's rows are those its
``AttackSpec.score_target`` scores, with its ``extra_columns`` after these (classifier fishing: one row per
image its craft isolated, with target_class, fished, k_true and k_inferred); for a label attack one row per
class: method, attack, mode, round, client, class, true_count, true_proportion,
predicted_proportion), ``summary.json`` and ``reconstructions.png`` (ground truth above
reconstruction, PSNR under each; not for label attacks), all written atomically. A round-level attack
(``--secure-aggregation``, ``fedsec.secure_attack``) writes its rows as ``attacks.harness.rounds`` scores them,
one attacked round per target, and an image attack's label counts as ``labels.csv``.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable

import pandas as pd
import torch

import attacks
from attacks.base import Budget
from attacks.harness import IMAGE_COLUMNS, LABEL_COLUMNS  # noqa: F401  (re-exported: the report's columns)
from attacks.harness import AttackOutcome, attack_recorded
from attacks.inversion.observation import AUGMENTATION_MODELS, MODES
from attacks.recorded import ThreatModel
from attacks.registry import AttackSpec
from fedecouple.devices import device_record
from fedecouple.engine import VictimSetting
from fedecouple.data.registry import embedded
from fedecouple.errors import UserError
from fedecouple.methods.base import upload_kinds
from reports.figures import reconstruction_grid

from .. import io
from ..recording import TrainingCache, choose_targets, train_recorded, training_key
from ..runner import Prepared, RunConfig, prepare
from ..secure_attack import refusal, with_distributed_privacy
from ..versions import provenance

# training and attacks run small models at small batches: on a shared 2-core machine one thread was
# 6-8x faster than two for IG on the 28x28 CNN (measured)
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
    # tuning federation (seed 1)
    augmentations: str = "free"
    mode: str = "auto"
    start: str = "noise"  # DLG's dummy images: noise or the per-channel mean
    aux_data: str | None = None  # public data the server holds (an embedded data set's name)
    batched: bool = True
    train_rounds: int | None = None  # default: max(rounds) + 1
    threads: int | None = None  # default: the run's, else ATTACK_THREADS
    craft: str | None = None  # a malicious-server attack's crafted download (default: the attack's first)
    download_check: bool = False  # clients test every download and refuse a crafted one (defenses)
    # under secure aggregation, clients compare their download's digest with their neighbours' (defenses)
    consistency_check: bool = False

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

    def split(self) -> "AttackArguments":
        """These (``resolved``) settings taken apart once, into what the training and the library's
        ``attacks.harness.attack_recorded`` take."""
        return AttackArguments(
            spec=self.spec,
            threat=ThreatModel(hyperparameters_known=self.hyperparameters_known, head_known=self.head_known,
                               augmentations=self.augmentations, aux_data=self.aux_data, mode=self.mode,
                               craft=self.craft),
            budget=self.budget(),
            victim=VictimSetting(self.victim_batch, self.victim_steps) if self.victim_batch > 0 else None,
            seed=self.seed, batched=self.batched, threads=self.threads)

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
        if self.aux_data is not None and self.aux_data not in embedded():
            raise UserError(f"--aux-data {self.aux_data!r}: not an embedded data set; choose one of: "
                            f"{', '.join(embedded())}")
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
        if min(self.rounds) < self.spec.first_round:  # classifier fishing reads an earlier round
            raise UserError(f"--attack-rounds {min(self.rounds)}: {self.attack} picks what it crafts from an earlier "
                            f"round (the client's upload, or the round's sum under secure aggregation), which round "
                            f"{min(self.rounds)} has none of; use --attack-rounds {self.spec.first_round} or later")
        if self.train_rounds is not None and self.train_rounds <= max(self.rounds):
            raise UserError(f"--rounds {self.train_rounds} stops before attack round {max(self.rounds)} "
                            f"(rounds count from 0)")

    @property
    def rounds_to_train(self) -> int:
        return max(self.rounds) + 1 if self.train_rounds is None else int(self.train_rounds)


@dataclass(frozen=True)
class AttackArguments:
    """A resolved ``AttackSettings`` split once (``AttackSettings.split``): the attack, the threat
    model, the budget, the victim setting (None: the clients' real local training; its ``targets``
    are filled in where the targets are chosen), the seed, batching and threads."""

    spec: AttackSpec
    threat: ThreatModel
    budget: Budget
    victim: VictimSetting | None
    seed: int
    batched: bool
    threads: int


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


def check_applicable(spec: AttackSpec, prep: Prepared) -> None:
    """A one-line UserError, before anything trains, when the method uploads nothing the attack uses, or
    secure aggregation rules it out (a per-client attack with it on, a round-level one with it off)."""
    model, reason = model_for(prep), None
    if spec.malicious and prep.method.communicates:  # first what a crafted download can reach
        reason = spec.unreachable(prep.method, model)
    reason = reason or spec.not_applicable(prep.method.name, upload_kinds(prep.method, model))
    # a per-client attack under secure aggregation, or a round-level one without it
    reason = reason or refusal(spec, prep.method.name, prep.config.secure.secure_aggregation)
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
               interceptors: Iterable = (), dp=None, trainings: "TrainingCache | None" = None,
               outcomes: list | None = None) -> dict:
    """Train ``config``, attack ``settings.targets`` clients in each attacked round, score, write
    (when ``out`` is given); returns the summary (and appends the ``AttackOutcome``, its rows and images, to
    ``outcomes`` when given: the Python API returns them without reading files back).

    ``interceptors`` (e.g. a ``defenses.FilterChain``) sit in the channel before the recorder,
    so the server sees their output; ``dp`` (a ``defenses.DPConfig``) trains every client with
    DP-SGD and adds the per-client ε to the summary (``"dp"``). ``trainings`` (without interceptors
    and dp) keeps the recorded federation for the next attack whose training is the same
    (``training_key``), so a report trains it once for all of them."""
    start = time.perf_counter()
    settings = settings.resolved(config.federation.seed, config.execution.threads)
    config = config.updated(rounds=settings.rounds_to_train, threads=settings.threads)
    previous_threads = torch.get_num_threads()
    key = (training_key(config, settings) if trainings is not None and dp is None and not interceptors
           and not settings.spec.malicious and not settings.spec.round_level else None)
    try:
        prep = prepare(config)
        if dp is not None:
            from defenses.dp import DPMethod

            prep = replace(prep, method=DPMethod(prep.method, dp))
        check_applicable(settings.spec, prep)
        kept = trainings.get(key, settings.rounds) if key is not None else None
        notes: list[str] = []
        if kept is None:
            fed, run, targets, completed, diverged = train_recorded(prep, settings, interceptors, progress)
            seconds, shared = round(time.perf_counter() - start, 2), {}
            if diverged is not None:  # attack the rounds recorded before it; share nothing
                dropped = [r for r in settings.rounds if r not in completed]
                settings = replace(settings, rounds=tuple(r for r in settings.rounds if r in completed))
                targets = {r: targets[r] for r in settings.rounds}
                notes.append(f"{diverged.removesuffix('; lower --lr')}: attacked round(s) "
                             f"{', '.join(map(str, dropped))} dropped, the rounds recorded before it attacked")
                key = None
            if key is not None:
                trainings.put(key, (fed, run, seconds))
        else:
            fed, run, seconds = kept
            torch.set_num_threads(settings.threads)
            shared = {"training_shared": True}
            targets = choose_targets(fed.sample_clients, settings)  # the kept record was made for other settings
        context = {"train_seconds": seconds, **shared, "config": config.to_dict(),
                   **device_record(config.federation.device)}
        try:
            if dp is not None:
                from defenses.dp import privacy_report

                context["dp"] = io.finite(privacy_report(fed.clients, dp))
            args = settings.split()
            outcome = attack_recorded(run, args.spec, targets, args.threat, args.budget, seed=args.seed,
                                      batched=args.batched, victim=args.victim, threads=args.threads, progress=progress)
            if args.spec.round_level:  # under secure aggregation: what distributed DP's noise bought
                with_distributed_privacy(outcome, run, settings.rounds)
            if outcomes is not None:
                outcomes.append(outcome)
            return write_attack(out, settings, targets, outcome, context, start, notes)
        finally:
            if key is None:
                fed.close()  # e.g. shut down the Ray this run started
    finally:
        torch.set_num_threads(previous_threads)


def write_attack(out: str | Path | None, settings: AttackSettings, targets: dict[int, list[int]],
                 outcome: AttackOutcome, context: dict, start: float, notes: Iterable[str] = ()) -> dict:
    """The summary of ``outcome`` (with the settings, ``context`` and provenance; ``start`` the
    run's start; ``notes`` before the attack's own), and, when ``out`` is given, ``attack.csv``, ``summary.json`` and
    ``reconstructions.png`` (not for a label attack) written there atomically; returns the summary."""
    short = [f"round {r}: only {len(cs)} clients take part, fewer than --targets {settings.targets}"
             for r, cs in targets.items() if len(cs) < settings.targets and not outcome.spec.round_level]
    summary = io.finite(outcome.summary.record(time.perf_counter() - start,
                                               {"settings": asdict(settings), **context, **provenance()},
                                               notes_before=list(notes) + short))
    if out is not None:
        out = Path(out)
        io.write_csv(out / "attack.csv", pd.DataFrame(outcome.rows, columns=outcome.columns))
        if getattr(outcome, "label_rows", None):  # a round-level image attack's label counts
            io.write_csv(out / "labels.csv", pd.DataFrame(outcome.label_rows))
        if outcome.spec.rebuilds_images:
            io.write_bytes(out / "reconstructions.png",
                           reconstruction_grid(outcome.panels, f"{outcome.spec.name} on {outcome.summary.run}"))
        io.write_json(out / "summary.json", summary)
    return summary
