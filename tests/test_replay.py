"""Each method's replay of its local training (``Method.replay``), run on the client's true batches
and augmentation draws (the oracle), reproduces what the client uploaded; and the steps a server
derives from the hyperparameters are the steps the client took."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from attacks.base import LocalHyperparameters
from attacks.observation import observe, planned_steps, replay_context, update_target
from fedecouple.data.augment import BatchAugmenter
from fedecouple.engine import VictimSetting
from fedecouple.methods import METHODS, make_method
from fedecouple.methods.base import phase_steps
from fedecouple.methods.replay import Step
from fedecouple.models import set_params

from helpers import tiny_federation

WITH_WEIGHTS = ["fedavg", "ft-fedavg", "fedper", "fedrep", "fedpac", "fedecouple"]
# methods whose every before-state the server knows after round 0 (no private head)
KNOWN_START = {"fedavg", "ft-fedavg", "fedpac", "fedecouple"}


def _run(digits, method, victim: bool, rounds: int, hp=None):
    targets = {(r, c) for r in range(rounds) for c in range(3)}
    setting = VictimSetting(batch=3, steps=2, targets=targets) if victim else None
    fed = tiny_federation(digits, method, clients=3, rounds=rounds, victim=setting, hp=hp)
    fed.config.train.local_epochs = 2
    initial = copy.deepcopy(fed.model)
    set_params(initial, fed.initial_params)
    fed.run(rounds)
    return fed, lambda: copy.deepcopy(initial)


def replay_on_truth(fed, make_model, digits, round, client):
    """(simulated upload, recorded upload) with the client's true batches and draws."""
    obs = observe(fed.channel.recorder, round, client, method=fed.method, make_model=make_model,
                  image_shape=tuple(digits.images.shape[1:]), num_classes=10,
                  known_hyperparameters=LocalHyperparameters(lr=fed.config.train.lr, steps=1, batch_size=10))
    records = fed.ground_truth.schedule(round, client)
    steps = [Step(r.phase, tuple(int(p) for p in r.positions)) for r in records]
    context = replay_context(obs, update_target(obs).before, steps)
    idx = torch.from_numpy(fed.ground_truth.training_set(round, client))
    x, y = digits.images[idx], digits.labels[idx]
    augmenter = BatchAugmenter(x.shape[-1])
    copies = [None if r.draws is None else augmenter.apply(x[torch.from_numpy(r.positions)], r.draws)
              for r in records]
    return fed.method.replay(make_model(), context, x, y, copies), obs, update_target(obs)


def _agreement(simulated, obs, target) -> tuple[float, float]:
    """(cosine, relative error) between the replayed and the observed update Δ of every uploaded weight."""
    a = torch.cat([(simulated[n] - target.before[n]).reshape(-1).double() for n in target.names])
    b = torch.cat([target.delta[n].reshape(-1).double() for n in target.names])
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0)), float((a - b).norm() / b.norm())


@pytest.mark.parametrize("victim", [True, False], ids=["victim", "real-training"])
@pytest.mark.parametrize("method", WITH_WEIGHTS)
def test_the_replay_on_the_true_batches_reproduces_the_upload(digits, method, victim):
    torch.set_num_threads(1)
    rounds = 2 if method in KNOWN_START else 1
    fed, make_model = _run(digits, method, victim, rounds)
    for r in range(rounds):
        for c in range(3):
            simulated, obs, target = replay_on_truth(fed, make_model, digits, r, c)
            cosine, relative = _agreement(simulated, obs, target)
            assert cosine >= 0.99999 and relative <= 1e-4, (method, r, c, cosine, relative)
            for name, value in obs.upload.items():  # statistics the method uploads (FedPAC)
                if name.startswith(("prototype.", "h", "V", "class_counts")):
                    torch.testing.assert_close(simulated[name].to(value.dtype), value, rtol=1e-4, atol=1e-5)


def test_without_the_draws_fedecouple_differs_by_its_augmented_copies(digits):
    """Without the oracle the server does not know the augmentation draws: replaying with the
    un-augmented images in their place gives a visibly different update (what free copies are for)."""
    fed, make_model = _run(digits, "fedecouple", victim=True, rounds=1)
    obs = observe(fed.channel.recorder, 0, 0, method=fed.method, make_model=make_model, image_shape=(1, 8, 8),
                  num_classes=10, known_hyperparameters=LocalHyperparameters(lr=0.05, steps=1, batch_size=10))
    records = fed.ground_truth.schedule(0, 0)
    target = update_target(obs)
    context = replay_context(obs, target.before, [Step(r.phase, tuple(int(p) for p in r.positions)) for r in records])
    idx = torch.from_numpy(fed.ground_truth.training_set(0, 0))
    x, y = digits.images[idx], digits.labels[idx]
    wrong = [x[torch.from_numpy(r.positions)] for r in records]  # the originals instead of their copies
    cosine, relative = _agreement(fed.method.replay(make_model(), context, x, y, wrong), obs, target)
    assert cosine < 0.9999 and relative > 1e-3, (cosine, relative)


