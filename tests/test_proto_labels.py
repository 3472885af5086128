"""Prototype inversion (attacks/inversion/proto.py) and label-distribution inference (attacks/inversion/label_distribution.py).

Small fixed-seed cases on the 8x8 ``digits`` set, against the real FedPAC / FedProto /
FedeCouple / FedAvg / FedPer / FedRep methods where the test needs a method's real upload.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attacks.base import Budget, NotApplicable, Observation
from attacks.inversion.label_distribution import label_inference
from attacks.metrics import presence_threshold, psnr, score_label_distribution, score_reconstructions
from attacks.inversion.observation import observe
from attacks.inversion.proto import prototype_inversion
from fedecouple.methods import make_method
from fedecouple.methods.base import FieldSpec
from fedecouple.models import build_model, get_params, set_params

from helpers import tiny_federation
from helpers import TEST_THREADS


def _model(ds, seed=0):
    torch.manual_seed(seed)
    return build_model("digits", ds.channels, ds.image_size, ds.num_classes, ds.mean, ds.std)


def _observation(ds, method, download, upload, make_model, previous=None, round=0):
    return Observation(method=make_method(method), round=round, client_id=0, download=download, upload=upload,
                       previous_upload=previous, make_model=make_model, image_shape=tuple(ds.images.shape[1:]),
                       num_classes=ds.num_classes)


def _run(ds, method, rounds, partition="pathological", clients=4):
    fed = tiny_federation(ds, method=method, clients=clients, rounds=rounds, partition=partition)
    initial = copy.deepcopy(fed.model)
    set_params(initial, fed.initial_params)
    fed.run(rounds)
    return fed, (lambda: copy.deepcopy(initial))


def _observe(fed, make_model, round, client, ds):
    return observe(fed.channel.recorder, round, client, method=fed.method, make_model=make_model,
                   image_shape=tuple(ds.images.shape[1:]), num_classes=ds.num_classes)


def _true_counts(fed, ds, round, client):
    idx = torch.from_numpy(fed.ground_truth.training_set(round, client))
    return torch.bincount(ds.labels[idx], minlength=ds.num_classes)


def _class_scores(image, pool, prior):
    """Mean PSNR of the image and of the prior over every image of the class, and the matched row."""
    (row,) = score_reconstructions(image.unsqueeze(0), pool, prior)
    return (float(np.mean([psnr(image, t) for t in pool])), float(np.mean([psnr(prior, t) for t in pool])), row)


@pytest.fixture(scope="module")
def fedpac_run(digits):
    return _run(digits, "fedpac", rounds=2)


@pytest.fixture(scope="module")
def fedproto_run(digits):
    return _run(digits, "fedproto", rounds=1)


# ------------------------------------------------------------------------------------------------
# prototype inversion


def test_per_class_pattern_reads_the_manifest_naming():
    pat = FieldSpec("prototype.{k}", "prototype", (4,), per_class=True).pattern
    assert pat.match("prototype.7").group(1) == "7"
    assert pat.match("prototype.12").group(1) == "12"
    assert not pat.match("global.prototype.7") and not pat.match("prototype.7.x")
    pat = FieldSpec("stats.{k}.p", "statistic", (), per_class=True).pattern
    assert pat.match("stats.3.p").group(1) == "3" and not pat.match("stats.3.h")
    with pytest.raises(ValueError, match="placeholder"):
        FieldSpec("stats", "statistic", (), per_class=True)


def test_inversion_recovers_class_typical_images_above_the_prior(digits):
    """A briefly trained extractor; prototypes = mean feature of 60 images of each of 3 classes.
    The inverted image must beat the data-set mean image on those classes' images."""
    torch.set_num_threads(TEST_THREADS)
    ds = digits
    model = _model(ds)
    initial = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(150):
        idx = torch.randint(0, len(ds), (32,), generator=gen)
        loss = F.cross_entropy(model(ds.images[idx]), ds.labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    classes = [0, 3, 7]
    pools = {k: ds.images[ds.labels == k][:60] for k in classes}
    upload = {**get_params(model, "extractor"), **get_params(model, "classifier")}
    with torch.no_grad():
        for k in classes:
            upload[f"prototype.{k}"] = model.features(pools[k]).mean(0)
    obs = _observation(ds, "fedpac", get_params(initial), upload, lambda: copy.deepcopy(initial))
    result = prototype_inversion(obs, Budget(iterations=100), seed=0)

    assert result.trace["extractor_source"] == "upload"
    assert result.labels.tolist() == classes
    assert result.images.shape == (3, 1, 8, 8)
    assert float(result.images.min()) >= 0.0 and float(result.images.max()) <= 1.0
    prior = ds.images.mean(0)
    gains = []
    for i, k in enumerate(classes):
        mean_psnr, prior_psnr, row = _class_scores(result.images[i], pools[k], prior)
        gains.append(mean_psnr - prior_psnr)
        assert mean_psnr > prior_psnr, (k, mean_psnr, prior_psnr)
        assert row["psnr"] > row["prior_psnr"]
        # the inversion resembles its own class more than the other classes
        others = [float(np.mean([psnr(result.images[i], t) for t in pools[j]])) for j in classes if j != k]
        assert mean_psnr > max(others), (k, mean_psnr, others)
    assert float(np.mean(gains)) > 0.5


def test_fedpac_upload_inverted_with_the_uploaded_base(digits, fedpac_run):
    fed, make_model = fedpac_run
    obs = _observe(fed, make_model, 1, 0, digits)
    result = prototype_inversion(obs, Budget(iterations=60), seed=1)
    counts = _true_counts(fed, digits, 1, 0)
    assert result.labels.tolist() == torch.nonzero(counts).flatten().tolist()
    assert result.trace["extractor_source"] == "upload" and result.trace["mode"] == "upload-extractor"
    assert isinstance(result.trace["objective"], float)
    idx = torch.from_numpy(fed.ground_truth.samples(1, 0))
    truths, labels = digits.images[idx], digits.labels[idx]
    prior = digits.images.mean(0)
    rows = [_class_scores(result.images[i], truths[labels == k], prior) for i, k in enumerate(result.labels.tolist())]
    assert np.mean([r[0] for r in rows]) > np.mean([r[1] for r in rows])


def test_fedproto_uses_the_initial_model_and_says_so(digits, fedproto_run):
    fed, make_model = fedproto_run
    obs = _observe(fed, make_model, 0, 1, digits)
    result = prototype_inversion(obs, Budget(iterations=5), seed=0)
    assert result.trace["extractor_source"] == "initial"
    assert result.labels.tolist() == torch.nonzero(_true_counts(fed, digits, 0, 1)).flatten().tolist()
    assert any(n.startswith("NO MODEL: fedproto uploads no model weights") for n in result.notes)


@pytest.mark.parametrize("method", ["fedecouple", "fedavg", "fedper", "fedrep"])
def test_proto_not_applicable_without_prototypes(digits, method):
    model = _model(digits)
    params = get_params(model)
    obs = _observation(digits, method, params, params, lambda: copy.deepcopy(model))
    with pytest.raises(NotApplicable, match=f"{method} uploads no prototypes.*(dlg|ig)"):
        prototype_inversion(obs, Budget(iterations=5), seed=0)


# ------------------------------------------------------------------------------------------------
# label inference


def test_labels_exact_from_class_counts(digits, fedproto_run, fedpac_run):
    for (fed, make_model), r in ((fedproto_run, 0), (fedpac_run, 1)):
        for c in range(fed.num_clients):
            result = label_inference(_observe(fed, make_model, r, c, digits), Budget(), 0)
            counts = _true_counts(fed, digits, r, c)
            assert result.trace["source"] == "class_counts"
            assert result.images.shape == (0, 1, 8, 8) and result.labels.numel() == 0
            assert torch.allclose(result.trace["label_distribution"], counts.double() / counts.sum())
            score = score_label_distribution(result.trace["label_distribution"], counts)
            assert score["class_presence_accuracy"] == 1.0 and score["total_variation"] < 1e-9 and score["top1_correct"]


def test_labels_from_fedpac_statistics_when_counts_are_withheld(digits, fedpac_run):
    fed, make_model = fedpac_run
    for c in range(fed.num_clients):
        obs = _observe(fed, make_model, 1, c, digits)
        del obs.upload["class_counts"]
        result = label_inference(obs, Budget(), 0)
        assert result.trace["source"] == "statistics"
        score = score_label_distribution(result.trace["label_distribution"], _true_counts(fed, digits, 1, c))
        assert score["class_presence_accuracy"] == 1.0 and score["total_variation"] < 0.1


def test_labels_from_prototype_keys_give_exact_presence(digits, fedproto_run):
    fed, make_model = fedproto_run
    obs = _observe(fed, make_model, 0, 2, digits)
    obs.upload = {k: v for k, v in obs.upload.items() if not k.startswith("class_count.")}
    result = label_inference(obs, Budget(), 0)
    counts = _true_counts(fed, digits, 0, 2)
    assert result.trace["source"] == "prototype_keys"
    assert result.trace["present_classes"] == torch.nonzero(counts).flatten().tolist()


def test_labels_from_a_classifier_update_of_real_sgd_steps(digits):
    """FedAvg-style upload after 30 plain SGD steps (batch 10, lr 0.05) on a known label mix
    50 % / 30 % / 20 % of classes 1, 4, 8, from the initial weights the server sent."""
    ds = digits
    model = _model(ds, seed=1)
    initial = copy.deepcopy(model)
    rng = np.random.default_rng(0)
    mix = {1: 100, 4: 60, 8: 40}
    idx = np.concatenate([rng.choice(np.flatnonzero(ds.labels.numpy() == k), n, replace=False) for k, n in mix.items()])
    images, labels = ds.images[idx], ds.labels[idx]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        sel = torch.randint(0, len(idx), (10,), generator=gen)
        loss = F.cross_entropy(model(images[sel]), labels[sel])
        opt.zero_grad()
        loss.backward()
        opt.step()
    upload = {**get_params(model), "sample_count": torch.tensor(len(idx))}
    obs = _observation(ds, "fedavg", get_params(initial), upload, lambda: copy.deepcopy(initial))
    result = label_inference(obs, Budget(), 0)
    counts = torch.bincount(labels, minlength=10)
    score = score_label_distribution(result.trace["label_distribution"], counts)
    assert result.trace["source"] == "classifier_update"
    assert result.trace["present_classes"] == [1, 4, 8]
    assert score["class_presence_accuracy"] == 1.0 and score["top1_correct"]
    assert score["total_variation"] < 0.2
    assert torch.allclose(result.trace["label_counts"].sum(), torch.tensor(200.0, dtype=torch.float64))


def test_labels_from_fedecouple_personal_classifier_in_a_later_round(digits):
    """Round 1: the personal classifier was already fitted in round 0; measured from the initial
    weights its update still shows the classes held."""
    fed, make_model = _run(digits, "fedecouple", rounds=2, clients=2)
    for c in range(fed.num_clients):
        obs = _observe(fed, make_model, 1, c, digits)
        assert obs.previous_upload is not None
        result = label_inference(obs, Budget(), 0)
        assert result.trace["source"] == "classifier_update"
        score = score_label_distribution(result.trace["label_distribution"], _true_counts(fed, digits, 1, c))
        assert score["class_presence_accuracy"] == 1.0, (c, score)


@pytest.mark.parametrize("method", ["fedper", "fedrep", "local"])
def test_labels_not_applicable_when_nothing_carries_labels(digits, method):
    model = _model(digits)
    params = get_params(model)
    upload = {k: v for k, v in params.items() if k.startswith("extractor.")} if method != "local" else {}
    obs = _observation(digits, method, params, upload, lambda: copy.deepcopy(model))
    with pytest.raises(NotApplicable, match="carries no label information"):
        label_inference(obs, Budget(), 0)


def test_labels_head_unknown_threat_model_drops_the_classifier(digits):
    model = _model(digits)
    params = get_params(model)
    obs = _observation(digits, "fedavg", params, params, lambda: copy.deepcopy(model))
    obs.head_known = False
    with pytest.raises(NotApplicable, match="head as unknown"):
        label_inference(obs, Budget(), 0)


def test_score_label_distribution_by_hand():
    counts = torch.tensor([6, 3, 1, 0])  # proportions 0.6 0.3 0.1 0
    assert presence_threshold(4) == 0.125
    s = score_label_distribution(torch.tensor([0.6, 0.3, 0.1, 0.0]), counts)
    assert s["class_presence_accuracy"] == 1.0 and s["total_variation"] == pytest.approx(0.0, abs=1e-6) and s["top1_correct"]
    assert s["present_true"] == [0, 1] and s["held_true"] == [0, 1, 2]  # 0.1 < 1/(2C): absent on both sides
    s = score_label_distribution(torch.tensor([0.0, 0.5, 0.0, 0.5]), counts)
    assert s["class_presence_accuracy"] == pytest.approx(0.5)  # class 0 missed, class 3 wrongly present
    assert s["total_variation"] == pytest.approx(0.5 * (0.6 + 0.2 + 0.1 + 0.5))
    assert not s["top1_correct"]
    # unnormalised predictions are renormalised
    s = score_label_distribution(torch.tensor([12.0, 6.0, 2.0, 0.0]), counts)
    assert s["total_variation"] == pytest.approx(0.0, abs=1e-6)
