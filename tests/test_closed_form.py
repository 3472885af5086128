"""The closed-form stage of the gradient attacks (``attacks.inversion.closed_form``): what an upload fixes exactly
equals the truth, and the attack built on it is judged right by the forward check."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from attacks import ATTACKS
from attacks.base import Budget, LocalHyperparameters
from attacks.inversion.forward_check import OBJECTIVE_FLOOR, check, true_copies
from attacks.inversion.forward_model import GradientMatcher
from attacks.inversion.observation import observe
from fedecouple.engine import VictimSetting
from fedecouple.models import set_params

from helpers import tiny_federation

ONE_IMAGE = LocalHyperparameters(lr=0.05, steps=1, batch_size=1, epochs=1, samples=1, steps_per_phase=1)


def _one_image_round(digits, method, round_, client=0, rounds=None):
    """A small federation whose ``client`` trains one step on one image in ``round_``: (federation,
    observation with the hyperparameters known, the image, its label)."""
    victim = VictimSetting(batch=1, steps=1, targets={(round_, client)})
    fed = tiny_federation(digits, method, clients=3, rounds=rounds or round_ + 1, victim=victim)
    model = copy.deepcopy(fed.model)  # the initial weights, known to the server
    fed.run(rounds or round_ + 1)
    obs = observe(fed.channel.recorder, round_, client, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=ONE_IMAGE)
    idx = torch.from_numpy(fed.ground_truth.samples(round_, client))
    assert len(idx) == 1
    return fed, obs, digits.images[idx], digits.labels[idx]


def _extractor_input(obs, image):
    """The true input of the extractor's last linear layer (``fc``) under the downloaded extractor."""
    model = obs.make_model()
    set_params(model, {k: v for k, v in obs.download.items() if k.startswith("extractor.")})
    seen = {}
    model.extractor.fc.register_forward_hook(lambda m, inp, out: seen.setdefault("a", inp[0].detach()))
    model.features(image)
    return seen["a"][0]


@pytest.mark.parametrize("method", ["fedper", "fedrep"])
def test_a_private_head_does_not_hide_the_last_linear_input(digits, method):
    """Round 1 (a trained head the server never saw): the layer's input read from the update is the
    image's, and the head-free update on the true image is the observed one."""
    _, obs, image, label = _one_image_round(digits, method, 1)
    matcher = GradientMatcher(obs, "auto")
    last = matcher.closed.last_linear
    assert last is not None and last.head_free and matcher.labels_unused
    torch.testing.assert_close(last.input, _extractor_input(obs, image), rtol=1e-5, atol=1e-5)
    dummy = matcher.dummy(image, label)
    n = len(matcher.names)
    cosine = F.cosine_similarity(torch.cat([d.reshape(-1) for d in dummy[:n]]),
                                 torch.cat([t.reshape(-1) for t in matcher.target[:n]]), dim=0)
    assert float(cosine) > 0.9999
    assert float(matcher.cosine_objective(dummy, matcher.target)) < OBJECTIVE_FLOOR


def test_the_closed_form_fedper_attack_passes_the_forward_check(digits):
    """Without the closed form the stand-in head mis-specifies FedPer's trained rounds; with it the
    truth's objective is at the floor, so the check never calls the attack mis-specified."""
    fed, obs, image, label = _one_image_round(digits, "fedper", 2)
    result = ATTACKS["ig"].attack_one(obs, Budget(iterations=40, restarts=1, batch=1), 0)
    assert result.trace["closed_form"]["last_linear"]["head_free"]
    assert result.labels.tolist() == [-1]  # no label is inferred from a head-free update
    idx = torch.from_numpy(fed.ground_truth.training_set(2, 0))
    out = check(obs, result.trace["mode"].replace("scaled-gradient", "scaled"), "cosine", result,
                digits.images[idx], digits.labels[idx], fed.ground_truth.schedule(2, 0))
    assert out["mis_specified"] is False
    assert out["objective_truth"] < OBJECTIVE_FLOOR and out["replay_cosine"] > 0.9999


