"""The documentation a user reads: the README (short, its commands and Python example real), the MkDocs
site (builds in strict mode: no broken link, no missing page, the API reference generated), and every file
the repository ships free of one machine's absolute paths, of words about how the project is developed,
and of relative links to files the repository does not hold."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FIRST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q -e . && "
                 ".venv/bin/fedsec attack dlg --method fedecouple")
TEST_COMMAND = ".venv/bin/python -m pytest -q -n 2 --dist loadfile"
PAGES = ("index.md", "getting-started.md", "concepts.md", "glossary.md", "reading-results.md", "results.md",
         "own-federation.md", "attacks.md", "methods.md", "malicious-server.md", "real-training.md", "defenses.md",
         "membership-inference.md", "flower.md", "devices.md", "datasets.md", "commands.md", "findings.md", "api.md",
         "library.md", "architecture.md", "testing.md")

# What no shipped file may contain. A line may show a user's own path as an example when it carries the
# marker below; the words are assembled so that this file does not match itself.
EXAMPLE_MARKER = "example path"
_ROOTS = "|".join(("wo" + "rk", "t" + "mp", "ro" + "ot"))  # a machine's working, temporary and home folders
MACHINE_PATHS = re.compile(r"(?<![\w.~-])/(?:" + _ROOTS + r")/|(?<![\w.~-])/ho" + r"me/[A-Za-z]")
PROCESS_WORDS = [re.compile(p, re.IGNORECASE) for p in (r"\bsess" + r"ion \d", r"\bsess" + r"ion s\d",
                                                        r"\biss" + r"ue \d+", r"\bclos" + r"ing note")]
PROCESS_WORDS.append(re.compile("REFERENCE" + r"\.md|" + "REFERENCE" + " §"))  # case-sensitive: a file name
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def shipped_files() -> list[str]:
    """Files the repository holds or will hold: tracked, plus untracked ones git does not ignore."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the shipped files are what git tracks")
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout: the shipped files are what git tracks")
    return sorted({f for f in done.stdout.splitlines() if (ROOT / f).is_file()})


def text_of(name: str) -> str | None:
    try:
        return (ROOT / name).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a binary file (pictures, checkpoints)


def test_the_readme_is_short_says_what_fedsec_is_first_and_keeps_its_two_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; at most 150"
    prose = next(line for line in lines if line.strip() and not line.startswith("#"))
    assert prose.startswith("fedsec is a privacy and security evaluation toolkit for personalised federated learning")
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert blocks[0] == FIRST_COMMAND
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert blocks[1] == ci == f"python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && {TEST_COMMAND}"


def test_the_readme_names_every_command_and_every_registered_attack():
    import click

    import attacks
    from fedsec.cli import cli

    text = README.read_text(encoding="utf-8")
    for name, command in cli.commands.items():
        if isinstance(command, click.Group):
            for sub in command.commands:
                assert f"`fedsec {name} {sub}" in text, f"README's command table lacks fedsec {name} {sub}"
        else:
            assert f"`fedsec {name} " in text, f"README's command table lacks fedsec {name}"
    for attack in attacks.ATTACKS:
        assert f"| `{attack}` |" in text, f"README's attack table lacks {attack}"


def test_the_readme_picture_is_committed_small():
    picture = ROOT / "docs" / "img" / "main-job.png"
    assert f"]({picture.relative_to(ROOT).as_posix()})" in README.read_text(encoding="utf-8")
    assert picture.is_file() and picture.stat().st_size < 100_000


