"""Attacks: scoring, matching, label rule, the attacks themselves, the observation, the harness and CLI."""
from __future__ import annotations

import copy
import dataclasses
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from torch.func import functional_call

from attacks import ATTACKS
from attacks.base import Budget, LocalHyperparameters, NotApplicable, Observation
from attacks.inversion.idlg_rule import idlg_labels
from attacks.metrics import match, psnr, score_reconstructions, ssim
from attacks.inversion.observation import observe, update_target
from attacks.inversion.forward_model import GradientMatcher
from fedecouple.engine import VictimSetting
from fedecouple.methods import make_method
from fedecouple.models import build_model, get_params

from helpers import tiny_federation
from helpers import TEST_THREADS


# ------------------------------------------------------------------------------------------------
# scoring


@pytest.mark.parametrize("channels", [1, 3])
def test_psnr_known_mse_is_never_divided_by_channels(channels):
    truth = torch.zeros(channels, 8, 8)
    recon = torch.full((channels, 8, 8), 0.1)  # MSE 0.01 in every channel → exactly 20 dB
    assert psnr(recon, truth) == pytest.approx(20.0, abs=1e-5)
    recon = torch.full((channels, 8, 8), 0.01)  # MSE 1e-4 → 40 dB
    assert psnr(recon, truth) == pytest.approx(40.0, abs=1e-5)


@pytest.mark.parametrize("channels", [1, 3])
def test_psnr_and_ssim_agree_with_skimage(channels):
    gen = torch.Generator().manual_seed(channels)
    truth = torch.rand(channels, 16, 16, generator=gen, dtype=torch.float64)
    recon = (truth + 0.1 * torch.randn(channels, 16, 16, generator=gen, dtype=torch.float64)).clamp(0, 1)
    t, r = truth.numpy(), recon.numpy()
    assert psnr(recon, truth) == pytest.approx(peak_signal_noise_ratio(t, r, data_range=1.0), rel=1e-9)
    mse = float(((t - r) ** 2).mean())
    assert psnr(recon, truth) == pytest.approx(10 * np.log10(1 / mse), rel=1e-9)
    expected = (structural_similarity(t[0], r[0], data_range=1.0) if channels == 1
                else structural_similarity(t, r, data_range=1.0, channel_axis=0))
    assert ssim(recon, truth) == pytest.approx(expected, rel=1e-9)


def test_matching_finds_a_permuted_batch():
    gen = torch.Generator().manual_seed(0)
    truths = torch.rand(5, 1, 8, 8, generator=gen)
    perm = torch.tensor([3, 0, 4, 1, 2])
    recons = (truths[perm] + 0.02 * torch.randn(5, 1, 8, 8, generator=gen)).clamp(0, 1)
    assert match(recons, truths).tolist() == perm.tolist()
    rows = score_reconstructions(recons, truths, truths.mean(0))
    assert [r["truth_index"] for r in rows] == perm.tolist()
    assert all(r["psnr"] > 30 > r["prior_psnr"] for r in rows)


# ------------------------------------------------------------------------------------------------
# iDLG's label rule


def test_idlg_rule_on_a_hand_made_gradient():
    c, d, y = 10, 32, 7
    p = torch.softmax(torch.randn(c, generator=torch.Generator().manual_seed(1)), 0)
    for h in (torch.rand(d), F.leaky_relu(torch.randn(d) + 0.5, 0.01)):  # ReLU-like and LeakyReLU features
        grad_w = torch.outer(p - F.one_hot(torch.tensor(y), c).float(), h)  # ∂CE/∂W for one sample
        labels, _ = idlg_labels(grad_w, 1)
        assert labels.tolist() == [y]
        assert idlg_labels(-0.05 * -grad_w, 1)[0].tolist() == [y]  # any positive multiple (−Δ of an SGD step)
    # a batch of three (two of class 2, one of class 5): the extension spreads labels over negative rows
    h = torch.rand(3, d)
    onehot = F.one_hot(torch.tensor([2, 2, 5]), c).float()
    grad_w = ((torch.full((3, c), 1.0 / c) - onehot).T @ h) / 3
    labels, notes = idlg_labels(grad_w, 3)
    assert sorted(labels.tolist()) == [2, 2, 5] and notes