def test_several_images_leave_the_last_linear_layer_to_the_optimiser(digits):
    victim = VictimSetting(batch=2, steps=1, targets={(0, 0)})
    fed = tiny_federation(digits, "fedper", clients=3, rounds=1, victim=victim)
    model = copy.deepcopy(fed.model)
    fed.run(1)
    hp = LocalHyperparameters(lr=0.05, steps=1, batch_size=2, epochs=1, samples=2, steps_per_phase=1)
    obs = observe(fed.channel.recorder, 0, 0, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=hp)
    matcher = GradientMatcher(obs, "auto")
    assert matcher.closed.last_linear is None and not matcher.labels_unused


def test_fedpac_statistics_are_the_one_image_features(digits):
    """FedPAC, one image, round 0: h/p is the image's feature under the downloaded extractor and its
    class prototype the feature under the uploaded one."""
    _, obs, image, label = _one_image_round(digits, "fedpac", 0)
    matcher = GradientMatcher(obs, "auto")
    assert matcher.mode == "method"
    means = {m.source: m.means for m in matcher.closed.feature_means}
    k = int(label)
    for source, group in (("before", obs.download), ("upload", obs.upload)):
        model = obs.make_model()
        set_params(model, {n: v for n, v in group.items() if n.startswith("extractor.")})
        with torch.no_grad():
            feature = model.features(image)[0]
        torch.testing.assert_close(means[source][k], feature, rtol=1e-5, atol=1e-5)
        assert float(means[source].abs().sum()) == pytest.approx(float(means[source][k].abs().sum()))
    dummy = matcher.dummy(image, label)
    # the truth matches to float rounding: IG's data term there reads ≈ 0, not the ±1e-5 of a float32 1 − cos
    assert 0.0 <= float(matcher.cosine_objective(dummy, matcher.target)) < 1e-9


def _fedecouple_one_image(digits, da: bool):
    """A FedeCouple round in which client 0 takes one step on one image: the federation, that image and
    the attack's matcher for the client's upload."""
    victim = VictimSetting(batch=1, steps=1, targets={(0, 0)})
    fed = tiny_federation(digits, "fedecouple", clients=3, rounds=1, victim=victim, hp={"da": da})
    model = copy.deepcopy(fed.model)
    fed.run(1)
    obs = observe(fed.channel.recorder, 0, 0, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=ONE_IMAGE)
    image = digits.images[torch.from_numpy(fed.ground_truth.samples(0, 0))]
    return fed, image, GradientMatcher(obs, "auto")


@pytest.mark.parametrize("da", [False, True])
def test_fedecouple_features_lie_in_the_classifier_update_row_space(digits, da):
    """The classifier phase's update spans the features it trained on (rank 1 per image, 2 with its
    augmented copy): the features of the true image and of the copies the client trained on, under the
    kept extractor, are in that span; a noise image's are not. Only the classifier phase's images are
    held to it (with DA the later phases' copies are not)."""
    fed, image, matcher = _fedecouple_one_image(digits, da)
    assert matcher.closed.row_space_rank == (2 if da else 1)
    records = fed.ground_truth.schedule(0, 0)
    copies = true_copies(matcher, image, records, [0])
    assert da == (copies is not None and sum(c is not None for c in copies) == 3)  # classifier, GLF, extractor
    (share,) = matcher._row_space_share(image, matcher.target, copies=copies)
    assert float(share) < 1e-5
    noise = torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    noise_copies = None if copies is None else [None if c is None else noise for c in copies]
    (noise,) = matcher._row_space_share(noise, matcher.target, copies=noise_copies)
    assert float(noise) > 100 * float(share) and float(noise) > 1e-3


