"""``fedsec flower attack`` and ``fedsec flower audit`` on the shipped Flower example, with each of its
two strategies, for every registered attack (``test_matrix.py`` holds the other entry points): each
cell ends in a result or a one-line refusal, never a traceback. The example's own audit runs end to end
with its evidence attacks, as the README shows it (a smaller federation and budget). Flower's
simulations are reused between cells that ask for the same run (``reused_simulations``), so each
distinct simulation runs once, all on one Ray instance (``shared_ray``). The audits run
first and for one round, as the attacks that train the app unchanged do: those attacks then read a
recorded round of the audit's simulation.
"""
import json
import os
from pathlib import Path

import pytest

import attacks
from helpers import assert_attack_result, assert_refused, declared_refusal, run_cli
from test_matrix import ATTACKS, BUDGET

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_mnist"
STRATEGIES = {"fedavg": "fedavg", "fedper": "fedper"}  # the example's strategy → the method it declares


@pytest.fixture(scope="module")
def flower_simulations(shared_ray):
    """Flower and Ray present (the test extra has them); each distinct simulation of this module runs once."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    pytest.importorskip("flwr", reason="Flower is not installed: pip install -e '.[flower]'")
    pytest.importorskip("ray", reason="Flower's simulation engine needs Ray: pip install -e '.[flower]'")
    from fedsec.flower.simulation import reused_simulations

    with reused_simulations():
        yield


FLOWER = ["--nodes", "2", "--ray-cpus", "1"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flower_audit(strategy, flower_simulations, tmp_path, capsys):
    out = tmp_path / "audit"
    code, _, err = run_cli(["flower", "audit", EXAMPLE, *FLOWER, "--rounds", "1", "--evidence-iterations", "1",
                         "--run-config", f"strategy='{strategy}'", "--out", out], capsys)
    assert code == 0, err[-2000:]
    findings = json.loads((out / "findings.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == STRATEGIES[strategy]
    assert any(f["code"] == "MODEL_DISCLOSED" for f in findings)
    assert "gradient" in summary["evidence"] and "trap" not in json.dumps(summary["evidence"])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("attack", ATTACKS)
def test_flower_attack(attack, strategy, flower_simulations, tmp_path, capsys):
    out = tmp_path / "attack"
    code, _, err = run_cli(["flower", "attack", attack, EXAMPLE, *FLOWER, *BUDGET, "--run-config",
                         f"strategy='{strategy}'", "--out", out], capsys)
    method = STRATEGIES[strategy]
    if declared_refusal(attack, method) is not None or attacks.get(attack).malicious or code == 2:
        assert_refused(code, err, attack, method)
        return
    assert code == 0, err[-2000:]
    assert_attack_result(json.loads((out / "summary.json").read_text()), attack, method)
