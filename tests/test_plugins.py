"""A method, a data set, a defense and an attack are each one file plus one declaration line: the toys of
``tests/toys/`` (``toy_method.py``, ``toy_dataset.py``, ``toy_defense.py``, ``toy_attack.py``), declared by
``declare_toys`` below, are choices of the command line's help, run end to end (train, report, defend,
attack) and enter the report's tables and the time estimate, with no other edit anywhere."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from helpers import TEST_THREADS, run_python

TESTS = Path(__file__).resolve().parent
ROUND_SECONDS = 5.0  # the toy method's declared training rate, which the estimate must show
# a tiny federation of the toy method on the toy data set: 2 clients, 1 round
TINY = ["--method", "toy", "--dataset", "toy", "--partition", "iid", "--clients", "2", "--rounds", "1",
        "--threads", str(TEST_THREADS)]


def declare_toys() -> None:
    """One line per toy: the whole of what adding it takes beside its file."""
    import attacks
    import defenses
    from fedecouple.data import DATASETS
    from fedecouple.methods import METHODS

    METHODS.declare("toy", "toys.toy_method:ToyAvg", summary="FedAvg with a plain mean", round_seconds=ROUND_SECONDS)
    DATASETS.declare("toy", "toys.toy_dataset:load_toy", embedded=True, summary="80 8x8 bars, 4 classes")
    defenses.DEFENSES.declare("toy", "toys.toy_defense:SHRINK", summary="each upload's update shrunk by a factor")
    attacks.declare("toy", "toys.toy_attack:SPEC", "a grey guess", "image", default_iterations=1)


def remove_toys() -> None:
    import attacks
    import defenses
    from fedecouple.data import DATASETS
    from fedecouple.methods import METHODS

    for registry in (METHODS, DATASETS, defenses.DEFENSES, attacks.ATTACKS):
        registry.remove("toy")


@pytest.fixture
def toys():
    declare_toys()
    yield
    remove_toys()


def _flat(text: str) -> str:
    """``text`` without whitespace: click wraps a long help line at spaces and hyphens."""
    return "".join(text.split())


def _option(help_text: str, option: str) -> str:
    """The help of ``option`` (up to the next option), whitespace removed."""
    return _flat(re.split(r"\n\s+--", help_text.split(f"  {option} ", 1)[1], maxsplit=1)[0])


def test_each_toy_is_a_choice_of_a_command_line_built_after_it(tmp_path):
    """In a fresh interpreter (the command line's choices are built when ``fedsec.commands`` is imported):
    declare the toys, build the help, then sweep the toy defense against the toy attack through
    ``fedsec defend``, a ``--defense`` choice like any other."""
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}]\n"
            "from test_plugins import TINY, declare_toys; declare_toys()\n"
            "from fedsec.cli import main\n"
            "for args in (['train'], ['defend'], ['attack']):\n"
            "    print('=' * 8, args[0]); main([*args, '--help'])\n"
            f"main(['defend', *TINY, '--defense', 'toy', '--values', '0,1', '--attacks', 'toy', '--targets', '1',"
            f" '--out', {str(tmp_path / 'd')!r}])\n")
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr
    helps = dict(part.split("\n", 1) for part in result.stdout.split("=" * 8 + " ")[1:])
    assert _option(helps["train"], "--method").endswith(",local,toy.[default:fedecouple]")
    dataset = _option(helps["train"], "--dataset")
    assert ",cinic10,toy." in dataset and "toyareembedded" in dataset
    assert _option(helps["defend"], "--defense").startswith("[dp|noise|clip|prune|quantize|exclude|download-check|"
                                                            "consistency-check|toy]")
    assert "toyagreyguess" in _flat(helps["attack"])  # the attack's list: name and summary
    frame = pd.read_csv(tmp_path / "d" / "tradeoff.csv")
    assert list(frame["defense"]) == ["none", "toy", "toy"] and list(frame["value"]) == ["none", "0.0", "1.0"]
    assert frame["mean_psnr_toy"].notna().all()
    # a factor of 1 leaves every update as it was: the baseline's accuracy, exactly
    assert frame["accuracy"].iloc[2] == frame["accuracy"].iloc[0]


def test_the_toy_method_trains_on_the_toy_data_set(toys, tmp_path, capsys):
    from fedsec.cli import main

    main(["train", *TINY, "--out", str(tmp_path / "t")])
    summary = json.loads((tmp_path / "t" / "summary.json").read_text(encoding="utf-8"))
    assert summary["method"] == "toy" and summary["dataset"] == "toy"
    assert "toy on toy" in capsys.readouterr().out


def test_the_toy_attack_attacks_the_toy_method(toys, tmp_path, capsys):
    from fedsec.cli import main

    main(["attack", "toy", *TINY, "--targets", "1", "--out", str(tmp_path / "a")])
    assert "estimated time: " in capsys.readouterr().err  # fedsec.estimate's, printed before the run
    frame = pd.read_csv(tmp_path / "a" / "attack.csv")
    assert set(frame["attack"]) == {"toy"} and frame["psnr"].notna().all()


def test_the_toys_run_in_a_report_with_their_columns_and_estimate(toys, tmp_path):
    from fedsec import estimate, runner
    from fedsec.cli import main

    out = tmp_path / "r"
    main(["report", *TINY[2:], "--methods", "toy,fedavg", "--attacks", "toy", "--targets", "1", "--out", str(out)])
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert list(summary.index) == ["toy", "fedavg"] and summary.loc["toy", "toy_status"] == "done"
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "# Privacy comparison: toy, fedavg on toy" in report and "toy PSNR" in report
    # the stage table: each computed stage's estimate beside its wall time, the toy's from its declared rate
    rows = ([c.strip() for c in row.strip().strip("|").split("|")] for row in report.splitlines())
    stages = {(cells[0], cells[1]): cells for cells in rows if len(cells) == 6 and cells[-1] == "computed"}
    prep = runner.prepare(runner.RunConfig.of(method="toy", dataset="toy", partition="iid", clients=2, rounds=1))
    work = estimate.StageWork("toy", 2, 1, estimate.training_images(prep))
    assert estimate.round_seconds("toy") == ROUND_SECONDS
    assert float(stages[("toy", "train")][4]) == round(estimate.seconds(work), 1) > 0