@pytest.mark.parametrize("method,batch", [("fedavg", 4), ("fedavg", 8), ("fedpac", 4)])
def test_label_counts_of_a_round_0_batch_are_exact(digits, method, batch):
    """FedAvg: from the classifier's bias update and the initial model's mean prediction; FedPAC: from
    its uploaded class counts. IG then fixes the batch's labels to them."""
    victim = VictimSetting(batch=batch, steps=1, targets={(0, 1)})
    fed = tiny_federation(digits, method, clients=3, rounds=1, victim=victim, partition="iid")
    model = copy.deepcopy(fed.model)
    fed.run(1)
    hp = LocalHyperparameters(lr=0.05, steps=1, batch_size=batch, epochs=1, samples=batch, steps_per_phase=1)
    obs = observe(fed.channel.recorder, 0, 1, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=hp)
    truth = digits.labels[torch.from_numpy(fed.ground_truth.samples(0, 1))]
    assert len(set(truth.tolist())) > 1
    matcher = GradientMatcher(obs, "auto")
    assert matcher.closed.label_counts.tolist() == torch.bincount(truth, minlength=10).tolist()
    result = ATTACKS["ig"].attack_one(obs, Budget(iterations=2, restarts=1, batch=batch), 0)
    assert result.trace["label_source"].startswith("closed-form counts")
    assert sorted(result.labels.tolist()) == sorted(truth.tolist())


def test_fedecouple_without_da_gives_the_image_feature_in_closed_form(digits):
    """FedeCouple without DA, one image, one classifier step: every loss of its classifier phase has the
    weight gradient e·fᵀ and the bias gradient e, so the classifier update's weight rows over its bias
    entries (``linear_input``) are the image's feature under the kept extractor, and the rank-1 row
    space the attack holds the dummy's features to is that feature's direction."""
    from attacks.inversion.closed_form import linear_input
    from fedecouple.methods.replay import features

    fed, image, matcher = _fedecouple_one_image(digits, False)
    with torch.no_grad():
        feature = features(matcher.model, matcher.context.kept, image)[0]
    delta = matcher.update.delta
    closed, residual = linear_input(delta["classifier.weight"], delta["classifier.bias"])
    assert residual < 1e-5
    torch.testing.assert_close(closed, feature, rtol=1e-5, atol=1e-5)
    assert matcher.closed.row_space_rank == 1
    basis = matcher.target[-1][:, 0]
    assert abs(float(basis @ feature / feature.norm())) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("da", [False, True])
def test_fedecouple_classifier_step_features_are_solved_exactly(digits, da):
    """One classifier step on one image (and, with DA, its augmented copy): the features the closed form
    solves from the classifier's update equal the true ones under the kept extractor (1e-5 relative
    without DA, where the rank-1 reading is exact; 1e-4 with its copy, a 4-unknown least-squares fit, one
    solved row each), and the forward check reports the image's error as attack.csv's input_error."""
    from attacks.inversion.forward_check import classifier_feature_error
    from fedecouple.methods.replay import features

    fed, image, matcher = _fedecouple_one_image(digits, da)
    solved = matcher.closed.classifier_features
    assert solved is not None and matcher.closed.trace["classifier_features"]["residual"] < 1e-5
    copies = true_copies(matcher, image, fed.ground_truth.schedule(0, 0), [0])
    trained = image if not da else torch.cat([image, copies[0]])
    with torch.no_grad():
        truth = features(matcher.model, matcher.context.kept, trained)
    assert solved.shape == truth.shape == (2 if da else 1, truth.shape[1])
    errors = (solved.unsqueeze(0) - truth.unsqueeze(1)).norm(dim=2) / truth.norm(dim=1, keepdim=True)
    assert float(errors.min(dim=1).values.max()) < (1e-4 if da else 1e-5)  # the update does not fix the order
    if da:
        assert sorted(errors.argmin(dim=1).tolist()) == [0, 1]  # the image and its copy, one each
    assert classifier_feature_error(matcher, image) == pytest.approx(float(errors[0].min()), rel=1e-4, abs=1e-7)
    noise = torch.rand(image.shape, generator=torch.Generator().manual_seed(0))
    assert classifier_feature_error(matcher, noise) > 0.05


