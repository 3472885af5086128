"""Every numeric option of every command is checked as it is parsed: a value out of range is one line
on stderr naming the flag and the allowed range, exit status 2, and nothing written."""
from __future__ import annotations

import pytest

from fedsec.cli import main

SMALL = ["--dataset", "digits", "--clients", "3", "--rounds", "1"]
TRAIN = [("--classes-per-client", "0"), ("--s", "-5"), ("--s", "150"), ("--samples-per-client", "0"),
         ("--beta", "0"), ("--clients", "0"), ("--rounds", "0"), ("--local-epochs", "0"), ("--join-ratio", "0"),
         ("--join-ratio", "1.5"), ("--lr", "0"), ("--batch-size", "0"), ("--seed", "-1"), ("--lam", "-1"),
         ("--mu", "-1"), ("--tau", "0"), ("--lr", "nan"), ("--clients", "three")]
CASES = [(["train"], flag, value) for flag, value in TRAIN] + [
    (["attack", "idlg"], flag, value) for flag, value in
    [("--targets", "0"), ("--iterations", "0"), ("--restarts", "0"), ("--images", "0"), ("--victim-batch", "-1"),
     ("--victim-steps", "0"), ("--attack-seed", "-1"), ("--s", "-5")]] + [
    (["audit"], "--evidence-iterations", "0"),
    (["report", "--methods", "fedavg", "--attacks", "idlg"], "--targets", "0"),
    (["defend", "--defense", "noise", "--values", "0.1"], "--victim-steps", "0"),
    (["defend", "--defense", "noise", "--values", "0.1"], "--max-grad-norm", "0"),
    (["defend", "--defense", "noise", "--values", "0.1"], "--delta", "1"),
    (["mia", "--method", "fedavg"], "--gamma", "0"),
    (["mia", "--method", "fedavg"], "--exposed", "-1"),
]


@pytest.mark.parametrize("command,flag,value", CASES)
def test_a_numeric_option_out_of_range_is_one_line_exit_2_nothing_written(tmp_path, capsys, command, flag, value):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main([*command, *SMALL, flag, value, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {flag} ") and ("must be" in err[0] or "expects" in err[0]), err
    assert not out.exists()


def test_an_unknown_flag_is_one_line_with_the_help_to_read(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["attack", "dlg", "--targts", "3"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and line.startswith("error: ") and "--targts" in line and "fedsec attack --help" in line
