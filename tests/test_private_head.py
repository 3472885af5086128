"""Private parts as unknowns: after round 0 a FedPer client's head has trained in rounds the server never
saw, so the attacks fit what it does instead of standing the initial head in for it
(``attacks.inversion.closed_form``'s head-free reading of a batch, ``GradientMatcher``'s fitted private
parameters), and the forward check judges the fitted model (``attacks.inversion.forward_check``)."""
from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from attacks import ATTACKS
from attacks.base import Budget, LocalHyperparameters
from attacks.inversion.forward_check import OBJECTIVE_FLOOR, check
from attacks.inversion.forward_model import GradientMatcher
from attacks.inversion.observation import observe, update_target
from attacks.metrics import psnr
from fedecouple.engine import VictimSetting

from helpers import tiny_federation

TWO_IMAGES = LocalHyperparameters(lr=0.05, steps=1, batch_size=2, epochs=1, samples=2, steps_per_phase=1)


def _two_image_round(digits, method, round_, client=0):
    """A small federation whose ``client`` trains one step on two images in ``round_`` (it trained its
    private head in every round before): (federation, observation with the hyperparameters known,
    images, labels)."""
    victim = VictimSetting(batch=2, steps=1, targets={(round_, client)})
    fed = tiny_federation(digits, method, clients=3, rounds=round_ + 1, victim=victim)
    model = copy.deepcopy(fed.model)  # the initial weights, known to the server
    fed.run(round_ + 1)
    obs = observe(fed.channel.recorder, round_, client, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=TWO_IMAGES)
    idx = torch.from_numpy(fed.ground_truth.training_set(round_, client))
    assert len(idx) == 2
    return fed, obs, digits.images[idx], digits.labels[idx]


def _truth_term(matcher, images, labels) -> float:
    with torch.no_grad():
        dummy = matcher.dummy(images, F.one_hot(labels, 10).to(torch.float32))
        return float(matcher.cosine_objective(dummy, matcher.target))


def test_the_head_is_unknown_only_after_round_0(digits):
    _, obs, _, _ = _two_image_round(digits, "fedper", 2)
    assert update_target(obs).unknown == ["classifier.weight", "classifier.bias"]
    assert update_target(dataclasses.replace(obs, round=0)).unknown == []


@pytest.mark.parametrize("method", ["fedper", "fedrep"])
def test_the_fitted_head_reproduces_a_two_image_update_the_stand_in_does_not(digits, method):
    """Round 2, one step on two images: with the error signals solved for the true images the truth's
    term is at the floor; with the initial head standing in (what the forward model assumed before:
    the same observation read as round 0) it is far above it, so that model was wrong."""
    _, obs, images, labels = _two_image_round(digits, method, 2)
    matcher = GradientMatcher(obs, "auto")
    last = matcher.closed.last_linear
    assert last is not None and last.head_free and last.images == 2 and matcher.labels_unused
    assert _truth_term(matcher, images, labels) < OBJECTIVE_FLOOR
    stand_in = GradientMatcher(dataclasses.replace(obs, round=0), "auto")
    assert stand_in.closed.last_linear is None and not stand_in.labels_unused
    assert _truth_term(stand_in, images, labels) > 1e-2


def test_ig_with_the_fitted_head_beats_the_prior_and_passes_the_check(digits):
    fed, obs, images, labels = _two_image_round(digits, "fedper", 2)
    result = ATTACKS["ig"].attack_one(obs, Budget(iterations=200, restarts=1, batch=2), 0)
    assert result.trace["closed_form"]["last_linear"]["images"] == 2
    out = check(obs, "scaled", "cosine", result, images, labels, fed.ground_truth.schedule(2, 0))
    assert out["mis_specified"] is False and out["objective_truth"] < OBJECTIVE_FLOOR
    best = max(sum(psnr(result.images[j], images[i]) for i, j in enumerate(order)) / 2
               for order in itertools.permutations(range(2)))
    prior = sum(psnr(digits.images.mean(0), image) for image in images) / 2
    assert best > prior + 6.0


@pytest.mark.parametrize("attack", ["ig", "fedavg-leak"])
def test_the_head_is_fitted_over_several_steps_and_the_check_refits_it(digits, attack):
    """Two steps on four images (the head-free reading needs one step): the private head is an unknown
    of the attack's fit, and the check takes the truth at the head fitted to it: the stand-in's term
    at the truth is far above the fitted one."""
    hp = LocalHyperparameters(lr=0.05, steps=2, batch_size=4, epochs=1, samples=4, steps_per_phase=2)
    victim = VictimSetting(batch=4, steps=2, targets={(2, 0)})
    fed = tiny_federation(digits, "fedper", clients=3, rounds=3, victim=victim)
    model = copy.deepcopy(fed.model)
    fed.run(3)
    obs = observe(fed.channel.recorder, 2, 0, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=hp)
    idx = torch.from_numpy(fed.ground_truth.training_set(2, 0))
    images, labels = digits.images[idx], digits.labels[idx]
    result = ATTACKS[attack].attack_one(obs, Budget(iterations=150, restarts=1, batch=4), 0)
    fitted = result.variables["private"]
    assert fitted is not None and fitted.numel() == 64 * 10 + 10 and float(fitted.abs().max()) > 0
    out = check(obs, "replay", "cosine", result, images, labels, fed.ground_truth.schedule(2, 0))
    matcher = GradientMatcher(obs, "replay")
    assert matcher.private_size == 650 and not matcher.labels_unused
    stand_in = _truth_term(matcher, images, labels)
    assert out["objective_truth"] < 0.1 * stand_in
    assert out["mis_specified"] is False
