"""Recorded training: a federation trained with the channel recorder on, for the jobs that attack or
audit what its server received (``fedsec attack``, ``audit``, ``defend``, ``report`` and the Flower
jobs).

``recording_federation`` builds an untrained federation whose channel records the attacked rounds and
the harness's ground truth, the chosen targets (``choose_targets``) training in the victim setting
(and, for a malicious-server attack, the crafting interceptor last in the channel);
``train_recorded`` trains it, keeping what it recorded before a divergence. ``TrainingCache`` keeps
recorded trainings under their ``training_key`` so that a report's stages train each one once.

``settings`` is always a resolved ``fedsec.jobs.attack.AttackSettings``; it is not imported here
(not even for annotations) because the attack job imports this module.
"""
from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Iterable

import numpy as np
import torch

from attacks.recorded import RecordedRun, auxiliary_data
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.engine import GroundTruth, derive_seed
from fedecouple.errors import DIVERGED, UserError
from fedecouple.methods.facets import download_reach

from .field_names import for_cli
from .runner import Prepared, RunConfig, build_federation
from .secure_attack import record_rounds, round_targets


def pick_targets(participants: list[int], k: int, seed: int, round: int) -> list[int]:
    rng = np.random.default_rng(derive_seed(seed, round, 0xA77AC))
    k = min(k, len(participants))
    return sorted(int(c) for c in rng.choice(participants, size=k, replace=False))


def choose_targets(participants, settings) -> dict[int, list[int]]:
    """{round: the ``settings.targets`` clients attacked} for every attacked round, chosen (seeded) from
    ``participants(round)``; for a round-level attack every participant."""
    if settings.spec.round_level:
        return round_targets(participants, settings.rounds)
    return {r: pick_targets(participants(r), settings.targets, settings.seed, r) for r in settings.rounds}


def training_key(config: RunConfig, settings=None) -> str:
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


def train_recorded(prep: Prepared, settings, interceptors: Iterable = (),
                   progress: bool = True) -> tuple:
    """Train with a recorder on the attacked rounds; the chosen targets train in the victim setting.
    Returns (federation, its ``RecordedRun``, {round: targets}, the rounds it completed, and the
    divergence's message or None). A training that diverges after completing some attacked round
    keeps what it recorded (those rounds' uploads were made before it diverged); one that diverges
    before any attacked round is done raises its one-line error."""
    from tqdm import tqdm

    fed, run, targets = recording_federation(prep, settings, interceptors)
    completed: list[int] = []
    diverged = None
    try:
        bar = tqdm(total=settings.rounds_to_train, desc=f"{prep.method.name} rounds", unit="round",
                   disable=not progress, leave=False)

        def on_round(r: int, rows) -> None:
            completed.append(r)
            bar.update(1)

        try:
            fed.run(settings.rounds_to_train, on_round=on_round)
        except UserError as exc:
            if not str(exc).startswith(DIVERGED) or not set(settings.rounds) & set(completed):
                raise
            diverged = for_cli(exc)  # a note the run's files keep: named as the command line names it
        bar.close()
    except BaseException:
        fed.close()
        raise
    return fed, run, targets, completed, diverged


def recording_federation(prep: Prepared, settings=None, interceptors: Iterable = ()) -> tuple:
    """An untrained federation whose channel records the attacked rounds (``settings`` None: every
    round) and the harness's ground truth, the chosen targets in the victim setting: (federation,
    its ``RecordedRun``, {round: targets}). Whoever trains it (``train_recorded``, or a report's
    train stage) fills the record."""
    rounds = None if settings is None else record_rounds(settings.spec, settings.rounds)
    recorder, ground_truth = Recorder(rounds=rounds), GroundTruth(rounds=rounds)
    fed = build_federation(prep, channel=ServerChannel(interceptors, recorder=recorder), ground_truth=ground_truth)
    initial_model = copy.deepcopy(fed.model).cpu()  # the server built it (observations move it to the device)
    targets = {} if settings is None else choose_targets(fed.sample_clients, settings)
    victim = None if settings is None else settings.split().victim
    if victim is not None:
        fed.victim = replace(victim, targets={(r, c) for r in settings.rounds for c in targets[r]})
    run = RecordedRun(recorder, ground_truth, prep.dataset, prep.method, lambda: copy.deepcopy(initial_model),
                      prep.config.federation.train, prep.config.method, fed.backend,
                      device=prep.config.federation.device)
    if settings is not None and settings.spec.malicious:
        run.crafted = _malicious_server(prep, settings, targets, fed, run).records
    if settings is not None and settings.download_check:
        from defenses.download_check import DownloadCheck

        run.download_check = DownloadCheck(lambda c: prep.dataset.images[torch.from_numpy(prep.partition.train[c])],
                                           run.make_model)
        fed.channel.interceptors.append(run.download_check)  # last: it sees what reaches the client
    if settings is not None and settings.consistency_check:
        from defenses.consistency_check import ConsistencyCheck

        run.consistency_check = ConsistencyCheck(fed.channel.secure)  # refuses without secure aggregation
        fed.channel.interceptors.append(run.consistency_check)  # last: it digests what reaches the client
    return fed, run, targets


def _malicious_server(prep: Prepared, settings, targets: dict, fed, run: RecordedRun):
    """The crafting interceptor for the attacked (round, client) pairs (the attack's own craft,
    ``CraftingSpec.craft_download``), last in the channel; it crafts from public images: ``--aux-data``,
    else the pooled data without the attacked clients' own."""
    from .malicious import MaliciousServer, public_rows

    attacked = [prep.partition.train[c] for r in targets for c in targets[r]]
    exclude = np.concatenate(attacked) if attacked else np.zeros(0, dtype=np.int64)
    if settings.aux_data is not None:
        images, labels = auxiliary_data(settings.aux_data, prep.dataset, exclude)
        rows = torch.from_numpy(public_rows(len(images), np.zeros(0, dtype=np.int64), settings.seed))
    else:
        images, labels = prep.dataset.images, prep.dataset.labels
        rows = torch.from_numpy(public_rows(len(images), exclude, settings.seed))
    server = MaliciousServer(settings.spec, settings.craft, {(r, c) for r in targets for c in targets[r]},
                             run.make_model, images[rows], download_reach(prep.method), settings.seed,
                             public_labels=labels[rows], method=prep.method, train=prep.config.federation.train,
                             secure=fed.channel.secure)
    fed.channel.interceptors.append(server)
    return server
