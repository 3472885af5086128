"""The forward check of prototype inversion: the client's true class images against the inverted sets."""
from __future__ import annotations

import copy

import torch

from attacks import ATTACKS
from attacks.base import Budget
from attacks.inversion.forward_check import OBJECTIVE_FLOOR, prototype_check
from attacks.inversion.observation import observe

from helpers import tiny_federation


def _proto_round(digits, method):
    fed = tiny_federation(digits, method, clients=3, rounds=1)
    model = copy.deepcopy(fed.model)
    fed.run(1)
    obs = observe(fed.channel.recorder, 0, 0, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10)
    idx = torch.from_numpy(fed.ground_truth.training_set(0, 0))
    return obs, digits.images[idx], digits.labels[idx]


def test_fedpac_prototypes_are_matched_by_the_clients_own_images(digits):
    """FedPAC's prototypes are class means under the uploaded extractor, the one inverted: the client's
    images reach the floor, so the check never calls the attack mis-specified."""
    obs, images, labels = _proto_round(digits, "fedpac")
    result = ATTACKS["proto"].attack_one(obs, Budget(iterations=5, restarts=1), 0)
    out = prototype_check(obs, result, images, labels)
    assert out["objective_truth"] < OBJECTIVE_FLOOR * len(result.trace["classes"])
    assert out["mis_specified"] is False and out["not_converged"] is True
    assert out["objective_reconstruction"] == sum(result.trace["data_term_per_class"])


def test_fedproto_on_the_initial_model_is_judged_by_the_truth(digits):
    """FedProto's prototypes come from a locally trained extractor the server never sees: the truth's
    objective under the initial model is clearly above the floor (the check can read either way)."""
    obs, images, labels = _proto_round(digits, "fedproto")
    result = ATTACKS["proto"].attack_one(obs, Budget(iterations=5, restarts=1), 0)
    out = prototype_check(obs, result, images, labels)
    assert result.trace["extractor_source"] == "initial"
    assert out["objective_truth"] > 1e-3
    assert out["mis_specified"] == (out["objective_truth"] > out["objective_reconstruction"])