def test_one_minus_cosine_is_the_cosine_distance_without_cancellation():
    """IG's data term: equal to 1 − cos (float64, to float32 summation rounding) for unrelated vectors, and ≈ 0 (never negative) for a
    vector against itself and a positive multiple of it, where a float32 1 − cos is off by ~1e-6."""
    from attacks.inversion.matching_terms import one_minus_cosine

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(200_000, generator=gen), torch.randn(200_000, generator=gen)
    exact = 1.0 - float(F.cosine_similarity(a.double(), b.double(), dim=0))
    assert float(one_minus_cosine(a, b)) == pytest.approx(exact, abs=1e-5)
    for other in (a, 3.0 * a):
        assert 0.0 <= float(one_minus_cosine(a, other)) < 1e-12


@pytest.mark.parametrize("da", [False, True])
def test_fedecouple_extractor_linear_input_is_solved_from_the_features(digits, da):
    """Round 0, one image: the input of the extractor's last linear layer (under the downloaded extractor,
    where the extractor phase starts) is solved from the image's solved features and that layer's update
    (which spans the inputs of every image the extractor phase trained on): the attack's nearest candidate
    equals the true input (1e-4 relative), and a noise image's input is far from every candidate."""
    fed, image, matcher = _fedecouple_one_image(digits, da)
    last = matcher.closed.last_linear
    assert last is not None and not last.head_free and last.weight == "extractor.fc.weight"
    assert matcher.closed.trace["extractor_linear_input"]["rank"] == (4 if da else 2)  # GLF + extractor steps
    candidates = last.input
    assert candidates.shape == (2 if da else 1, matcher.model.extractor.fc.in_features)
    with torch.no_grad():
        truth = matcher._linear_input(matcher.update.before, image)[0]
        noise = matcher._linear_input(matcher.update.before, torch.rand(image.shape, generator=torch.Generator().manual_seed(0)))[0]
    error = lambda a: float(((candidates - a).norm(dim=1) / a.norm()).min())  # noqa: E731
    assert error(truth) < 1e-4
    assert error(noise) > 0.05
    # the attack's term: zero (to rounding) at the truth, and it weighs the nearest candidate
    from attacks.inversion.matching_terms import _nearest_relative_error
    assert float(_nearest_relative_error(truth, candidates)) < 1e-8
    assert float(_nearest_relative_error(noise, candidates)) > 1e-3


def test_fedecouple_classifier_step_solve_finds_the_label_a_wrong_reading_misses(digits):
    """Where iDLG's reading of the label is wrong (at trained rounds the distillation term can outweigh the
    label's push), the classifier-step solve tries the other classes: only the true one reproduces the
    update, and it comes back with the image's features."""
    from attacks.inversion.closed_form import solve_classifier_step
    from fedecouple.methods.replay import features

    fed, image, matcher = _fedecouple_one_image(digits, True)
    true_label = int(digits.labels[torch.from_numpy(fed.ground_truth.samples(0, 0))][0])
    obs = matcher.observation
    obs.memo.clear()
    wrong = F.one_hot(torch.tensor((true_label + 1) % 10), 10)
    feats, residual, how, label = solve_classifier_step(obs, matcher.update, matcher.model, wrong, 2)
    assert label is not None and int(label.argmax()) == true_label and residual < 1e-5
    assert "labels tried" in how
    with torch.no_grad():
        truth = features(matcher.model, matcher.context.kept, image)[0]
    assert float(((feats - truth).norm(dim=1) / truth.norm()).min()) < 1e-4
    assert solve_classifier_step(obs, matcher.update, matcher.model, wrong, 2)[3] is label  # computed once


