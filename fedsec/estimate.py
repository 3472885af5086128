"""How long a report will take, printed before it starts: rates measured on the reference machine
(2 CPU cores, one torch thread; the audit preset's run), scaled by the work a stage does. An attack
that declares its own rate (``AttackSpec.estimate_rate``, e.g. a malicious server's) is timed by it;
the others by their own measured rate for the setting and method (``STEP_SECONDS``), else by the
rates of their kind (``KIND_STEP_SECONDS``). The report's stage table sets each computed stage's
estimate beside its wall time.

A rough guide, not a promise: the rates are for mnist5k's 28×28 CNN; a stage's training is scaled
by the images each client trains on per round (samples × local epochs), an attack's optimisation
by its targets, rounds, steps and starts (what its starts cost: ``AttackSpec.estimate_starts``, less
than one run each for an attack that races them; and, on real local training, by the client's images
per epoch). Stages already done (or reused) count zero; stages that share a recorded training (a
report's train stage, its audit and its real-training attacks) count it once.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedecouple.methods import METHODS

# reference: mnist5k, pathological K=3, 20 clients (~187 training images each), 1 local epoch
REFERENCE_IMAGES = 187
# seconds per client per round of training (the local update and the driver's evaluation): each method's
# declared ``round_seconds`` (``fedecouple.methods.METHODS``), else this
DEFAULT_ROUND_SECONDS = 0.15
# seconds per optimiser step of one target and per image: in the textbook setting the images it
# rebuilds; on real local training the images the client trains on (the whole epoch is replayed at
# every step); "image" is prototype inversion (one image per target step). Per attack and setting,
# per method (None: the attack's rate for a method not listed). Measured in the audit preset's run
# (bench/results.py --cell audit-preset: work units of each stage against its wall seconds)
STEP_SECONDS = {("ig", "textbook"): {"fedecouple": 0.0115, "fedpac": 0.00445, "fedper": 0.0014, "fedavg": 0.0021,
                                      None: 0.005},
                # on real local training the rate also carries the training of the stage's own federation
                ("fedavg-leak", "real"): {"fedecouple": 0.0050, "fedpac": 0.0028, "fedper": 0.00145,
                                          "fedavg": 0.0032, None: 0.003},
                ("proto", "image"): {"fedpac": 0.0231, "fedproto": 0.0327, None: 0.028}}
# an attack without rates of its own: its kind's (the first attack measured of that kind), times its
# ``AttackSpec.estimate_step_factor``
KIND_STEP_SECONDS = {"textbook": STEP_SECONDS[("ig", "textbook")], "real": STEP_SECONDS[("fedavg-leak", "real")],
                     "image": STEP_SECONDS[("proto", "image")]}
# seconds per target beyond its optimiser steps (observation, forward-model check, scoring), per image
TARGET_SECONDS_PER_IMAGE = 0.006
TARGET_SECONDS = 0.1


@dataclass
class StageWork:
    """What one stage will compute (``None`` fields: nothing of that kind)."""

    method: str
    clients: int
    rounds: int  # rounds trained (0: the training is shared or already done)
    images_per_client: float  # training images per client per round (samples x local epochs)
    attack_kind: str | None = None  # gradient | image | labels | malicious
    setting: str | None = None  # textbook | real (gradient attacks)
    targets: int = 0  # attacked clients over all attacked rounds
    steps: float = 0  # optimiser steps x the cost of the starts per target (in one-start runs)
    images: float = 0.0  # images per target the step cost scales with
    # the attack's own seconds per step (``AttackSpec.estimate_rate``; None: the rates of its kind),
    # times the images per target (``per_image``) or once per target
    step_seconds: float | None = None
    per_image: bool = True
    step_factor: float = 1.0  # its step in steps of the kind's rate (``AttackSpec.estimate_step_factor``)
    attack: str | None = None  # the attack's name: its own measured rates where there are some


def round_seconds(method: str) -> float:
    """Seconds per client per round of ``method``'s training at ``REFERENCE_IMAGES`` images: its declared
    ``round_seconds``, else ``DEFAULT_ROUND_SECONDS``."""
    return METHODS.fact("round_seconds").get(method, DEFAULT_ROUND_SECONDS)


def seconds(work: StageWork) -> float:
    """The stage's estimated wall time on the reference machine."""
    per_client = round_seconds(work.method) * work.images_per_client / REFERENCE_IMAGES
    total = work.rounds * work.clients * per_client
    if work.step_seconds is not None:
        total += work.targets * (TARGET_SECONDS + TARGET_SECONDS_PER_IMAGE * work.images
                                 + work.steps * (work.images if work.per_image else 1.0) * work.step_seconds)
    elif work.attack_kind in ("gradient", "image"):
        setting = work.attack_kind if work.attack_kind != "gradient" else work.setting or "textbook"
        own = STEP_SECONDS.get((work.attack, setting))
        rates, factor = (own, 1.0) if own is not None else (KIND_STEP_SECONDS[setting], work.step_factor)
        images = 1.0 if work.attack_kind == "image" else work.images
        total += work.targets * (TARGET_SECONDS + TARGET_SECONDS_PER_IMAGE * images
                                 + work.steps * images * rates.get(work.method, rates[None]) * factor)
    elif work.attack_kind is not None:
        total += work.targets * TARGET_SECONDS
    return total


def describe(total_seconds: float, device: str = "cpu") -> str:
    """The estimate in words, and where the rates were measured: on any other device (a GPU) no rate was
    measured, so the figure is the reference machine's, said as such rather than passed off as this one's."""
    minutes = total_seconds / 60
    text = f"about {minutes:.0f} min" if minutes >= 2 else f"about {total_seconds:.0f} s"
    if str(device).startswith("cpu"):
        return text + " on a 2-core CPU machine like the one the rates were measured on"
    return (text + f" on the 2-core CPU machine the rates were measured on; no rates are measured for {device}, "
                   "so its time is unknown")


def attack_work(method: str, clients: int, images_per_client: float, settings, train_rounds: int) -> StageWork:
    """The work of one attack run (``settings``: resolved ``AttackSettings``) that trains
    ``train_rounds`` rounds first (0: its training is shared)."""
    real, spec = settings.victim_batch == 0, settings.spec
    refused = spec.malicious and settings.download_check  # nothing uploaded, nothing rebuilt
    return StageWork(method, clients, train_rounds, images_per_client, attack_kind=spec.kind,
                     setting="real" if real else "textbook",
                     # a round-level attack's target is a round (``attacks.secure``), not a client
                     targets=(1 if spec.round_level else settings.targets) * len(settings.rounds),
                     steps=0 if refused else settings.iterations * (
                         settings.restarts if spec.estimate_starts is None
                         else spec.estimate_starts(settings.restarts, settings.iterations)),
                     # a round's sum holds every participant's images
                     images=(images_per_client if real else settings.victim_batch) * (clients if spec.round_level else 1),
                     step_seconds=spec.estimate_rate, per_image=spec.estimate_per == "image",
                     step_factor=spec.estimate_step_factor, attack=spec.name)


def training_images(prep) -> float:
    """Images a client trains on per round, on average (samples x local epochs)."""
    train = prep.partition.train
    return sum(len(t) for t in train) / max(len(train), 1) * prep.config.federation.train.local_epochs
