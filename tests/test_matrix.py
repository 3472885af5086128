"""Every registered attack on every method, through every entry point that takes it, at the smallest
budget (the digits data set, 2 clients of 10 images, one target, one optimiser step): each cell ends in
a result or in a one-line refusal (exit status 2) saying why the attack does not apply; never in a
traceback. Where an attack's spec declares it does not apply to a method's uploads, the cell must be
that refusal.

Entry points: ``fedsec attack`` (each cell its own run), ``fedsec report`` (one report over every
method and attack; each stage done or "not applicable" with its reason), ``fedsec defend`` (per method,
one sweep of one value over every attack that applies, and each declared refusal on its own) and ``fedsec audit`` (per method: it picks its evidence attacks itself);
``fedsec flower attack`` and ``fedsec flower audit`` in ``test_matrix_flower.py``.
"""
import json
import re

import pytest

import attacks
from fedecouple.methods import METHODS
from fedsec.cli import main
from helpers import assert_attack_result, assert_refused, declared_refusal, run_cli

ATTACKS = list(attacks.ATTACKS)  # as registered on import (a toy attack another test adds is not here)
METHOD_NAMES = list(METHODS)
TINY = ["--dataset", "digits", "--clients", "2", "--rounds", "2", "--train-images", "10", "--threads", "1"]
BUDGET = ["--targets", "1", "--iterations", "1"]


# -- fedsec attack ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("attack", ATTACKS)
def test_attack(attack, method, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["attack", attack, "--method", method, *TINY, *BUDGET, "--restarts", "1", "--out", out],
                        capsys)
    if declared_refusal(attack, method) is not None or code == 2:
        assert_refused(code, err, attack, method)
        return
    assert code == 0, err[-2000:]
    assert_attack_result(json.loads((out / "summary.json").read_text()), attack, method)
    assert (out / "attack.csv").exists()


# -- fedsec report ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix") / "report"
    try:
        main(["report", "--methods", ",".join(METHOD_NAMES), "--attacks", ",".join(ATTACKS), *TINY, *BUDGET,
              "--malicious-sizes", "10", "--out", str(out)])
    except SystemExit as exc:
        pytest.fail(f"fedsec report exited with {exc.code}")
    return out


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_report(report_dir, method):
    """Each attack stage of each method is done or not applicable with its reason; the declared
    refusals are exactly the spec's."""
    assert (report_dir / "summary.csv").exists() and (report_dir / "report.md").exists()
    for attack in ATTACKS:
        stages = sorted((report_dir / method).glob(f"attack-{attack}")) + \
            sorted((report_dir / method).glob(f"attack-{attack}@*"))
        assert stages, f"{method}: no stage for {attack}"
        declared = declared_refusal(attack, method)
        for stage in stages:
            done = json.loads((stage / "done.json").read_text())
            assert done["status"] in ("done", "not_applicable"), done
            if declared is not None:
                assert done["status"] == "not_applicable" and method in done["reason"], done
            if done["status"] == "not_applicable":
                assert done["reason"] and "\n" not in done["reason"], done


# -- fedsec defend ------------------------------------------------------------------------------------
# One sweep per method carries every attack its uploads admit (a defend run attacks each in turn, on one
# defended training); each attack the spec declares refused is its own cell and must be refused before
# anything trains, as must one the sweep's own checks refuse (the error names it; the rest run again).
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_defend(method, tmp_path, capsys):
    applicable = [a for a in ATTACKS if declared_refusal(a, method) is None]
    for attack in sorted(set(ATTACKS) - set(applicable)):
        code, _, err = run_cli(["defend", "--method", method, "--defense", "clip", "--values", "1", "--no-baseline",
                                "--attacks", attack, *TINY, *BUDGET, "--out", tmp_path / attack], capsys)
        assert_refused(code, err, attack, method)
        assert not (tmp_path / attack).exists()
    out = tmp_path / "sweep"
    while applicable:  # a refusal found before training (a check beyond the spec's) names its attack or the method
        code, _, err = run_cli(["defend", "--method", method, "--defense", "clip", "--values", "1", "--no-baseline",
                                "--attacks", ",".join(applicable), *TINY, *BUDGET, "--out", out], capsys)
        if code == 0:
            break
        refused = [a for a in applicable if re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])", err.split("error:")[-1])] \
            or applicable
        assert_refused(code, err, refused[0], method)
        assert not out.exists()
        applicable = [a for a in applicable if a not in refused]
    if not applicable:
        return
    assert (out / "tradeoff.csv").exists()
    (value,) = [d for d in out.iterdir() if d.is_dir()]
    summaries = [json.loads(p.read_text()) for p in value.rglob("summary.json")]
    for attack in applicable:
        attacked = [s for s in summaries if s.get("attack") == attack]
        assert attacked, f"no {attack} summary under {value}"
        assert_attack_result(attacked[0], attack, method)


# -- fedsec audit -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_audit(method, tmp_path, capsys):
    out = tmp_path / "audit"
    code, _, err = run_cli(["audit", "--method", method, *TINY, "--evidence-iterations", "1", "--out", out], capsys)
    assert code == 0, err[-2000:]
    findings = json.loads((out / "findings.json").read_text())
    assert any(f["code"] == "COMMUNICATION" for f in findings)
    for kind, evidence in json.loads((out / "summary.json").read_text())["evidence"].items():
        assert evidence.get("not_applicable") or evidence.get("attack"), (kind, evidence)


# -- an attack that finds only once it runs that a target has nothing to attack -------------------------
@pytest.fixture
def refusing_attack():
    """A registered attack whose every target answers ``NotApplicable`` at run time (as the malicious
    attacks do on a client that got no crafted download)."""
    from attacks.base import NotApplicable
    from attacks.registry import WEIGHT_KINDS, ClientAttackSpec, register, unregister

    def refuse(observation, budget, seed):
        raise NotApplicable("this client's upload holds nothing for it")

    register(ClientAttackSpec("refusing", attack_one=refuse, default_victim_batch=1, applies_to=WEIGHT_KINDS,
                              scoring="images", needs="model weights"),
             summary="refuses every target (test only)", kind="image", default_iterations=1)
    yield "refusing"
    unregister("refusing")


def test_an_attack_not_applicable_at_run_time_is_a_line_not_a_traceback(refusing_attack, tmp_path, capsys):
    out = tmp_path / "run"
    code, printed, _ = run_cli(["attack", refusing_attack, "--method", "fedavg", *TINY, *BUDGET, "--out", out],
                               capsys)
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0
    assert "refusing on fedavg: not applicable (this client's upload holds nothing for it)" in printed
    assert summary["not_applicable"] == "this client's upload holds nothing for it"
    assert summary["images_scored"] == 0 and (out / "attack.csv").read_text().count("\n") == 1  # the header only


def test_the_report_marks_a_run_time_refusal_not_applicable(refusing_attack, tmp_path):
    out = tmp_path / "report"
    main(["report", "--methods", "fedavg", "--attacks", refusing_attack, *TINY, *BUDGET, "--out", str(out)])
    done = json.loads((out / "fedavg" / f"attack-{refusing_attack}" / "done.json").read_text())
    assert done["status"] == "not_applicable" and done["reason"] == "this client's upload holds nothing for it"
