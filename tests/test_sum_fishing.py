"""Classifier fishing through secure aggregation (``sum-fishing``): one download for the whole round,
the round's one image of the target class rebuilt from the sum, the refusals, and the command."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

from attacks.base import Budget, NotApplicable
from attacks.harness import IMAGE_COLUMNS
from attacks.recorded import RecordedRun, ThreatModel
from attacks.secure import sum_fishing
from attacks.harness import attack_rounds
from attacks.secure.observation import observe_round
from defenses.consistency_check import ConsistencyCheck
from fedecouple.channel import Recorder, ServerChannel
from fedecouple.data import load_dataset
from fedecouple.data.partition import Partition
from fedecouple.engine import Federation, FederationConfig, GroundTruth
from fedecouple.methods import make_method
from fedecouple.methods.base import TrainConfig
from fedecouple.methods.facets import download_reach
from fedecouple.secure_aggregation import SecureAggregation
from fedsec.malicious import MaliciousServer, public_rows

CLIENTS, IMAGES, TARGET = 4, 5, 7


def round_with_one_seven(seed: int = 0):
    """Clients of one batch of IMAGES digits each, FedAvg under SecAgg with max_weight = IMAGES (each
    client's weight 1: its update stands far above the quantisation); the round's 20 images hold one 7 and
    at least two of every other class, the same images in both rounds. Round 0 is honest; every
    participant of round 1 gets sum-fishing's download. Returns the recorded run, the owner of the 7 and
    the consistency check the clients ran."""
    data = load_dataset("digits")
    labels = data.labels.numpy()
    rng = np.random.default_rng(seed)
    want = {c: 2 for c in range(10)}
    want[TARGET], want[0] = 1, 3
    pool = np.concatenate([rng.choice(np.flatnonzero(labels == c), n, replace=False) for c, n in want.items()])
    rng.shuffle(pool)
    train = [np.sort(pool[i * IMAGES:(i + 1) * IMAGES]) for i in range(CLIENTS)]
    owner = next(i for i, idx in enumerate(train) if (labels[idx] == TARGET).any())
    partition = Partition("custom", 10, train, [np.zeros(0, dtype=np.int64)] * CLIENTS)
    protocol = SecureAggregation(max_weight=float(IMAGES))
    config = TrainConfig(lr=0.05, batch_size=IMAGES, local_epochs=1)
    recorder, truth = Recorder(), GroundTruth()
    channel = ServerChannel([], recorder=recorder, secure=protocol)
    fed = Federation(make_method("fedavg"), data, partition, FederationConfig(rounds=2, seed=seed, train=config),
                     channel=channel, ground_truth=truth)
    initial = copy.deepcopy(fed.model)
    make = lambda: copy.deepcopy(initial)  # noqa: E731
    rows = torch.from_numpy(public_rows(len(data.images), pool, seed))
    server = MaliciousServer(sum_fishing.SPEC, "fishing", {(1, c) for c in range(CLIENTS)}, make, data.images[rows],
                             download_reach(fed.method), seed, public_labels=data.labels[rows], method=fed.method,
                             train=config, secure=protocol)
    check = ConsistencyCheck(protocol)
    channel.interceptors.extend([server, check])  # the check last: it sees what reaches the clients
    fed.run_round()
    fed.run_round()
    run = RecordedRun(recorder, truth, data, fed.method, make, config, "sum-fishing test")
    run.crafted = server.records
    return run, owner, check


@pytest.fixture(scope="module")
def fished():
    return round_with_one_seven()


def test_the_rounds_one_image_of_the_target_class_is_rebuilt_from_the_sum(fished):
    run, owner, check = fished
    assert check.flagged_rounds() == set()  # one download for every participant: nothing to catch
    outcome = attack_rounds(run, sum_fishing.SPEC, [1], ThreatModel(craft="fishing"), Budget(iterations=300),
                            seed=0, progress=False)
    # the label histogram read from round 0's aggregate makes the one 7 the round's rarest class
    (row,) = outcome.rows
    assert (row["target_class"], row["label_true"], row["fished"]) == (TARGET, TARGET, True)
    assert row["k_true"] == row["k_inferred"] == 1 and row["client"] == owner
    # measured 46-50 dB against a mean-image prior of 10-12 dB (seeds 0-5): a margin of 20 dB has room
    assert row["psnr"] >= row["prior_psnr"] + 20.0
    assert outcome.summary.statistics["fishing_targets"] == 1
    assert outcome.summary.statistics["fishing_success_share"] == 1.0


def test_it_refuses_an_honest_server_and_a_sum_without_the_crafted_classifier(fished):
    run, _, _ = fished
    honest = observe_round(run, 1, crafted={})  # no record: the server sent no fishing download
    with pytest.raises(NotApplicable, match="must be malicious"):
        sum_fishing.sum_fishing(honest, Budget(iterations=1), 0)
    crafted = observe_round(run, 1, crafted={c: r for (r_, c), r in run.crafted.items() if r_ == 1})
    headless = dataclasses.replace(crafted, total={k: v for k, v in crafted.total.items()
                                                   if not k.startswith("classifier.")})
    with pytest.raises(NotApplicable, match="holds no classifier"):
        sum_fishing.sum_fishing(headless, Budget(iterations=1), 0)


def test_a_method_training_under_its_own_head_is_refused_before_training():
    from helpers import digits_model

    _, model = digits_model()
    reason = sum_fishing.SPEC.unreachable(make_method("fedper"), model)
    assert reason is not None and "classifier" in reason
    assert sum_fishing.SPEC.unreachable(make_method("fedavg"), model) is None


def test_fedsec_attack_sum_fishing_writes_the_per_image_fishing_columns(tmp_path):
    from fedsec.cli import main

    out = tmp_path / "sum-fishing"
    main(["attack", "sum-fishing", "--method", "fedavg", "--secure-aggregation", "--dataset", "digits",
          "--clients", "4", "--train-images", "5", "--batch-size", "5", "--iterations", "5", "--threads", "1",
          "--out", str(out)])
    rows = pd.read_csv(out / "attack.csv")
    assert list(rows.columns) == IMAGE_COLUMNS + ["target_class", "fished", "k_true", "k_inferred"]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["targets"]) == ["1"]  # it reads round 0's aggregate: round 1 unless told
    assert len(rows) >= 1 and set(rows["client"]) <= set(summary["targets"]["1"])
    assert (rows["attack"] == "sum-fishing").all() and (rows["round"] == 1).all()
    assert summary["fishing_targets"] == 1