def test_idlg_rule_is_not_read_from_a_distilled_personal_classifier():
    """FedeCouple's personal classifier in a trained round already fits the image (p_y ≈ 1): its update
    is mostly the KL term towards the global classifier, the negative row sums spread over several rows
    and the sign rule names a wrong class. ``idlg_applies`` tells the two apart."""
    from attacks.inversion.idlg_rule import idlg_applies, idlg_share
    from fedecouple.methods.fedecouple import distillation_loss

    c, d, y = 10, 32, 7
    g = torch.Generator().manual_seed(2)
    h = torch.rand(1, d, generator=g)
    teacher = torch.randn(c, d, generator=g) * 0.3
    student = torch.randn(c, d, generator=g) * 0.3
    student[y] += 8.0 / h.sum()  # fits the image: p_y > 0.99
    for lam, tau in [(0.0, 1.0), (1.0, 3.0)]:
        w = student.clone().requires_grad_(True)
        logits = h @ w.T
        assert F.softmax(logits, 1)[0, y] > 0.99
        loss = F.cross_entropy(logits, torch.tensor([y])) + lam * distillation_loss(logits, h @ teacher.T, tau)
        (grad,) = torch.autograd.grad(loss, w)
        if lam == 0:  # plain cross-entropy: one negative row, the true class's
            assert idlg_share(grad) == 1.0 and idlg_applies(grad) and idlg_labels(grad, 1)[0].tolist() == [y]
        else:
            assert idlg_share(grad) < 0.5 and not idlg_applies(grad)
            assert idlg_labels(grad, 1)[0].tolist() != [y]  # what the rule would have read


# ------------------------------------------------------------------------------------------------
# the attacks on a small fixed case (8x8 digits, FedAvg-style update of the initial model)


def synthetic_observation(dataset, indices, steps=1, lr=0.05, known=True, upload_groups=("extractor", "classifier"),
                          download_groups=("extractor", "classifier")):
    torch.manual_seed(0)
    model = build_model("digits", 1, 8, 10, dataset.mean, dataset.std)
    start = get_params(model)
    x, y = dataset.images[indices], dataset.labels[indices]
    params = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    for _ in range(steps):
        grads = torch.autograd.grad(F.cross_entropy(functional_call(model, params, (x,)), y), list(params.values()))
        params = {k: (v - lr * g).detach().requires_grad_(True) for (k, v), g in zip(params.items(), grads)}
    upload = {k: v.detach() for k, v in params.items() if k.split(".")[0] in upload_groups}
    upload["sample_count"] = torch.tensor(len(indices))
    hp = LocalHyperparameters(lr=lr, steps=steps, batch_size=len(indices)) if known else None
    download = {k: v for k, v in start.items() if k.split(".")[0] in download_groups}
    obs = Observation(method=make_method("fedavg"), round=0, client_id=0, download=download, upload=upload,
                      previous_upload=None, make_model=lambda: copy.deepcopy(model), image_shape=(1, 8, 8),
                      num_classes=10, known_hyperparameters=hp)
    return obs, x, y


@pytest.mark.parametrize("mode,steps", [("scaled", 1), ("replay", 3)])
def test_the_true_batch_reproduces_the_observed_update(digits, mode, steps):
    obs, x, y = synthetic_observation(digits, [3, 40], steps=steps)
    matcher = GradientMatcher(obs, mode)
    assert matcher.mode == {"scaled": "scaled-gradient", "replay": "replay"}[mode]
    for got, want in zip(matcher.dummy(x, y), matcher.target):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


# DLG is bimodal: a start converges or stalls, and which one is decided by float rounding (another
# CPU, another thread count). Four starts, the lowest objective kept, make "beats the prior" a
# property of the attack rather than of one machine's rounding.
@pytest.mark.parametrize("name,image,seed,iterations", [("dlg", 40, 1, 40), ("idlg", 11, 0, 40), ("ig", 40, 1, 150)])
def test_each_attack_beats_the_prior(digits, name, image, seed, iterations):
    obs, x, y = synthetic_observation(digits, [image])
    result = ATTACKS[name].attack_one(obs, Budget(iterations=iterations, restarts=4, batch=1), seed)
    (row,) = score_reconstructions(result.images, x, digits.images.mean(0))
    assert result.images.shape == (1, 1, 8, 8) and 0 <= float(result.images.min()) <= float(result.images.max()) <= 1
    assert row["psnr"] > row["prior_psnr"] + 5, (name, row)
    assert result.labels.tolist() == y.tolist()
    assert result.trace["mode"] == "scaled-gradient"


