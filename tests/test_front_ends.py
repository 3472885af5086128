"""The command line and the Python API are two front ends of one request: the same settings write the same
files, byte for byte, and a bad value is the same one-line message (the flag's; a keyword names no flag of
its own). The API makes no click context: its keywords are converted by the flags' types."""
from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import pytest

import fedsec
from fedecouple.errors import UserError
from helpers import run_cli

TINY = ["--dataset", "digits", "--clients", "4", "--rounds", "1", "--threads", "1"]

# (command, arguments): the main job's command shrunk to seconds, and five other commands
COMMANDS = [
    ("attack", ["dlg", "--method", "fedecouple", "--targets", "2", "--iterations", "8"]),
    ("train", ["--method", "fedper"]),
    ("audit", ["--method", "fedpac", "--no-evidence"]),
    ("defend", ["--method", "fedavg", "--defense", "clip", "--values", "1", "--attacks", "labels", "--targets", "1"]),
    ("report", ["--methods", "fedavg,fedproto", "--attacks", "labels", "--targets", "1"]),
    ("compare", ["--methods", "fedavg,local"]),
]


def _keywords(arguments: list[str]) -> tuple[list, dict]:
    """(positionals, keywords) of a command line's arguments."""
    positionals, keywords, i = [], {}, 0
    while i < len(arguments):
        token = arguments[i]
        if not token.startswith("--"):
            positionals.append(token)
            i += 1
        elif token.startswith("--no-"):
            keywords[token[5:].replace("-", "_")] = False
            i += 1
        else:
            keywords[token[2:].replace("-", "_")] = arguments[i + 1]
            i += 2
    return positionals, keywords


# columns that time a run: two runs of anything differ there
TIMING = ("seconds",)


def _files(folder: Path) -> dict[str, bytes]:
    """Every CSV below ``folder``: its bytes, or where it has a timing column, its rows without it."""
    files = {}
    for path in sorted(folder.rglob("*.csv")):
        data = path.read_bytes()
        rows = list(csv.reader(io.StringIO(data.decode())))
        timing = [i for i, name in enumerate(rows[0] if rows else []) if name in TIMING]
        if timing:
            data = repr([[cell for i, cell in enumerate(row) if i not in timing] for row in rows]).encode()
        files[str(path.relative_to(folder))] = data
    return files


@pytest.mark.parametrize("command,arguments", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_the_api_writes_the_clis_csvs_byte_for_byte(tmp_path, capsys, command, arguments):
    code, _, err = run_cli([command, *arguments, *TINY, "--out", tmp_path / "cli"], capsys)
    assert code == 0, err
    positionals, keywords = _keywords([*arguments, *TINY])
    getattr(fedsec, command)(*positionals, **keywords, out=tmp_path / "api", progress=False)
    cli, api = _files(tmp_path / "cli"), _files(tmp_path / "api")
    assert cli and list(cli) == list(api)
    for name in cli:
        assert cli[name] == api[name], name


BAD = [
    ("--targets", "0"), ("--partition", "bogus"), ("--method", "fedfoo"), ("--iterations", "-3"),
    ("--dataset", "cifar10"), ("--device", "tpu"), ("--lr", "nan"),
]


@pytest.mark.parametrize("flag,value", BAD, ids=[f for f, _ in BAD])
def test_a_bad_keyword_is_the_bad_flags_one_line_message(tmp_path, capsys, flag, value):
    code, _, err = run_cli(["attack", "dlg", *TINY, flag, value, "--out", tmp_path / "cli"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    line = re.sub(r" \(see 'fedsec attack --help'\)$", "", err.strip()[len("error: "):])
    keyword = flag[2:].replace("-", "_")
    with pytest.raises(UserError) as raised:
        fedsec.attack("dlg", **{**_keywords(TINY)[1], keyword: value}, progress=False)
    # the flag's own message; where the engine named a field, each side names it as its user spells it
    as_keywords = re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), line)
    assert str(raised.value) in (line, as_keywords)
    assert not (tmp_path / "cli").exists()


def test_the_api_makes_no_click_context(monkeypatch):
    import click

    def refuse(*_, **__):
        raise AssertionError("a click context was made")

    monkeypatch.setattr(click.Context, "__init__", refuse)
    result = fedsec.train(method="fedavg", dataset="digits", clients=2, rounds=1, threads=1, progress=False)
    assert result.rounds == 1


def test_keywords_in_a_config_file_count_as_given(tmp_path):
    """A file's settings are defaults the keywords override, and count as given (a preset keeps them)."""
    from fedsec.keywords import request

    (tmp_path / "c.toml").write_text('command = "train"\nclients = 3\nrounds = 2\n')
    got = request("train", {"config": tmp_path / "c.toml", "rounds": 1})
    assert got.params["clients"] == 3 and got.params["rounds"] == 1 and got.params["device"] == "cpu"
    assert got.explicit("clients") and got.explicit("rounds") and not got.explicit("lr")
    with pytest.raises(UserError, match="has no keyword roundz"):
        request("train", {"roundz": 1})


# each command with the least it requires
REQUIRED = {"attack": {"attack": "dlg"}, "train": {}, "audit": {}, "report": {}, "compare": {}, "mia": {},
            "defend": {"defense": "clip", "values": "1"}}


@pytest.mark.parametrize("command", REQUIRED)
def test_keywords_left_out_take_the_flags_defaults(command):
    """Every setting a keyword leaves out has the value the command line gives the flag left out (a flag
    without a default is off, not None: a run's config.toml and folder identity are the same)."""
    from fedsec.commands import command_of
    from fedsec.invocation import Request
    from fedsec.keywords import request

    arguments = [a for k, v in REQUIRED[command].items() for a in ([v] if k == "attack" else [f"--{k}", v])]
    parsed = Request.of_click(command_of(command).make_context(f"fedsec {command}", arguments))
    given = request(command, REQUIRED[command])
    assert dict(given.params) == dict(parsed.params)
    assert given.order == parsed.order and given.given == parsed.given
