"""--device on every command, the ResNets, and the user's own model (--model)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fedecouple.devices import resolve_device
from fedecouple.errors import UserError
from fedecouple.models import SplitModel, build_model, check_architecture
from fedsec.cli import main

NO_CUDA = not torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU")

# each command with a setting that fails validation after the flags are parsed: a device the command
# accepts must let parsing through to that error, a device it refuses must stop before it
COMMANDS = {
    "train": ["train", "--dataset", "digits"],
    "compare": ["compare", "--dataset", "digits", "--methods", "fedavg", "--seeds", "0"],
    "attack": ["attack", "ig", "--dataset", "digits"],
    "audit": ["audit", "--dataset", "digits"],
    "report": ["report", "--dataset", "digits", "--methods", "fedavg", "--attacks", "ig"],
    "defend": ["defend", "--dataset", "digits", "--defense", "noise", "--values", "0.1"],
    "mia": ["mia", "--dataset", "digits"],
}
# the Flower commands, with an app folder that is not there (they check it after the flags)
FLOWER = {"flower attack": ["flower", "attack", "no-such-app", "--attack", "ig"],
          "flower audit": ["flower", "audit", "no-such-app"]}


def run(argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of ``fedsec argv`` run in this process."""
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_accepts_device_cpu(command, tmp_path, capsys):
    code, err = run([*COMMANDS[command], "--device", "cpu", "--clients", "0", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--clients must be at least 1" in err and "device" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_cuda_without_a_gpu_is_one_line_exit_2_nothing_written(command, device, tmp_path, capsys):
    code, err = run([*COMMANDS[command], "--device", device, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --device {device}: torch sees no CUDA")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", list(FLOWER))
def test_flower_commands_take_device(command, tmp_path, capsys):
    pytest.importorskip("flwr")
    code, err = run([*FLOWER[command], "--device", "cpu", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "no-such-app" in err and "device" not in err
    if NO_CUDA:
        code, err = run([*FLOWER[command], "--device", "cuda", "--out", str(tmp_path / "o")], capsys)
        assert code == 2 and "torch sees no CUDA" in err
    assert not (tmp_path / "o").exists()


def test_device_names():
    assert resolve_device("cpu") == "cpu" and resolve_device(" CPU ") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(UserError):
            resolve_device(bad)


def test_cpu_run_records_its_device(tmp_path, capsys):
    code, err = run(["train", "--method", "fedavg", "--dataset", "digits", "--clients", "2", "--rounds", "1",
                     "--threads", "1", "--device", "auto", "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    for name in ("config.json", "summary.json"):
        record = json.loads((tmp_path / "r" / name).read_text())
        assert record["device"] == resolve_device("auto") and ("gpu" in record)
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["gpu"] is None or not NO_CUDA


# ------------------------------------------------------------------------------------------------
# ResNets


@pytest.mark.parametrize("arch, feature_dim", [("resnet18", 512), ("resnet18-bn", 512), ("resnet50", 2048)])
@pytest.mark.parametrize("channels, side", [(1, 8), (1, 28), (3, 32)])
def test_resnets_take_grayscale_and_colour_images_of_every_small_size(arch, feature_dim, channels, side):
    if arch == "resnet50" and side != 32:
        pytest.skip("resnet50 is for 32x32 data (it takes the others too; kept out for speed)")
    model = build_model(arch, channels, side, 10, [0.5] * channels, [0.25] * channels)
    logits = model(torch.rand(2, channels, side, side))
    assert logits.shape == (2, 10) and model.feature_dim == feature_dim
    groups = {name.split(".")[0] for name, _ in model.named_parameters()}
    assert groups == {"extractor", "classifier"}
    norms = {type(m) for m in model.modules()} & {nn.BatchNorm2d, nn.GroupNorm}
    assert norms == ({nn.BatchNorm2d} if arch.endswith("-bn") else {nn.GroupNorm})


def test_resnet_refuses_images_smaller_than_its_stem_takes():
    with pytest.raises(UserError, match="at least 8x8"):
        check_architecture("resnet18", 4)


def test_resnet18_train_attack_ig_audit_on_digits(tmp_path, capsys):
    """The whole chain on ResNet-18 (GroupNorm) with digits-sized data: training, IG batched on two
    targets (vmap through the ResNet), and the audit, in seconds."""
    fed = ["--dataset", "digits", "--arch", "resnet18", "--clients", "10", "--join-ratio", "0.2", "--rounds", "1",
           "--threads", "1", "--device", "cpu"]
    code, err = run(["train", "--method", "fedavg", *fed, "--out", str(tmp_path / "t")], capsys)
    assert code == 0, err
    code, err = run(["attack", "ig", "--method", "fedavg", *fed, "--targets", "2", "--iterations", "3",
                     "--restarts", "1", "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["images_scored"] == 2 and summary["mean_psnr"] is not None
    assert summary["config"]["arch"] == "resnet18"
    code, err = run(["audit", "--method", "fedper", *fed, "--no-evidence", "--out", str(tmp_path / "u")], capsys)
    assert code == 0, err
    fields = (tmp_path / "u" / "audit.csv").read_text()
    assert "extractor.layer4.1.conv2.weight" in fields and "classifier.weight" not in fields  # FedPer: base only


def test_batch_norm_replay_uses_batch_statistics_and_batches_under_vmap(tmp_path, capsys):
    """resnet18-bn: the attack's model normalises by batch statistics (as the client trained) and the
    running statistics never move, so two targets batch in one vmapped call."""
    from fedecouple.models import use_batch_statistics

    model = use_batch_statistics(build_model("resnet18-bn", 1, 8, 10, [0.5], [0.25]).eval())
    before = {k: v.clone() for k, v in model.named_buffers()}
    x = torch.rand(4, 1, 8, 8)
    # batch statistics: an image's logits depend on the batch it is in (running statistics would not)
    assert not torch.allclose(model(x)[:2], model(x[:2]))
    assert all(torch.equal(before[k], v) for k, v in model.named_buffers())
    code, err = run(["attack", "ig", "--method", "fedavg", "--dataset", "digits", "--arch", "resnet18-bn",
                     "--clients", "10", "--join-ratio", "0.2", "--threads", "1", "--targets", "2", "--iterations",
                     "2", "--restarts", "1", "--victim-batch", "2", "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["images_scored"] == 4


@pytest.mark.parametrize("command", [
    ["defend", "--defense", "dp", "--values", "1", "--attacks", "labels"],
    ["mia", "--dp", "1"],
])
def test_dp_refuses_batch_norm_before_anything_is_written(command, tmp_path, capsys):
    code, err = run([*command, "--method", "fedavg", "--dataset", "digits", "--arch", "resnet18-bn",
                     "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and "DP-SGD cannot train model resnet18-bn" in err
    assert not (tmp_path / "o").exists()


def test_ig_on_resnet18_with_cifar_format_files(tmp_path, monkeypatch, capsys):
    """`fedsec attack ig --method fedavg --arch resnet18 --dataset cifar10 --data-dir ...` on tiny files
    in CIFAR-10's on-disk format."""
    pytest.importorskip("torchvision")
    from test_ondisk_loaders import write_cifar10

    write_cifar10(tmp_path / "data", monkeypatch, sizes=(8, 8, 8, 8, 8), n_test=8)
    code, err = run(["attack", "ig", "--method", "fedavg", "--arch", "resnet18", "--dataset", "cifar10",
                     "--data-dir", str(tmp_path / "data"), "--partition", "iid", "--clients", "4", "--targets", "1",
                     "--iterations", "2", "--restarts", "1", "--threads", "1", "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["images_scored"] == 1 and (tmp_path / "a" / "reconstructions.png").exists()


# ------------------------------------------------------------------------------------------------
# --model package.module:factory


class TinyExtractor(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())


def tiny_model() -> SplitModel:
    """A user's model for digits: 1x8x8 images, 10 classes."""
    return SplitModel(TinyExtractor(), nn.Linear(16, 10), [0.3], [0.4], arch="tiny")


def three_classes() -> SplitModel:
    return SplitModel(TinyExtractor(), nn.Linear(16, 3), [0.3], [0.4], arch="tiny")


def not_split() -> nn.Module:
    return nn.Linear(64, 10)


def extra_group() -> SplitModel:
    model = tiny_model()
    model.head2 = nn.Linear(2, 2)
    return model


def broken() -> SplitModel:
    raise RuntimeError("weights file missing")


def for_28x28() -> SplitModel:
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16)), nn.Linear(16, 10), [0.3], [0.4],
                      arch="mlp28")


def test_own_model_trains_and_is_attacked(tmp_path, capsys):
    fed = ["--model", "test_devices:tiny_model", "--dataset", "digits", "--clients", "3", "--rounds", "1",
           "--threads", "1"]
    code, err = run(["train", "--method", "fedavg", *fed, "--out", str(tmp_path / "t")], capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "t" / "config.json").read_text())["config"]
    assert config["model"] == "test_devices:tiny_model" and config["arch"] is None
    code, err = run(["attack", "ig", "--method", "fedavg", *fed, "--targets", "1", "--iterations", "2",
                     "--restarts", "1", "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["images_scored"] == 1


@pytest.mark.parametrize("factory, fragment", [
    ("test_devices:not_split", "returned Linear, not a SplitModel"),
    ("test_devices:extra_group", "it has head2.*"),
    ("test_devices:broken", "raised RuntimeError: weights file missing"),
    ("test_devices:three_classes", "the data set has 10 classes"),
    ("test_devices:for_28x28", "does not take the data set's 1x8x8 images"),
    ("test_devices:absent", "cannot load it"),
    ("test_devices", "expected package.module:factory"),
])
def test_bad_factory_is_one_line_exit_2_nothing_written(factory, fragment, tmp_path, capsys):
    code, err = run(["train", "--model", factory, "--dataset", "digits", "--clients", "2", "--out",
                     str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "o").exists()


def test_model_and_arch_together_are_refused(tmp_path, capsys):
    code, err = run(["train", "--model", "test_devices:tiny_model", "--arch", "digits", "--dataset", "digits",
                     "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "not both" in err and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------
# on a GPU


@needs_cuda
def test_cuda_training_records_the_gpu_and_matches_the_cpu_closely(tmp_path):
    from fedsec.runner import RunConfig, train

    base = dict(method="fedecouple", dataset="digits", clients=3, rounds=1, threads=1)
    cpu = train(RunConfig.of(**base, device="cpu"), tmp_path / "cpu")
    gpu = train(RunConfig.of(**base, device="cuda"), tmp_path / "gpu")
    assert gpu["device"] == "cuda" and gpu["gpu"]
    assert abs(gpu["mean_accuracy"] - cpu["mean_accuracy"]) < 0.1  # one round: floats differ, not the outcome
    again = train(RunConfig.of(**base, device="cuda"), tmp_path / "gpu2")
    assert (tmp_path / "gpu" / "metrics.csv").read_text() == (tmp_path / "gpu2" / "metrics.csv").read_text()


@needs_cuda
@pytest.mark.parametrize("batched", ["--batched", "--no-batched"])
def test_cuda_attack(batched, tmp_path, capsys):
    code, err = run(["attack", "ig", "--method", "fedavg", "--dataset", "digits", "--arch", "resnet18",
                     "--clients", "4", "--targets", "2", "--iterations", "3", "--restarts", "1", batched,
                     "--device", "cuda", "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["images_scored"] == 2


@needs_cuda
def test_cuda_dp_and_mia(tmp_path, capsys):
    code, err = run(["defend", "--method", "fedpac", "--dataset", "digits", "--clients", "3", "--rounds", "1",
                     "--defense", "dp", "--values", "1", "--attacks", "labels", "--no-baseline", "--device", "cuda",
                     "--out", str(tmp_path / "d")], capsys)
    assert code == 0, err
    code, err = run(["mia", "--method", "fedavg", "--dataset", "digits", "--clients", "3", "--rounds", "1",
                     "--reference-runs", "2", "--attacks", "loss,rmia", "--offline-a", "0.3", "--dp", "1",
                     "--device", "cuda", "--out", str(tmp_path / "m")], capsys)
    assert code == 0, err


@needs_cuda
@pytest.mark.parametrize("victim_batch", ["0", "2"])
def test_cuda_audit_cells(victim_batch, tmp_path, capsys):
    """The audit preset's two IG cells on cuda: real local training (every image, replayed) and the
    textbook step on 2 images (labels from the closed-form counts, made on the device)."""
    code, err = run(["attack", "ig", "--method", "fedpac", "--preset", "audit", "--dataset", "digits", "--clients", "4",
                     "--rounds", "2", "--attack-rounds", "0,1", "--targets", "1", "--iterations", "3",
                     "--victim-batch", victim_batch, "--threads", "1", "--device", "cuda", "--out", str(tmp_path / "a")],
                    capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["images_scored"] >= 4
