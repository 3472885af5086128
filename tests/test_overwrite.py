"""No silent overwrite: a command refuses (exit 2, one line naming the folder and what differs) a folder
holding results of another configuration and leaves its files as they were; the same configuration
reads the finished results back; --force replaces them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsec.cli import main

SMALL = ["--dataset", "digits", "--clients", "4", "--rounds", "1", "--threads", "1"]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_mnist"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(capsys, args: list[str], folder: Path, differs: str) -> None:
    before = _files(folder)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert str(folder) in err[0] and differs in err[0] and "--force" in err[0], err
    assert _files(folder) == before


@pytest.mark.parametrize("command", [["attack", "labels", "--method", "fedavg", "--targets", "2"],
                                     ["audit", "--method", "fedavg", "--no-evidence"],
                                     ["train", "--method", "fedavg"]])
def test_another_configuration_is_refused_the_same_is_reused_force_replaces(tmp_path, capsys, command):
    out = tmp_path / "run"
    main([*command, *SMALL, "--out", str(out)])
    first = _files(out)
    assert "config.toml" in first
    _refused(capsys, [*command, *SMALL, "--seed", "5", "--out", str(out)], out, "--seed 0 there, 5 here")
    capsys.readouterr()
    main([*command, *SMALL, "--out", str(out)])  # the same configuration: read back, nothing rewritten
    assert "finished earlier" in capsys.readouterr().out and _files(out) == first
    main([*command, *SMALL, "--seed", "5", "--force", "--out", str(out)])
    assert 'seed = 5' in (out / "config.toml").read_text() and _files(out) != first
    capsys.readouterr()
    main([*command, *SMALL, "--seed", "5", "--force", "--out", str(out)])  # the same configuration, forced: run again
    assert "finished earlier" not in capsys.readouterr().out


def test_train_without_out_writes_a_default_folder_and_says_where(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["train", "--method", "fedavg", *SMALL])
    assert "→ runs/train-fedavg" in capsys.readouterr().out
    assert (tmp_path / "runs" / "train-fedavg" / "summary.json").is_file()


def test_a_folder_of_an_earlier_version_without_a_record_is_refused(tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "attack.csv").write_text("method,attack\n")
    _refused(capsys, ["attack", "labels", "--method", "fedavg", *SMALL, "--out", str(out)], out,
             "no record of their configuration")


@pytest.mark.parametrize("command", [["flower", "attack", "labels", str(EXAMPLE), "--victim-batch", "0"],
                                     ["flower", "audit", str(EXAMPLE)]])
def test_flower_commands_refuse_another_configuration_before_running_the_app(tmp_path, capsys, command):
    pytest.importorskip("flwr")
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    (out / "done.json").write_text(json.dumps({"identity": {"seed": 3}, "status": "done"}))
    _refused(capsys, [*command, "--out", str(out)], out, "there,")


def test_force_computes_every_part_of_a_defense_sweep_again(tmp_path):
    """A sweep reuses the parts of a value it did not finish (resuming); --force computes them again."""
    out = tmp_path / "sweep"
    args = ["defend", "--method", "fedavg", *SMALL, "--defense", "clip", "--values", "1", "--attacks", "labels",
            "--targets", "1", "--no-baseline", "--out", str(out)]
    main(args)
    parts = [out / "value-1.0" / "train", out / "value-1.0" / "attack-labels"]
    for part in parts:
        (part / "summary.json").write_text('{"stale": true}')  # what an earlier configuration left
    main([*args, "--force"])
    for part in parts:
        assert "stale" not in json.loads((part / "summary.json").read_text()), part
