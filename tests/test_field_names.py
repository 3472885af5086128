"""The engine names its own fields; fedsec names them for its user (``fedsec.field_names``): the
command line by their flags, the Python API by their keywords. No flag is spelt inside ``fedecouple``."""
from __future__ import annotations

import ast
import io
import pickle
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

import fedsec
from fedecouple.data import make_partition
from fedecouple.errors import UserError
from fedecouple.methods import METHODS
from fedecouple.methods.base import hyperparameter_names
from fedsec import field_names
from fedsec.commands import command_of

ENGINE = Path(__file__).resolve().parents[1] / "fedecouple"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _engine_error(**kwargs) -> UserError:
    with pytest.raises(UserError) as raised:
        make_partition(np.repeat(np.arange(10), 20), **kwargs)
    return raised.value


def test_an_engine_error_names_the_flag_on_the_command_line_and_the_keyword_in_python():
    exc = _engine_error(num_clients=4, scheme="pathological", classes_per_client=11)
    assert str(exc) == "classes_per_client must be in [1, 10] for this data set, got 11"
    assert exc.fields == ("classes_per_client",)
    assert field_names.for_cli(exc) == "--classes-per-client must be in [1, 10] for this data set, got 11"
    assert str(field_names.for_api(exc)) == str(exc)  # the keyword is the field's name here
    exc = _engine_error(num_clients=4, scheme="weak", samples_per_client=8, train_images=9)
    assert field_names.for_cli(exc).startswith("--train-images 9: client ")
    assert field_names.for_cli(exc).endswith("lower --train-images or raise --samples-per-client "
                                             "(train + test per client)")
    exc = _engine_error(num_clients=0, scheme="iid")
    assert field_names.for_cli(exc) == "--clients must be at least 1, got 0"
    assert str(field_names.for_api(exc)) == "clients must be at least 1, got 0"


def test_a_field_is_renamed_only_where_the_message_means_it():
    exc = UserError("model 'pkg.model:make': cannot load it (No module named 'model'); see /data/model/x, "
                    "s must be set; GPU(s) and the model's s", fields=("model", "s"))
    assert field_names.for_cli(exc) == ("--model 'pkg.model:make': cannot load it (No module named 'model'); "
                                        "see /data/model/x, --uniform-share must be set; GPU(s) and the "
                                        "model's --uniform-share")
    hp = UserError("head_lr must be > 0, got 0.0; pass e.g. head_lr=0.1", fields=("head_lr",))
    assert field_names.for_cli(hp) == "--hp head_lr must be > 0, got 0.0; pass e.g. --hp head_lr=0.1"
    assert str(field_names.for_api(hp)) == str(hp)
    plain = UserError("rounds must be >= 0")  # names no field: shown as raised
    assert field_names.for_cli(plain) == "rounds must be >= 0" and field_names.for_api(plain) is plain


def test_the_fields_survive_pickling():
    """A Ray task's error reaches the driver pickled."""
    exc = pickle.loads(pickle.dumps(UserError("lower lr", fields=("lr",))))
    assert exc.fields == ("lr",) and field_names.for_cli(exc) == "lower --lr"


def test_the_command_line_and_the_api_translate_an_engine_error(tmp_path, capsys, monkeypatch):
    from fedsec.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", "--dataset", "digits", "--clients", "3", "--rounds", "1", "--classes-per-client", "11",
              "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and err == ["error: --classes-per-client must be in [1, 10] for this data set, "
                                              "got 11"], err
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as raised:
        fedsec.train(dataset="digits", clients=2000, rounds=1, threads=1, progress=False)
    assert str(raised.value) == "clients 2000 exceeds the 1797 samples of the data set"


# ------------------------------------------------------------------------------------------------
# every field the engine names has a flag; no flag is spelt inside the engine


def _names_in(node: ast.AST) -> set[str]:
    """The names in the tuples (lists, sets) of ``node``, or ``node`` itself where it is a name."""
    items = [node, *(item for n in ast.walk(node) if isinstance(n, (ast.Tuple, ast.List, ast.Set))
                     for item in n.elts)]
    return {n.value for n in items
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()}


def _fields_named(tree: ast.AST) -> set[str]:
    """The names in every ``fields=`` of ``tree``: literal ones, and those of a variable the enclosing
    function assigns or takes as a parameter with a default."""
    found = set()
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        assigned: dict[str, set[str]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            assigned.setdefault(name.id, set()).update(_names_in(node.value))
        arguments = function.args
        positional = arguments.posonlyargs + arguments.args
        for arg, default in [*zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults),
                             *zip(arguments.kwonlyargs, arguments.kw_defaults)]:
            if default is not None:
                assigned.setdefault(arg.arg, set()).update(_names_in(default))
        for call in [n for n in ast.walk(function) if isinstance(n, ast.Call)]:
            for keyword in call.keywords:
                if keyword.arg == "fields":
                    found |= _names_in(keyword.value)
                    for name in ast.walk(keyword.value):
                        if isinstance(name, ast.Name):
                            found |= assigned.get(name.id, set())
    return found


def test_every_field_the_engine_names_has_a_flag():
    named = set()
    for path in sorted(ENGINE.rglob("*.py")):
        named |= _fields_named(ast.parse(path.read_text(encoding="utf-8")))
    assert {"rounds", "num_clients", "train_images", "samples_per_client", "device", "download", "lr",
            "head_lr", "threads", "model"} <= named  # the scan finds them
    assert sorted(named - set(field_names.FLAGS)) == []


def test_every_flag_of_the_table_is_a_train_flag_and_its_keyword_the_apis():
    params = {opt: p.name for p in command_of("train").params for opt in getattr(p, "opts", ())}
    hyperparameters = {name for cls in METHODS.values() for name in hyperparameter_names(cls)}
    for field, spelling in field_names.FLAGS.items():
        flags = FLAG.findall(spelling)
        assert flags and set(flags) <= set(params), (field, spelling)
        if spelling.startswith("--hp "):
            assert field_names.keyword(field) == spelling[5:] in hyperparameters, field
        else:  # each flag as the API's keyword: the train command's parameter it sets
            assert field_names.keyword(field) == FLAG.sub(lambda m: params[m.group(0)], spelling), field


def test_no_string_or_comment_in_the_engine_spells_a_flag():
    """The engine is a library: its errors, docstrings and comments name its own fields and parameters."""
    found = []
    for path in sorted(ENGINE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ENGINE.parent)
        for node in ast.walk(ast.parse(text)):  # docstrings and f-strings' constant parts are constants too
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and FLAG.search(node.value):
                found.append(f"{where}:{node.lineno} {FLAG.search(node.value).group(0)}")
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT and FLAG.search(token.string):
                found.append(f"{where}:{token.start[0]} {FLAG.search(token.string).group(0)}")
    assert found == []