def test_the_readmes_python_example_runs(tmp_path, monkeypatch, capsys):
    """The README's Python block, run as written (in this process: a fresh one only adds torch's import)."""
    blocks = re.findall(r"```python\n(.*?)\n```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1, "the README has one Python example"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert re.search(r"\d+\.\d\d dB over \d+ images", printed), printed[-2000:]
    assert not any(tmp_path.iterdir()), "out=None writes nothing"


def test_the_site_builds_in_strict_mode_with_every_page_and_the_api_reference(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tooling is in the test extra: pip install -e '.[test]'")
    pytest.importorskip("mkdocstrings", reason="the docs tooling is in the test extra: pip install -e '.[test]'")
    for page in PAGES:
        assert (ROOT / "docs" / page).is_file(), f"docs/{page} is missing"
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    api = (site / "library" / "index.html").read_text(encoding="utf-8")
    assert "attack_recorded" in api, "the library reference lists attacks.harness.attack_recorded"


def test_no_shipped_file_holds_a_machine_path_or_process_words():
    hits = []
    for name in shipped_files():
        text = text_of(name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATHS.search(line) and EXAMPLE_MARKER not in line:
                hits.append(f"{name}:{number}: machine path: {line.strip()[:120]}")
            for pattern in PROCESS_WORDS:
                if pattern.search(line):
                    hits.append(f"{name}:{number}: process words: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


def test_every_relative_markdown_link_points_to_a_shipped_file():
    files = shipped_files()
    shipped = set(files)
    folders = {str(Path(f).parent) for f in files}
    broken = []
    for name in (f for f in files if f.endswith(".md")):
        text = text_of(name) or ""
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are not links
        for target in MARKDOWN_LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, a mail address or an anchor on the same page
            normal = os.path.normpath(Path(name).parent / target.split("#")[0])
            if normal not in shipped and normal not in folders:
                broken.append(f"{name}: ({target})")
    assert not broken, "links to files the repository does not hold:\n" + "\n".join(broken)


def test_a_released_tool_carries_licence_changelog_and_citation():
    import tomllib

    licence = (ROOT / "LICENSE").read_text(encoding="utf-8")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == {"text": "MIT"} and licence.startswith("MIT License")
    assert "Copyright (c)" in licence and "the fedsec authors" in licence
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## \[?{re.escape(project['version'])}\]?", changelog, re.M)
    citation = (ROOT / "CITATION.cff").read_text(encoding="utf-8")
    fields = dict(re.findall(r"^([a-z-]+):\s*(.*)$", citation, re.M))
    assert fields["cff-version"] == "1.2.0"
    for key in ("message", "title", "authors", "version", "license"):
        assert key in fields, f"CITATION.cff lacks {key}"
    assert fields["version"].strip("\"'") == project["version"] and fields["license"].strip("\"'") == "MIT"


def test_the_docs_tooling_is_pinned_in_the_test_extra():
    import tomllib

    test = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]["test"]
    pins = {re.split(r"[<>=\[]", r)[0]: r for r in test}
    assert "<2" in pins["mkdocs"], "MkDocs 1.x: the strict build must not meet a new major"
    assert "mkdocs-material" in pins and "mkdocstrings" in pins


# -- pages generated from the code, and pages checked against it ----------------------------------------
def test_the_generated_pages_are_current():
    """docs/findings.md and the keyword tables of docs/api.md are what ``fedsec.docs_tables`` generates from
    the code now (``python -m fedsec.docs_tables`` rewrites them)."""
    from fedsec import docs_tables

    for path, text in docs_tables.pages().items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run python -m fedsec.docs_tables"


def test_the_findings_page_names_every_code_the_audit_raises_with_its_severities():
    from fedsec import docs_tables

    in_code = docs_tables.finding_severities_in_code()
    assert len(in_code) >= 17 and "MODEL_DISCLOSED" in in_code and "FIELDS_IN_THE_CLEAR" in in_code
    assert {code: set(f.severities) for code, f in docs_tables.FINDINGS.items()} == in_code
    page = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    for code, severities in in_code.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{code}` |"))
        assert set(row.split(" | ")[1].split(", ")) == severities, row


def test_the_api_page_lists_every_keyword_of_every_function():
    from fedsec import docs_tables
    from fedsec.commands import cli

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    block = page[page.index(docs_tables.API_BEGIN):page.index(docs_tables.API_END)]
    for name in docs_tables.API_FUNCTIONS:
        for param in cli.commands[name].params:
            if not getattr(param, "hidden", False):
                assert f"| `{param.name}` |" in block, f"docs/api.md lacks fedsec.{name}'s keyword {param.name}"


COMMANDS_PAGE = ROOT / "docs" / "commands.md"
TAKEN_BY = re.compile(r"`fedsec ([a-z]+(?: (?:attack|audit))?)`")
CHOICES = re.compile(r"^\{([a-z0-9-]+(?:,[a-z0-9-]+)+)\}$")  # a fixed list, as {a,b,c}


def documented_flags() -> list[dict]:
    """Every flag row of docs/commands.md: its flags, the choices its metavar lists, its default cell and the
    commands of its section (the section's "Taken by" paragraph)."""
    rows = []
    for section in re.split(r"^## ", COMMANDS_PAGE.read_text(encoding="utf-8"), flags=re.M)[1:]:
        taken = re.search(r"^Taken by (.*?)(?:\n\s*\n|\Z)", section, re.M | re.S)
        if taken is None:
            continue
        commands = TAKEN_BY.findall(taken.group(1))
        for line in section.splitlines():
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if len(cells) != 3 or not cells[0].startswith("`--"):
                continue
            flags = re.findall(r"`(--[^`]+)`", cells[0])
            names = [f.split()[0].split("/")[0] for f in flags]
            choices = CHOICES.match(flags[0].split(" ", 1)[1] if " " in flags[0] else "")
            rows.append({"flags": names, "choices": choices.group(1).split(",") if choices else None,
                         "default": cells[1], "commands": commands, "line": line})
    return rows


def _click_params(command_path: str) -> dict:
    import click

    from fedsec.commands import cli

    command = cli
    for part in command_path.split():
        command = command.commands[part]
    defaults = command.make_context(command.name, [], resilient_parsing=True).params
    return {opt: (p, defaults.get(p.name)) for p in command.params if isinstance(p, click.Option) for opt in p.opts}


def _documented_default_matches(cell: str, default) -> bool:
    """A default cell is "on"/"off" for a flag, exactly one value in backticks for a set default, and words
    for an unset one (None, or nothing given to a repeatable flag): the command decides, as they say."""
    if isinstance(default, bool):
        return cell == ("on" if default else "off")
    value = re.fullmatch(r"`([^`]+)`", cell)
    if default is None or default == ():
        return value is None
    if value is None:
        return False
    text = value.group(1)
    return float(text) == default if isinstance(default, (int, float)) else text == str(default)


def test_the_commands_page_gives_each_flag_the_clis_default_and_choices():
    import click

    rows = documented_flags()
    assert len(rows) > 80, "docs/commands.md's flag tables were not found"
    wrong = []
    for row in rows:
        found = 0
        for command in row["commands"]:
            params = _click_params(command)
            for flag in row["flags"]:
                if flag not in params:
                    continue
                found += 1
                param, default = params[flag]
                if not param.required and not _documented_default_matches(row["default"], default):
                    wrong.append(f"fedsec {command} {flag}: documented default {row['default']!r}, the CLI's {default!r}")
                choices = list(param.type.choices) if isinstance(param.type, click.Choice) else None
                if row["choices"] != choices:
                    wrong.append(f"fedsec {command} {flag}: documented choices {row['choices']}, the CLI's {choices}")
        if not found:
            wrong.append(f"{row['flags']}: no command of its section ({', '.join(row['commands'])}) takes it")
    assert not wrong, "\n".join(wrong)


def test_the_commands_page_documents_every_flag_of_every_command():
    from fedsec.commands import cli
    import click

    documented = {(c, f) for row in documented_flags() for c in row["commands"] for f in row["flags"]}
    missing = []
    for name, command in cli.commands.items():
        subcommands = command.commands.items() if isinstance(command, click.Group) else [("", command)]
        for sub, leaf in subcommands:
            path = f"{name} {sub}".strip()
            for param in leaf.params:
                if isinstance(param, click.Option) and not param.hidden and (path, param.opts[0]) not in documented:
                    missing.append(f"fedsec {path} {param.opts[0]}")
    assert not missing, "docs/commands.md documents nowhere: " + ", ".join(missing)


def test_every_defense_is_in_the_defenses_table_and_the_readmes_command_table():
    from fedsec import catalog

    page = (ROOT / "docs" / "defenses.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z-]+)` \|", page, re.M)
    assert rows == list(catalog.DEFENSES), rows
    defend = next(line for line in README.read_text(encoding="utf-8").splitlines() if line.startswith("| `fedsec defend"))
    assert re.findall(r"`([a-z-]+)`", defend.split("|")[2]) == list(catalog.DEFENSES), defend


def test_no_page_claims_more_repeatability_than_the_same_machine_gives():
    """Bit-for-bit repeats hold on one machine with one torch thread count and the same kernels; across CPUs
    the figures move within their intervals. (The generated results page and the reading guide are checked
    where they are written.)"""
    claims = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name in ("results.md", "reading-results.md"):
            continue
        text = " ".join(page.read_text(encoding="utf-8").split())
        for sentence in re.split(r"(?<=[.;:])\s", text):
            if re.search(r"bit for bit|bit-identical|bit-for-bit", sentence) and "same machine" not in sentence:
                claims.append(f"{page.name}: {sentence[:160]}")
    assert not claims, "\n".join(claims)