def test_unknown_hyperparameters_and_private_head(digits):
    obs, x, _ = synthetic_observation(digits, [5], known=False, upload_groups=("extractor",),
                                      download_groups=("extractor",))  # FedPer-like: no head either way
    target = update_target(obs)
    assert all(n.startswith("extractor.") for n in target.names) and not target.classifier_update
    assert any("not uploaded (kept private)" in n and "initial classifier" in n for n in target.notes)
    result = ATTACKS["idlg"].attack_one(obs, Budget(iterations=3), 0)
    assert result.trace["mode"] == "scaled-gradient"
    assert any("iDLG cannot read the label" in n for n in result.notes)
    with pytest.raises(ValueError, match="replay needs"):
        GradientMatcher(obs, "replay")


def test_weightless_upload_is_not_applicable(digits):
    obs, _, _ = synthetic_observation(digits, [5])
    obs = dataclasses.replace(obs, upload={"proto.3": torch.zeros(64), "count.3": torch.tensor(4)})
    with pytest.raises(NotApplicable, match="proto"):
        ATTACKS["dlg"].attack_one(obs, Budget(iterations=1), 0)


# ------------------------------------------------------------------------------------------------
# the observation


def test_observation_uses_the_previous_upload_for_the_personal_classifier(digits):
    victim = VictimSetting(batch=2, steps=1, targets={(r, c) for r in (0, 1) for c in (0, 1)})  # short training
    fed = tiny_federation(digits, "fedecouple", clients=2, rounds=2, victim=victim)
    fed.run(2)
    rec = fed.channel.recorder
    model = copy.deepcopy(fed.model)
    common = dict(method=fed.method, make_model=lambda: copy.deepcopy(model), image_shape=(1, 8, 8), num_classes=10)

    first = observe(rec, 0, 1, **common)
    target = update_target(first)
    assert first.previous_upload is None and first.method.persistent_groups == ("classifier",)
    assert any("no previous upload of the personal classifier" in n for n in target.notes)
    torch.testing.assert_close(target.before["classifier.weight"], first.download["classifier.weight"])

    second = observe(rec, 1, 1, **common)
    target = update_target(second)
    previous = rec.get(0, 1).upload.tensors
    torch.testing.assert_close(second.previous_upload["classifier.weight"], previous["classifier.weight"])
    torch.testing.assert_close(target.before["classifier.weight"], previous["classifier.weight"])
    torch.testing.assert_close(target.delta["classifier.bias"],
                               second.upload["classifier.bias"] - previous["classifier.bias"])
    torch.testing.assert_close(target.before["extractor.conv1.weight"], second.download["extractor.conv1.weight"])
    assert not any("previous upload" in n for n in target.notes)


def test_an_attack_given_an_observation_cannot_reach_the_ground_truth(digits):
    """Everything an attack receives pickles without the data set's images or the harness's record:
    what crosses to an attack is the server's view, nothing else."""
    import pickle

    fed = tiny_federation(digits, "fedavg", clients=2, rounds=1)
    fed.run(1)
    model = copy.deepcopy(fed.model)
    obs = observe(fed.channel.recorder, 0, 0, method=fed.method, make_model=lambda: copy.deepcopy(model),
                  image_shape=(1, 8, 8), num_classes=10)
    blob = pickle.dumps(dataclasses.replace(obs, make_model=None))
    trained = fed.ground_truth.samples(0, 0)
    assert len(trained) > 0
    assert len(blob) < digits.images.numel() * 4 / 2  # far smaller than the data set: no copy of it inside
    for i in trained[:20]:  # no training image's bytes appear in what the attack gets
        assert digits.images[int(i)].numpy().tobytes() not in blob
    assert fed.ground_truth.__class__.__name__.encode() not in blob


def test_the_harness_reads_ground_truth_only_after_the_attack(monkeypatch, tmp_path):
    from fedecouple.engine import GroundTruth
    from fedsec.jobs import attack as harness
    from fedsec.runner import RunConfig

    events = []
    real_samples = GroundTruth.samples

    def spy_samples(self, round, client_id):
        events.append("ground truth")
        return real_samples(self, round, client_id)

    real_run = harness.attacks.Batch.run

    def spy_run(batch, seeds):
        events.append("attack")
        return real_run(batch, seeds)

    monkeypatch.setattr(GroundTruth, "samples", spy_samples)
    monkeypatch.setattr(harness.attacks.Batch, "run", spy_run)
    config = RunConfig.of(method="fedavg", dataset="digits", clients=3)
    summary = harness.run_attack(config, harness.AttackSettings("dlg", iterations=2), progress=False)
    # both targets share round 0's model: one batched attack, then the two truths are read to score it
    assert events == ["attack", "ground truth", "ground truth"]
    assert summary["images_scored"] == 2 and summary["config"]["rounds"] == 1