def test_fedecouple_closed_form_start_rebuilds_the_image_from_the_solved_layer_input(digits):
    """The image rebuilt from the solved input of the extractor's last linear layer (through the layers
    below it, ``attacks.inversion.layer_inputs``) is DLG's first start: near the true image (PSNR at least 6 dB
    above the grey image's), its layer input near the solved one, computed once per observation; DLG's
    first start holds it (its later starts do not)."""
    from attacks.inversion.dlg import _setup, _start
    from attacks.metrics import psnr

    fed, image, matcher = _fedecouple_one_image(digits, True)
    rebuilt = matcher.closed_form_start
    assert rebuilt is not None and rebuilt.shape == image.shape
    assert float(rebuilt.min()) >= 0.0 and float(rebuilt.max()) <= 1.0
    grey = torch.full_like(image, 0.5)
    assert psnr(rebuilt, image) >= psnr(grey, image) + 6.0
    with torch.no_grad():
        got = matcher._linear_input(matcher.update.before, rebuilt)[0]
    a = matcher.closed.last_linear.input[0]
    assert float((got - a).norm() / a.norm()) < 0.05
    assert GradientMatcher(matcher.observation, "auto").closed_form_start is rebuilt  # from the memo
    setup = _setup(matcher.observation, Budget(iterations=1, restarts=2, batch=1), "auto", True, "dlg")
    first, second = _start(setup, 0, 0)[0], _start(setup, 0, 1)[0]
    assert torch.equal(first[:1], rebuilt) and not torch.equal(second[:1], rebuilt)
    assert setup.trace["start"].startswith("closed form")


def test_fedecouple_two_images_features_and_layer_inputs_are_solved(digits):
    """Round 0, one step on two images (DA on): the labels come from the classifier step's bias update;
    the classifier step's four feature rows (the images and their copies) are solved jointly from its
    update (each true row within 1e-3 relative of its own solved row), and each image's input of the
    extractor's last linear layer, in the order of the labels, within 1e-3 of the true one (a noise
    image's is far); DLG's and IG's first start rebuilds both images from them."""
    from attacks.inversion.closed_form import solve_classifier_step
    from fedecouple.methods.replay import features

    victim = VictimSetting(batch=2, steps=1, targets={(0, 1)})
    fed = tiny_federation(digits, "fedecouple", clients=3, rounds=1, victim=victim, partition="iid")
    model = copy.deepcopy(fed.model)
    fed.run(1)
    hp = LocalHyperparameters(lr=0.05, steps=1, batch_size=2, epochs=1, samples=2, steps_per_phase=1)
    obs = observe(fed.channel.recorder, 0, 1, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10, known_hyperparameters=hp)
    idx = torch.from_numpy(fed.ground_truth.samples(0, 1))
    labels = digits.labels[idx]
    order = labels.argsort(stable=True)
    images = digits.images[idx]
    matcher = GradientMatcher(obs, "auto")
    closed = matcher.closed
    assert closed.label_counts.tolist() == torch.bincount(labels, minlength=10).tolist()
    copies = true_copies(matcher, images, fed.ground_truth.schedule(0, 1), [0, 1])
    with torch.no_grad():
        truth = features(matcher.model, matcher.context.kept, torch.cat([images, copies[0]]))
    solved = closed.classifier_features
    assert solved.shape == truth.shape == (4, truth.shape[1])
    errors = (solved.unsqueeze(0) - truth.unsqueeze(1)).norm(dim=2) / truth.norm(dim=1, keepdim=True)
    assert float(errors.min(dim=1).values.max()) < 1e-3
    assert sorted(errors.argmin(dim=1).tolist()) == [0, 1, 2, 3]  # one solved row for each true one
    last = closed.last_linear
    assert last is not None and last.images == 2 and not last.head_free
    with torch.no_grad():
        true_inputs = matcher._linear_input(matcher.update.before, images[order])
        noise_images = torch.rand(images.shape, generator=torch.Generator().manual_seed(0))
        noise = matcher._linear_input(matcher.update.before, noise_images)
    relative = lambda a: ((last.input[0] - a).norm(dim=1) / a.norm(dim=1)).max()  # noqa: E731
    assert float(relative(true_inputs)) < 1e-3 and float(relative(noise)) > 0.05
    rebuilt = matcher.closed_form_start
    assert rebuilt is not None and rebuilt.shape == images.shape
