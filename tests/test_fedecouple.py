"""Each FedeCouple term does what the paper says (eqs. 8-16)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedecouple.methods import fedecouple as fc
from fedecouple.methods.base import ClientContext
from fedecouple.models import build_model, set_params

from helpers import tiny_federation


def test_kl_term_zero_when_teacher_and_student_agree():
    logits = torch.randn(8, 10)
    assert fc.distillation_loss(logits, logits.clone(), tau=2.0).abs() < 1e-6
    assert fc.distillation_loss(logits, torch.randn(8, 10), tau=2.0) > 1e-3


def test_kl_term_gives_no_gradient_to_teacher_and_matches_definition():
    student = torch.randn(4, 5, requires_grad=True)
    teacher = torch.randn(4, 5, requires_grad=True)
    loss = fc.distillation_loss(student, teacher, tau=2.0)
    loss.backward()
    assert teacher.grad is None and student.grad is not None
    p_t, p_s = F.softmax(teacher / 2, 1), F.softmax(student / 2, 1)
    manual = (p_t * (p_t.log() - p_s.log())).sum(1).mean()
    assert torch.allclose(loss, manual, atol=1e-6)


def test_center_loss_pulls_to_class_anchor():
    anchors = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    labels = torch.tensor([0, 1])
    assert fc.center_loss(anchors[labels].clone(), anchors, labels) == 0
    feats = torch.tensor([[1.0, 0.0], [1.0, 3.0]])  # squared distances 1 and 4
    assert torch.isclose(fc.center_loss(feats, anchors, labels, "mean"), torch.tensor(5.0 / 4))
    assert torch.isclose(fc.center_loss(feats, anchors, labels, "sum"), torch.tensor(5.0 / 2))


def test_aggregation_weights_match_eq16_by_hand():
    vectors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    counts = torch.tensor([1, 1, 2])
    # ω_avg = 0.25·(1,0) + 0.25·(0,1) + 0.5·(1,1) = (0.75, 0.75); cosines: 1/√2, 1/√2, 1
    cos = np.array([1 / np.sqrt(2), 1 / np.sqrt(2), 1.0])
    expected = cos / cos.sum()
    got = fc.cosine_aggregation_weights(vectors, counts).numpy()
    assert np.allclose(got, expected, atol=1e-6)


def test_server_aggregate_applies_eq16(digits):
    fed = tiny_federation(digits, clients=3)
    fed.run_round()
    uploads = list(fed.channel.recorder.uploads())
    names = [n for n in uploads[0].tensors if n != "sample_count"]
    vec = torch.stack([torch.cat([u.tensors[n].flatten() for n in names]) for u in uploads])
    iota = fc.cosine_aggregation_weights(vec, torch.stack([u.tensors["sample_count"] for u in uploads]))
    for n in names:
        expected = sum(w * u.tensors[n] for w, u in zip(iota, uploads))
        assert torch.allclose(fed.server["global." + n], expected, atol=1e-6)


def test_upload_is_extractor_personal_classifier_and_count(digits):
    fed = tiny_federation(digits, clients=2)
    fed.run_round()
    model = fed.model
    expected = {n for n, _ in model.named_parameters()} | {"sample_count"}
    for up in fed.channel.recorder.uploads():
        assert set(up.tensors) == expected
        # the uploaded classifier is the client's personal one, kept as its state
        state = fed.clients[up.client_id]
        assert torch.equal(up.tensors["classifier.weight"], state["classifier.weight"])


def test_anchors_come_from_frozen_global_extractor_and_never_leave(digits, monkeypatch):
    fed = tiny_federation(digits, clients=2)
    captured = []
    real = ClientContext.class_feature_sums

    def spy(ctx, features, squared_norms=False):  # the one API whole-data statistics go through
        out = real(ctx, features, squared_norms)
        captured.append((features(ctx.images).clone(), ctx.labels.clone(), out.means().clone()))
        return out

    monkeypatch.setattr(ClientContext, "class_feature_sums", spy)
    fed.run_round()
    assert len(captured) == 2
    for cid, (features, labels, anchors) in enumerate(captured):
        # recompute the features with the global extractor the client was sent
        down = fed.channel.recorder.get(0, cid).download
        ref = build_model(fed.model.arch, 1, 8, 10, digits.mean, digits.std)
        set_params(ref, dict(down.tensors))
        ctx = fed.context(cid, 0)
        with torch.no_grad():
            expected = ref.features(ctx.images)
        assert torch.allclose(features, expected, atol=1e-5)
        upload = fed.channel.recorder.get(0, cid).upload
        present = anchors[torch.bincount(labels, minlength=10) > 0]
        for name, tensor in upload.tensors.items():
            rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.ndim else tensor.reshape(1, 1)
            if rows.shape[-1] != present.shape[-1]:
                continue
            sims = F.cosine_similarity(rows.unsqueeze(1), present.unsqueeze(0), dim=2)
            assert sims.max() < 0.99, f"upload field {name} carries an anchor"


def test_ablation_switches_change_the_phases(digits):
    full = tiny_federation(digits, clients=1)
    full.run_round()
    phases = {r.phase for r in full.ground_truth.batches[(0, 0)]}
    assert phases == {"classifier", "extractor-glf", "extractor"}
    no_glf = tiny_federation(digits, clients=1, hp={"glf": False})
    no_glf.run_round()
    assert "extractor-glf" not in {r.phase for r in no_glf.ground_truth.batches[(0, 0)]}


def test_no_gpc_trains_personal_classifier_without_teacher(digits, monkeypatch):
    calls = []
    real = fc.distillation_loss
    monkeypatch.setattr(fc, "distillation_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    tiny_federation(digits, clients=1, hp={"gpc": False}).run_round()
    assert not calls
    tiny_federation(digits, clients=1).run_round()
    assert calls


def test_data_augmentation_doubles_each_batch(digits, monkeypatch):
    sizes = []
    real = F.cross_entropy
    monkeypatch.setattr(fc.F, "cross_entropy", lambda logits, y, *a, **k: sizes.append(len(y)) or real(logits, y, *a, **k))
    tiny_federation(digits, clients=1).run_round()
    # training batches are 10 originals + 10 augmented copies (a ragged last batch is dropped); the
    # other sizes are evaluation passes over test splits, which go through the same F.cross_entropy
    assert sizes.count(20) > 5 and all(n % 2 == 0 for n in sizes if n <= 20)
    sizes.clear()
    tiny_federation(digits, clients=1, hp={"da": False}).run_round()
    assert sizes.count(10) > 5 and 20 not in sizes


def test_fedecouple_learns_on_digits(digits):
    fed = tiny_federation(digits, clients=4, rounds=3)
    rows = fed.run()
    final = np.mean([r["accuracy"] for r in rows if r["round"] == 2])
    assert final > 0.7


@pytest.mark.parametrize("arch,extractor_params,fc_in", [("cnn32", 106_400, 576), ("cnn28", 78_912, 512),
                                                         ("cnn28-same", 214_080, 1568), ("pfllib-cnn", 576_896, 1024)])
def test_model_sizes_follow_the_documented_padding(arch, extractor_params, fc_in):
    """cnn32's extractor is the paper's 415.6 KiB; cnn28 (no padding), cnn28-same (padding 2) and
    PFLlib's FedAvgCNN (conv 32, conv 64, FC 1024 → 512) as documented."""
    channels, size = (3, 32) if arch == "cnn32" else (1, 28)
    model = build_model(arch, channels, size, 10, [0.5] * channels, [0.25] * channels)
    assert sum(p.numel() for p in model.extractor.parameters()) == extractor_params
    assert model.extractor.fc.in_features == fc_in
    assert model(torch.rand(2, channels, size, size)).shape == (2, 10)
    if arch == "cnn32":
        assert extractor_params * 4 / 1024 == pytest.approx(415.6, abs=0.05)