def test_the_threat_model_builds_the_whole_observation():
    """``RecordedRun.observe``: every switch of the ``ThreatModel`` (and the victim setting) is in the
    Observation it returns; nothing is set on it afterwards."""
    from attacks.recorded import ThreatModel
    from fedsec.jobs.attack import AttackSettings
    from fedsec.recording import recording_federation
    from fedsec.runner import RunConfig, prepare

    config = RunConfig.of(method="fedavg", dataset="digits", clients=3, rounds=1, threads=TEST_THREADS)
    settings = AttackSettings("dlg", victim_batch=2, victim_steps=3).resolved(0, TEST_THREADS)
    fed, run, targets = recording_federation(prepare(config), settings)
    fed.run(1)
    fed.close()
    r, c = 0, targets[0][0]
    args = settings.split()
    assert (args.victim.batch, args.victim.steps) == (2, 3) and fed.victim.targets == {(0, t) for t in targets[0]}
    honest = run.observe(r, c, args.threat, args.victim)
    hp = honest.known_hyperparameters
    assert (hp.lr, hp.steps, hp.batch_size, hp.samples) == (run.train.lr, 3, 2, 2)
    assert honest.head_known and honest.copies == "free" and honest.known_schedule is None
    assert honest.auxiliary is None and honest.round_prototypes is None and honest.crafted is None
    oracle = run.observe(r, c, ThreatModel(head_known=False, augmentations="oracle"), args.victim)
    truth = run.ground_truth.schedule(r, c)
    assert not oracle.head_known and len(truth) == 3
    assert [s.members for s in oracle.known_schedule.steps] == [tuple(int(p) for p in t.positions) for t in truth]
    blind = run.observe(r, c, ThreatModel(hyperparameters_known=False, augmentations="family"))
    assert blind.known_hyperparameters is None and blind.copies == "family"
    with pytest.raises(ValueError, match="was not recorded"):
        run.observe(5, c, args.threat)


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_attack_preset_audit_attacks_real_local_training_at_round_0_and_the_last(tmp_path, capsys):
    """``fedsec attack ig --preset audit``: the audit's real-training cell (2 clients, every image they
    trained on, one start) at round 0 and the last preset round; explicit flags win (here they scale
    the federation down and cut the steps)."""
    from fedsec.cli import main

    out = tmp_path / "audit"
    main(["attack", "ig", "--preset", "audit", "--method", "fedavg", "--dataset", "digits", "--clients", "4",
          "--attack-rounds", "0,1", "--iterations", "2", "--out", str(out)])
    assert re.search(r"estimated time: about \d+ (s|min)", capsys.readouterr().err)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["victim"] is None and summary["budget"]["restarts"] == 1 and summary["budget"]["iterations"] == 2
    assert summary["attack_rounds"] == [0, 1] and all(len(t) == 2 for t in summary["targets"].values())
    assert summary["n_images"] >= 32 and summary["n_targets"] == 4  # every image two clients trained on, twice
    assert summary["config"]["clients"] == 4 and len(summary["mean_psnr_ci"]) == 2