@pytest.mark.parametrize("method", ["fedavg", "fedrep", "fedecouple"])
def test_the_servers_step_count_is_the_clients(digits, method):
    """With a ragged last batch (n not a multiple of the batch size) the client drops it; the steps a
    server derives from lr, batch size, epochs and n are exactly the client's, phase by phase."""
    fed, _ = _run(digits, method, victim=False, rounds=1)
    for c in range(3):
        n = len(fed.ground_truth.training_set(0, c))
        assert n % 10 != 0 or c > 0  # digits' pathological split gives ragged clients
        hp = LocalHyperparameters(lr=0.05, steps=0, batch_size=10, epochs=2, samples=n)
        steps, _ = planned_steps(fed.method, hp)
        planned = {p: sum(s.phase == p for s in steps) for p in dict.fromkeys(s.phase for s in steps)}
        assert planned == fed.ground_truth.steps_per_phase(0, c)
        assert sum(planned.values()) < 2 * -(-n // 10) * len(planned)  # fewer than with the ragged batches


def test_phase_steps_drops_the_ragged_batch():
    assert phase_steps(2, 195, 10) == 38 and phase_steps(1, 7, 10) == 1 and phase_steps(3, 0, 10) == 0
    assert phase_steps(5, 40, 10, steps_per_phase=2) == 2
    assert all(METHODS[m]().local_phases(1) for m in METHODS)
    assert [p for p, _, _ in make_method("fedecouple", glf=False).local_phases(1)] == ["classifier", "extractor"]
    assert np.all([aug for _, _, aug in make_method("fedecouple").local_phases(1)])


# ------------------------------------------------------------------------------------------------
# the augmentation family and the forward-model check


def test_the_augmentation_family_holds_flip_inversion_and_brightness_exactly(digits):
    from attacks.observation import family_copy, family_start
    from fedecouple.data.augment import paper_augmentation

    x = digits.images[:3]
    ops = paper_augmentation(8).transforms
    identity = family_start(3)
    torch.testing.assert_close(family_copy(x, identity), x, atol=1e-6, rtol=0)
    flip = identity.clone()
    flip[:, 2] = -1.0  # x' = -x
    torch.testing.assert_close(family_copy(x, flip), ops[1].transform(x, {}), atol=1e-6, rtol=0)
    invert = identity.clone()
    invert[:, 0], invert[:, 1] = -1.0, 1.0
    torch.testing.assert_close(family_copy(x, invert), ops[4].transform(x, {}), atol=1e-6, rtol=0)
    bright = identity.clone()
    bright[:, 0] = 1.3
    torch.testing.assert_close(family_copy(x, bright), (1.3 * x).clamp(0, 1), atol=1e-6, rtol=0)


def test_the_forward_model_check_tells_a_wrong_model_from_a_right_one(digits):
    """On FedeCouple's real update (DA on), the truth fits the method replay (≈0) but not one
    cross-entropy gradient (the non-adaptive reading): that reading is mis-specified, and an attack
    that optimises it ends below the truth, which the check flags."""
    from attacks.base import Budget
    from attacks.forward_check import check, matching_term, true_copies
    from attacks.ig import inverting_gradients
    from attacks.observation import GradientMatcher

    fed, make_model = _run(digits, "fedecouple", victim=True, rounds=1)
    idx = torch.from_numpy(fed.ground_truth.training_set(0, 1))
    x, y = digits.images[idx], digits.labels[idx]
    records = fed.ground_truth.schedule(0, 1)
    hp = LocalHyperparameters(lr=0.05, steps=2, batch_size=3, samples=3, steps_per_phase=2)
    obs = observe(fed.channel.recorder, 0, 1, method=fed.method, make_model=make_model, image_shape=(1, 8, 8),
                  num_classes=10, known_hyperparameters=hp)
    probs = torch.nn.functional.one_hot(y, 10).float()
    method = GradientMatcher(obs, "method")
    assert matching_term(method, "cosine", x, probs, copies=true_copies(method, x, records)) < 1e-4
    scaled = GradientMatcher(obs, "scaled")
    assert matching_term(scaled, "cosine", x, probs) > 0.05
    result = inverting_gradients(obs, Budget(iterations=300, batch=3), seed=0, mode="scaled")
    verdict = check(obs, "scaled", "cosine", result, x, y, records)
    assert verdict["mis_specified"] and verdict["objective_truth"] > verdict["objective_reconstruction"]
