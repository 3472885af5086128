"""Adding an attack is one file plus a registry line: a toy attack registered from a test-local file
appears in every place that lists attacks, with no other edit."""
from __future__ import annotations

import pandas as pd
import pytest

import toy_attack
from fedsec.cli import main
from helpers import TEST_THREADS


@pytest.fixture
def toy():
    spec = toy_attack.install()
    yield spec
    toy_attack.uninstall()


def _help(args, capsys, options_only: bool = False) -> str:
    main([*args, "--help"])
    out = capsys.readouterr().out
    return out.split("Options:", 1)[1] if options_only else out


def test_the_toy_attack_is_a_cli_choice_and_in_defends_choices(toy, capsys):
    # click wraps long lines at spaces and hyphens: look at the choices with the whitespace taken out
    assert "toy" in "".join(_help(["attack"], capsys).split("{", 1)[1].split("}", 1)[0].split())
    assert "toy" in _help(["defend"], capsys, True).split("--attacks", 1)[1].split("--baseline", 1)[0]
    assert "toy" in _help(["report"], capsys, True).split("--attacks", 1)[1].split("--attack-rounds", 1)[0]


def test_without_registration_it_is_unknown(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["attack", "toy", "--dataset", "digits", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "toy" in capsys.readouterr().err


def test_the_toy_attack_runs_in_the_report_as_a_stage_with_its_columns(toy, tmp_path):
    from fedsec.jobs import report as rep
    from fedsec.runner import RunConfig

    base = RunConfig.of(dataset="digits", clients=3, rounds=1, threads=TEST_THREADS)
    out = tmp_path / "r"
    result = rep.build_report(base, ["fedavg", "fedproto"], out, attacks=["toy"], progress=False,
                              settings=rep.ReportSettings(targets=1))
    stages = {(r["method"], r["stage"]): r["status"] for r in result["stages"]}
    assert stages[("fedavg", "attack-toy")] == "done"
    assert stages[("fedproto", "attack-toy")] == "not applicable"  # applies_to: model weights
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert summary.loc["fedavg", "toy_status"] == "done" and summary.loc["fedavg", "toy_mean_psnr"] > 0
    assert "toy PSNR" in (out / "report.md").read_text(encoding="utf-8")


def test_the_toy_attack_runs_in_defend(toy, tmp_path):
    from fedsec.jobs.defend import DefendSettings, defend
    from fedsec.runner import RunConfig

    config = RunConfig.of(method="fedavg", dataset="digits", clients=2, rounds=1, threads=TEST_THREADS)
    frame = defend(config, DefendSettings(defense="clip", values="1", attacks="toy", targets=1), tmp_path / "d",
                   progress=False)
    assert frame["mean_psnr_toy"].notna().all()