def test_cli_attack_dlg_fedecouple_writes_the_three_files(tmp_path, capsys):
    from fedsec.cli import main

    out = tmp_path / "atk"
    main(["attack", "dlg", "--method", "fedecouple", "--dataset", "digits", "--clients", "2", "--iterations", "3",
          "--out", str(out)])
    frame = pd.read_csv(out / "attack.csv")
    assert list(frame.columns) == ["method", "attack", "mode", "round", "client", "image", "psnr", "ssim",
                                   "prior_psnr", "class_prior_psnr", "label_true", "label_pred", "mis_specified",
                                   "not_converged", "replay_cosine", "objective_truth", "objective_reconstruction",
                                   "label_count_error", "input_error"]
    # one FedeCouple image: the features its classifier step trained on are solved from the upload exactly
    assert (frame["input_error"] < 1e-3).all()
    # one image, one step: the closed-form label count (from the personal classifier's update) is right
    assert (frame["label_count_error"] == 0).all()
    assert len(frame) == 2 and set(frame["method"]) == {"fedecouple"} and set(frame["round"]) == {0}
    assert set(frame["mode"]) == {"method"}  # FedeCouple's own local training is replayed
    # the replay on the truth is the client's computation; the truth is no worse than the reconstruction
    assert (frame["replay_cosine"] > 0.9999).all() and not frame["mis_specified"].any()
    assert (frame["objective_truth"] < 1e-4).all()
    summary = json.loads((out / "summary.json").read_text())
    for key in ("mean_psnr", "median_psnr", "max_psnr", "mean_prior_psnr", "mean_class_prior_psnr", "mean_ssim",
                "label_accuracy", "seconds", "config", "seed", "versions", "threat_model", "notes", "mis_specified"):
        assert key in summary
    assert summary["config"]["rounds"] == 1
    assert any("no previous upload of the personal classifier" in n for n in summary["notes"])
    # what the numbers' rounding came from, and what repeats
    assert {"cpu", "blas", "torch_threads", "reproducibility"} <= set(summary["machine"])
    # two targets: the line says n and that two are too few for an interval, and ends with the check's verdict
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("dlg on fedecouple")][0]
    assert "n = 2 images over 2 targets" in line and "(too few targets for an interval)" in line
    assert summary["mean_psnr_ci"] is None
    if summary["not_converged_targets"]:
        assert line.endswith(f"stopped short of the truth on {summary['not_converged_targets']} of 2 targets: a lower bound")
    assert (out / "reconstructions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("attack,method,needles", [
    ("dlg", "fedproto", ["no model weights", "no gradient", "fedsec attack proto"]),
    ("proto", "fedavg", ["no prototypes", "fedsec attack dlg"]),
    ("labels", "fedper", ["no label information"]),
])
def test_cli_inapplicable_attack_stops_before_training(tmp_path, capsys, monkeypatch, attack, method, needles):
    from fedecouple.engine import Federation
    from fedsec.cli import main

    monkeypatch.setattr(Federation, "run_round", lambda self: pytest.fail("trained before finding nothing to attack"))
    out = tmp_path / "none"
    with pytest.raises(SystemExit) as exc:
        main(["attack", attack, "--method", method, "--dataset", "digits", "--clients", "3", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert all(n in err for n in needles), err
    assert not out.exists()


@pytest.mark.timeout(600)
def test_dlg_rebuilds_mnist_digits_from_the_padded_cnn_at_round_0():
    """The classic setting (round 0 at the initial weights, one image, one step) on mnist5k with the
    28x28 CNN read with "same" padding: DLG rebuilds the digits (about 38 dB over 4 targets)."""
    from fedsec.jobs.attack import AttackSettings, run_attack
    from fedsec.runner import RunConfig

    # two starts per target, the lower objective kept: one start can stall on another CPU's rounding
    summary = run_attack(RunConfig.of(method="fedavg", dataset="mnist5k", arch="cnn28-same", seed=0, threads=TEST_THREADS),
                         AttackSettings("dlg", targets=2, restarts=2), progress=False)
    assert summary["images_scored"] == 2 and summary["label_accuracy"] == 1.0
    assert summary["mean_psnr"] > 25.0 and summary["mean_psnr"] > summary["mean_prior_psnr"] + 15, summary["mean_psnr"]


def test_a_training_that_diverges_after_an_attacked_round_keeps_that_round(monkeypatch):
    """A federation whose training diverges in round 2 (stood in: the upload check raises there) still
    has round 0's recorded upload: the attack scores round 0, drops round 2 and says so; one that
    diverges before any attacked round is done is the one-line error it was."""
    import fedecouple.backends as backends
    from fedecouple.errors import UserError
    from fedsec.jobs import attack as harness
    from fedsec.runner import RunConfig

    real_check = backends.check_finite_upload

    def diverging(upload, client_id, round):
        if round >= 2:
            raise UserError(f"training diverged (non-finite upload: w) on client {client_id} in round {round}; lower lr", fields=("lr",))
        return real_check(upload, client_id, round)

    monkeypatch.setattr(backends, "check_finite_upload", diverging)
    config = RunConfig.of(method="fedavg", dataset="digits", clients=3, threads=TEST_THREADS)
    summary = harness.run_attack(config, harness.AttackSettings("dlg", rounds=(0, 2), iterations=2), progress=False)
    assert summary["attack_rounds"] == [0] and summary["images_scored"] == 2
    assert any("training diverged" in n and "round(s) 2 dropped" in n for n in summary["notes"])
    with pytest.raises(UserError, match="training diverged"):
        harness.run_attack(config, harness.AttackSettings("dlg", rounds=(2,), iterations=2), progress=False)
