"""One meaning per flag: an option name has one form, one default and one help on every command that
takes it, except the differences ``fedsec.options.DIFFERING`` declares (each with its reason); options a
command refuses are not in its help; deprecated spellings keep working, with a warning."""
from __future__ import annotations

import re

import click
import pytest

from fedsec.cli import cli, main
from fedsec.options import DIFFERING


def _commands(group: click.Group, prefix: str = ""):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def _form(param: click.Parameter) -> tuple:
    kind = type(param.type).__name__
    choices = tuple(getattr(param.type, "choices", ()) or ())
    return (type(param).__name__, kind, choices, param.multiple, param.nargs, getattr(param, "is_flag", False),
            tuple(param.secondary_opts), param.required)


def _help(param: click.Parameter, ctx) -> str | None:
    record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
    return None if record is None else record[1]


def test_every_option_has_one_form_default_and_help_unless_declared():
    seen: dict[str, dict] = {}
    for path, command in _commands(cli):
        ctx = click.Context(command, info_name=path)
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            name = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
            seen.setdefault(name, {})[path] = {"form": _form(param), "default": param.default,
                                               "help": _help(param, ctx)}
    problems = []
    for name, by_command in sorted(seen.items()):
        if name in DIFFERING or name in ("--help",):
            continue
        for aspect in ("form", "default", "help"):
            values = {}
            for path, facts in by_command.items():
                values.setdefault(repr(facts[aspect]), []).append(path)
            if len(values) > 1:
                problems.append(f"{name}: {len(values)} {aspect}s: " + " | ".join(
                    f"{', '.join(paths)} → {value[:80]}" for value, paths in values.items()))
    assert not problems, "\n".join(problems)


def test_declared_differences_are_real_and_reasoned():
    """Each declared difference names an option that exists on two commands or more, with a reason."""
    names: dict[str, int] = {}
    for _, command in _commands(cli):
        for param in command.params:
            if not getattr(param, "hidden", False):
                name = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
                names[name] = names.get(name, 0) + 1
    for name, reason in DIFFERING.items():
        assert names.get(name, 0) >= 2 and len(reason) > 20, name


@pytest.mark.parametrize("command,refused", [("report", "--method"), ("compare", "--method"),
                                             ("compare", "--seed")])
def test_an_option_a_command_refuses_is_not_in_its_help(capsys, command, refused):
    main([command, "--help"])
    assert not re.search(rf"^\s*{refused}\s", capsys.readouterr().out, re.M)  # not listed as an option
    with pytest.raises(SystemExit) as exc:
        main([command, refused, "1" if refused == "--seed" else "fedavg"])
    assert exc.value.code == 2 and f"takes {refused}s" in capsys.readouterr().err


def test_the_attack_is_named_the_same_way_on_attack_and_flower_attack():
    attack = next(c for p, c in _commands(cli) if p == "attack")
    flower = next(c for p, c in _commands(cli) if p == "flower attack")
    first = [p for p in attack.params if isinstance(p, click.Argument)][0]
    assert first.name == "attack" and [p for p in flower.params if isinstance(p, click.Argument)][0].name == "attack"


def test_no_one_letter_long_option_and_no_pointer_to_the_readme(capsys):
    for path, command in _commands(cli):
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert all(len(o.lstrip("-")) > 1 for o in param.opts if o.startswith("--")), (path, param.opts)
        main([*path.split(), "--help"])
        text = capsys.readouterr().out
        assert "README" not in text and "session" not in text.lower() and " issue " not in text.lower(), path


def test_the_help_lists_every_attack_with_its_summary_and_every_command(capsys):
    from fedsec import catalog

    for path in (["attack"], ["flower", "attack"]):
        main([*path, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for name, entry in catalog.ATTACKS.items():
            assert f"{name} {' '.join(entry.summary.split())[:40]}" in text, (path, name)
    main(["--help"])
    text = capsys.readouterr().out
    for name in cli.commands:
        line = next(x for x in text.splitlines() if x.strip().startswith(name + " "))
        assert "..." not in line and len(line.split()) > 3, line


def test_a_deprecated_spelling_works_with_one_warning_line(tmp_path, capsys):
    import fedsec

    with pytest.warns(FutureWarning, match="--s is deprecated.*--uniform-share"):
        fedsec.train(dataset="digits", partition="weak", s=30.0, clients=3, rounds=1, progress=False)
    main(["train", "--dataset", "digits", "--partition", "weak", "--s", "30", "--clients", "3", "--rounds", "1",
          "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "warning: --s is deprecated and will be removed in the next release; use --uniform-share" in err
    assert 'uniform-share = 30.0' in (tmp_path / "run" / "config.toml").read_text()


def test_the_estimate_says_where_its_rates_were_measured():
    """On a CPU it quotes the 2-core reference machine; on a GPU it says no rate was measured there instead of
    passing the CPU figure off as the GPU's."""
    from fedsec.estimate import describe

    assert describe(90.0) == "about 90 s on a 2-core CPU machine like the one the rates were measured on"
    gpu = describe(600.0, "cuda:0")
    assert gpu.startswith("about 10 min on the 2-core CPU machine") and "no rates are measured for cuda:0" in gpu
