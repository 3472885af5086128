"""Adding a malicious-server attack is one file that registers it: a toy one (``toy_malicious_attack``:
an open row of the first linear layer, read back as ΔW_0 / Δb_0) is a CLI choice, gets the report's
malicious-server stages, the estimate's rate, the terminal's lines and ``defend``'s columns, and its
readout recovers each attacked client's input exactly, with no other edit.

The smallest federation: the 8×8 ``digits`` data set, 3 clients of one training image, 1 round.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest

import toy_malicious_attack as toy
from attacks.metrics import SUCCESS_MARGIN_DB
from fedecouple.errors import UserError
from fedsec.cli import main
from fedsec.runner import RunConfig
from helpers import TEST_THREADS

NAME = toy.NAME


@pytest.fixture
def toy_spec():
    spec = toy.install()
    yield spec
    toy.uninstall()


def _help(args, capsys) -> str:
    main([*args, "--help"])
    return capsys.readouterr().out


def test_the_toy_is_a_choice_of_attack_report_and_defend(toy_spec, capsys):
    # click wraps long lines at spaces and hyphens: compare with the whitespace taken out
    assert NAME in "".join(_help(["attack"], capsys).split("{", 1)[1].split("}", 1)[0].split())
    for command, after in (("defend", "--baseline"), ("report", "--attack-rounds")):
        options = _help([command], capsys).split("Options:", 1)[1]
        assert NAME in "".join(options.split("--attacks", 1)[1].split(after, 1)[0].split()), command


def test_the_report_gives_it_the_malicious_stages_and_its_readout_recovers_every_input(toy_spec, tmp_path):
    from fedsec import console
    from fedsec.jobs import report as rep

    base = RunConfig.of(dataset="digits", clients=3, rounds=1, train_images=1, threads=TEST_THREADS)
    settings = rep.ReportSettings(targets=2, malicious_sizes=(1,))
    result = rep.build_report(base, ["fedavg"], tmp_path, attacks=[NAME], progress=False, settings=settings)
    stages = {r["stage"]: r["status"] for r in result["stages"]}
    assert stages[f"attack-{NAME}@n1"] == stages[f"attack-{NAME}@n1+check"] == "done"
    assert not any(NAME in k for k in settings.keys([NAME]))  # a section, not a headline cell
    stage = tmp_path / "fedavg" / f"attack-{NAME}@n1"
    rows = pd.read_csv(stage / "attack.csv")
    assert len(rows) == 2 and "bias_update" in rows  # one image per client; the toy's extra column
    assert (rows["input_error"] <= 1e-3).all()  # the open row's input, exactly
    assert (rows["psnr"] >= rows["prior_psnr"] + SUCCESS_MARGIN_DB).all()  # and the image rebuilt from it
    summary = json.loads((stage / "summary.json").read_text(encoding="utf-8"))
    assert summary["inputs_exact_share"] == 1.0 and summary["settings"]["craft"] == toy.CRAFT
    assert "  open row: input recovered exactly for 100% of the images" in console.attack_lines(summary, stage)
    section = pd.read_csv(tmp_path / "malicious.csv").set_index("download_check")
    assert section.loc["off", "attack"] == NAME and section.loc["off", "recovered"] == 2
    assert section.loc["on", "crafted_downloads"] == section.loc["on", "crafted_refused"] == 2


def test_a_method_the_open_row_cannot_reach_is_refused_before_training(toy_spec):
    from fedsec.jobs.attack import AttackSettings, check_applicable
    from fedsec.runner import prepare

    config = RunConfig.of(method="fedproto", dataset="digits", clients=3, rounds=1, threads=TEST_THREADS)
    with pytest.raises(UserError, match="fedproto trains nothing the server sends"):
        check_applicable(AttackSettings(attack=NAME).spec, prepare(config))


def test_the_estimate_times_it_by_the_rate_it_declares(toy_spec):
    from fedsec import estimate
    from fedsec.jobs.attack import AttackSettings

    settings = AttackSettings(attack=NAME, targets=2).resolved(0, 1)
    work = estimate.attack_work("fedavg", 3, 1.0, settings, 0)
    per_target = estimate.TARGET_SECONDS + estimate.TARGET_SECONDS_PER_IMAGE + 50 * toy.STEP_SECONDS
    assert estimate.seconds(work) == pytest.approx(2 * per_target)


def test_defend_runs_it_and_the_download_check_refuses_it(toy_spec, tmp_path):
    from fedsec.jobs.defend import DefendSettings, defend

    config = RunConfig.of(method="fedavg", dataset="digits", clients=3, rounds=1, train_images=1,
                          threads=TEST_THREADS)
    frame = defend(config, DefendSettings(defense="download-check", values="on", attacks=NAME, targets=1),
                   tmp_path, progress=False).set_index("value")
    assert frame.loc["none", f"mean_psnr_{NAME}"] >= frame.loc["none", f"prior_psnr_{NAME}"] + SUCCESS_MARGIN_DB
    assert frame.loc["on", f"detection_rate_{NAME}"] == 1.0
