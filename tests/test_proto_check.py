"""The forward check of prototype inversion: the client's true class images against the inverted sets."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from attacks import ATTACKS, verdicts
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
    assert out["model_unknown"] is False  # the server holds the extractor: judged by the forward check
    assert out["mis_specified"] is False and out["not_converged"] is True
    assert out["objective_reconstruction"] == sum(result.trace["data_term_per_class"])


def test_fedproto_has_no_model_at_the_server_so_no_target_is_mis_specified(digits):
    """FedProto's prototypes come from a locally trained extractor the server never sees (its upload
    carries none): the initial model is the server's surrogate, so the target gets NO MODEL, not
    MIS-SPECIFIED, and no lower bound; the truth's objective under that model is kept (far above the
    floor: the initial model did not compute the prototypes)."""
    obs, images, labels = _proto_round(digits, "fedproto")
    result = ATTACKS["proto"].attack_one(obs, Budget(iterations=5, restarts=1), 0)
    out = prototype_check(obs, result, images, labels)
    assert result.trace["extractor_source"] == "initial" and result.notes[0].startswith("NO MODEL")
    assert out["model_unknown"] is True and out["mis_specified"] is False and out["not_converged"] is None
    assert out["objective_truth"] > 1e-3


def _proto_summary(method: str, **settings) -> dict:
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    config = RunConfig.of(method=method, dataset="digits", clients=3, seed=0, threads=1)
    return run_attack(config, AttackSettings("proto", iterations=3, targets=2, **settings), progress=False)


@pytest.mark.parametrize("aux_data, source", [(None, "initial"), ("digits", "surrogate")])
def test_a_fedproto_summary_counts_no_model_targets_with_the_estimate_and_none_mis_specified(aux_data, source):
    """The summary of a FedProto run: 0 targets mis-specified, every target NO MODEL, the PSNR still
    reported as the estimate, and the verdict in words says NO MODEL; with public data the estimate is
    the trained surrogate's."""
    summary = _proto_summary("fedproto", aux_data=aux_data)
    n = len(summary["per_target"])
    assert n == 2 and summary["mis_specified_targets"] == 0 and summary["mis_specified"] is False
    assert verdicts.model_unknown_targets(summary) == n
    assert summary["threat_model"]["modes_used"] == [f"{source}-extractor"]
    assert math.isfinite(summary["mean_psnr"]) and math.isfinite(summary["mean_prior_psnr"])
    words = verdicts.forward_check_verdict(summary["mis_specified_targets"], summary["not_converged_targets"], n,
                                           verdicts.model_unknown_targets(summary))
    assert words.startswith(f"NO MODEL on {n} of {n} targets") and verdicts.at_chance(summary) is None


def test_a_fedpac_summary_keeps_its_forward_check_even_with_public_data():
    """FedPAC uploads the extractor that computed its prototypes: it is inverted with it (public data
    or not), no target is NO MODEL, and the forward check is computed as before."""
    summary = _proto_summary("fedpac", aux_data="digits")
    assert summary["threat_model"]["modes_used"] == ["upload-extractor"]
    assert verdicts.model_unknown_targets(summary) == 0
    assert summary["mis_specified_targets"] == 0 and summary["not_converged_targets"] == len(summary["per_target"])
    assert all(t["objective_truth"] is not None for t in summary["per_target"])
