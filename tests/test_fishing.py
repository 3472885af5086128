"""Classifier fishing (Wen et al.): the crafted classifier, what one SGD step through it gives away in
closed form, what it silences, the methods it cannot reach, and the command end to end."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attacks
from attacks.malicious import fishing_download
from attacks.malicious.fishing import fished_weights, rarest_present
from fedecouple.channel import Download, Recorder, ServerChannel, Upload
from fedecouple.errors import UserError
from fedecouple.methods import make_method
from fedecouple.models import get_params
from fedsec.malicious import MaliciousServer
from helpers import digits_model, model_factory


def _loaded(make, tensors):
    model = make()
    own = dict(model.named_parameters())
    with torch.no_grad():
        for k, v in tensors.items():
            own[k].copy_(v)
    return model


def _counts(labels: torch.Tensor) -> torch.Tensor:
    return torch.bincount(labels, minlength=10).double()


def _batch_with_one_of(data, target: int, others=(0, 1, 2), per_other: int = 3):
    """One image of ``target`` and ``per_other`` images of each class in ``others`` (digits)."""
    rows = [int(torch.nonzero(data.labels == target)[0])]
    for c in others:
        rows += torch.nonzero(data.labels == c).flatten()[:per_other].tolist()
    return data.images[rows], data.labels[rows]


def _fishing_one_of(target: int):
    """(data, make_model, a batch with one image of ``target``, its labels, the fishing download
    crafted for that batch's label counts, its record)."""
    data, model = digits_model()
    make = model_factory(model)
    images, labels = _batch_with_one_of(data, target)
    sent, record = fishing_download(get_params(model), make(), data.images[1000:], data.labels[1000:],
                                    _counts(labels))
    return data, make, images, labels, sent, record


def test_the_server_fishes_the_rarest_present_class():
    assert rarest_present(torch.tensor([0.0, 4.2, 0.4, 1.2, 3.0])) == (3, 1)
    assert rarest_present(torch.zeros(5)) is None


def test_one_fished_image_its_row_update_over_its_bias_update_is_its_feature():
    data, make, images, labels, sent, record = _fishing_one_of(7)
    assert (record.target, record.expected, record.direction) == (7, 1, None)  # class fishing, one image
    crafted = _loaded(make, sent)
    loss = F.cross_entropy(crafted(images), labels)
    dw, db = torch.autograd.grad(loss, [crafted.classifier.weight, crafted.classifier.bias])
    with torch.no_grad():
        feature = crafted.features(images[:1])[0].double()
    recovered = dw[7].double() / db[7].double()
    assert float((recovered - feature).norm() / feature.norm()) < 1e-5
    assert abs(float(db[7]) * len(images) + 1.0) < 1e-6  # the bias update counts the fished image: −1/B


def test_images_of_other_classes_send_no_gradient_to_the_extractor():
    data, make, images, labels, sent, record = _fishing_one_of(7)
    crafted = _loaded(make, sent)
    extractor = [p for n, p in crafted.named_parameters() if n.startswith("extractor.")]
    others = F.cross_entropy(crafted(images[1:]), labels[1:], reduction="sum")
    assert all(float(g.abs().max()) == 0.0 for g in torch.autograd.grad(others, extractor))
    fished = F.cross_entropy(crafted(images[:1]), labels[:1])
    assert max(float(g.abs().max()) for g in torch.autograd.grad(fished, extractor)) > 1e-4
    # the same batch under the honest classifier: every image moves the extractor
    honest = make()
    grads = torch.autograd.grad(F.cross_entropy(honest(images[1:]), labels[1:]),
                                [p for n, p in honest.named_parameters() if n.startswith("extractor.")])
    assert max(float(g.abs().max()) for g in grads) > 1e-4


def test_feature_fishing_lets_through_only_the_class_t_images_below_the_threshold():
    data, model = digits_model()
    make = model_factory(model)
    rows = (torch.nonzero(data.labels == 4).flatten()[:3].tolist()
            + torch.nonzero(data.labels == 1).flatten()[:5].tolist())
    images, labels = data.images[rows], data.labels[rows]
    sent, record = fishing_download(get_params(model), make(), data.images[1000:], data.labels[1000:],
                                    _counts(labels))
    assert record.target == 4 and record.expected == 3 and record.direction is not None
    crafted = _loaded(make, sent)
    with torch.no_grad():
        side = crafted.features(images).double() @ record.direction.double() < record.threshold
    weights = fished_weights(make(), record, images)
    assert torch.equal(weights > 0.5, side)  # fished exactly on the low side of τ (classes alike)
    assert 0.0 < record.chance <= 1.0
    _, several = fishing_download(get_params(model), make(), data.images[1000:], data.labels[1000:],
                                  _counts(labels), steps=5)
    assert several.direction is None and several.expected == 3  # several steps: class fishing only


def test_the_interceptor_crafts_only_the_attacked_download_from_the_clients_earlier_upload():
    data, model = digits_model()
    make = model_factory(model)
    honest = get_params(model)
    server = MaliciousServer(attacks.get("fish"), "fishing", {(1, 2)}, make, data.images[1000:1500],
                             ("extractor", "classifier"), public_labels=data.labels[1000:1500],
                             method=make_method("fedavg"))
    channel = ServerChannel([server], recorder=Recorder())
    images, labels = _batch_with_one_of(data, 7, others=(0, 1), per_other=4)
    received = {}
    for r in (0, 1):
        for c in range(3):
            received[(r, c)] = channel.download(Download(r, c, honest))
            trained = _step(make, received[(r, c)].tensors, images, labels)
            channel.upload(Upload(r, c, {**trained, "sample_count": torch.tensor(float(len(images)))}))
    for (r, c), down in received.items():
        same = all(torch.equal(down.tensors[k], honest[k]) for k in honest)
        assert same == ((r, c) != (1, 2))
        assert all(torch.equal(channel.recorder.get(r, c).download.tensors[k], honest[k]) for k in honest)
    assert set(server.records) == {(1, 2)}
    assert server.records[(1, 2)].target == 7  # read from round 0's upload: the one 7 is the rarest class


def _step(make, tensors, images, labels, lr=0.05):
    model = _loaded(make, tensors)
    loss = F.cross_entropy(model(images), labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= lr * g
    return get_params(model)


def test_fishing_refuses_a_method_that_trains_under_its_own_head():
    _, model = digits_model()
    fish, trap = attacks.get("fish").unreachable, attacks.get("trap").unreachable
    reason = fish(make_method("fedper"), model)
    assert reason is not None and "fedper" in reason and "classifier" in reason
    assert trap(make_method("fedper"), model) is None
    assert fish(make_method("fedavg"), model) is None
    assert "fedproto" in fish(make_method("fedproto"), model)


def test_fedsec_attack_fish_writes_the_fished_columns(tmp_path):
    import pandas as pd

    from fedsec.jobs.attack import AttackSettings, check_applicable, run_attack
    from fedsec.runner import RunConfig, prepare

    config = RunConfig.of(method="fedavg", dataset="digits", clients=4, rounds=2, samples_per_client=6, threads=1)
    with pytest.raises(UserError, match="--attack-rounds 1"):
        AttackSettings(attack="fish", rounds=(0,)).resolved(0, 1)
    with pytest.raises(UserError, match="fedper"):
        check_applicable(AttackSettings(attack="fish", rounds=(1,)).resolved(0, 1).spec,
                         prepare(config.updated(method="fedper")))
    summary = run_attack(config, AttackSettings(attack="fish", rounds=(1,), targets=2, iterations=5), out=tmp_path,
                         progress=False)
    rows = pd.read_csv(tmp_path / "attack.csv")
    assert {"target_class", "fished", "k_true", "k_inferred"} <= set(rows.columns)
    assert set(rows["client"]) <= set(summary["targets"]["1"]) and len(rows) >= 2
    assert summary["fishing_targets"] == 2 and "fishing_success_share" in summary
    assert (rows["k_inferred"] == rows["k_true"]).all()  # one plain step: the bias update counts them


def test_the_download_check_refuses_a_fishing_download_and_passes_a_trained_one():
    from defenses.download_check import inspect

    data, model = digits_model()
    make = model_factory(model)
    honest = get_params(model)
    own, own_labels = _batch_with_one_of(data, 7, others=(0, 1), per_other=4)
    for k_images in (1, 3):  # class fishing, feature fishing
        counts = _counts(own_labels)
        counts[7] = k_images
        crafted, _ = fishing_download(honest, make(), data.images[1000:], data.labels[1000:], counts)
        reasons, stats = inspect(crafted, honest, make(), own)
        assert any("classifier moved" in r for r in reasons) and stats["classifier_jump"] > 2.0
    trained = _step(make, honest, own, own_labels)  # an honest round: the next download moved a little
    reasons, stats = inspect(trained, honest, make(), own)
    assert reasons == [] and stats["classifier_jump"] < 0.5


def test_fedsec_attack_fish_attacks_round_1_unless_told(tmp_path):
    """fish reads the client's earlier upload: without --attack-rounds the CLI attacks round 1 (the
    other attacks round 0)."""
    import json

    from fedsec.cli import main

    out = tmp_path / "fish"
    main(["attack", "fish", "--method", "fedavg", "--dataset", "digits", "--clients", "4",
          "--samples-per-client", "6", "--targets", "1", "--iterations", "3", "--threads", "1", "--out", str(out)])
    assert list(json.loads((out / "summary.json").read_text())["targets"]) == ["1"]
