"""Config files: every command takes --config FILE (flags override it) and every run writes the fully
resolved config.toml it ran with; a run repeated from its config.toml gives the same attack.csv."""
from __future__ import annotations

import pytest

from fedsec.cli import main

TINY = ["--dataset", "digits", "--method", "fedavg", "--clients", "4", "--rounds", "1", "--targets", "2",
        "--iterations", "5", "--threads", "1"]


def test_an_attack_repeated_from_its_config_toml_gives_the_same_csv_byte_for_byte(tmp_path):
    main(["attack", "dlg", *TINY, "--out", str(tmp_path / "first")])
    config = tmp_path / "first" / "config.toml"
    text = config.read_text()
    assert 'command = "attack"' in text and 'attack = "dlg"' in text and "iterations = 5" in text
    assert "restarts = 1" in text and "victim-batch = 1" in text  # resolved: the attack's defaults filled in
    main(["attack", "--config", str(config), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "attack.csv").read_bytes() == (tmp_path / "first" / "attack.csv").read_bytes()
    assert (tmp_path / "again" / "config.toml").read_text() == text


def test_flags_override_the_file_and_the_file_overrides_the_defaults(tmp_path):
    import fedsec

    config = tmp_path / "c.toml"
    config.write_text('command = "train"\ndataset = "digits"\nclients = 3\nrounds = 1\nbatch-size = 5\n')
    result = fedsec.train(config=str(config), clients=4, progress=False)
    assert result.rows["client"].nunique() == 4 and result.rounds == 1
    main(["train", "--config", str(config), "--clients", "5", "--out", str(tmp_path / "run")])
    written = (tmp_path / "run" / "config.toml").read_text()
    assert "clients = 5" in written and "batch-size = 5" in written and "rounds = 1" in written


@pytest.mark.parametrize("text,fragment", [
    ('command = "attack"\n', "holds settings of `fedsec attack`, not `fedsec train`"),
    ('clients = 3\nbogus = 1\n', "has no setting bogus"),
    ('clients = [\n', "not valid TOML"),
    ('clients = 0\n', "--clients must be at least 1"),
])
def test_a_bad_config_file_is_one_line_exit_2_nothing_written(tmp_path, capsys, text, fragment):
    config = tmp_path / "c.toml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", str(config), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "run").exists()
