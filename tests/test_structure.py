"""Structure the project holds itself to: short functions, and imports that flow one way
(``fedecouple`` ← ``attacks`` ← ``fedsec`` → ``reports``)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
# package → the project packages it may import
ALLOWED = {"fedecouple": {"fedecouple"}, "attacks": {"fedecouple", "attacks"},
           "fedsec": {"fedecouple", "attacks", "fedsec", "reports"}, "reports": {"reports"}}


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"))


def long_functions(packages=("fedsec", "attacks", "fedecouple"), limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` for every function or method longer than ``limit`` lines."""
    found = []
    for package in packages:
        for path, tree in _modules(package):
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_is_longer_than_80_lines():
    assert long_functions() == []


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package):
    wrong = []
    for path, tree in _modules(package):
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                top = name.split(".")[0]
                if top in ALLOWED and top not in ALLOWED[package]:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert wrong == []


def test_attack_families_are_folders():
    """Each attack family lives in its own package under ``attacks/`` (adding an attack: one file in its
    family's folder plus a registry line); cross-family modules stay at the top."""
    for family in ("inversion", "membership", "malicious"):
        assert (ROOT / "attacks" / family / "__init__.py").is_file(), family
    for module in ("dlg", "ig", "proto", "labels", "closed_form", "observation", "lira", "rmia"):
        assert not (ROOT / "attacks" / f"{module}.py").exists(), f"attacks/{module}.py belongs in its family's folder"


def private_imports_between_modules(package: str = "fedsec") -> list[str]:
    """``path:line imports module._name`` for every underscore name one module of ``package`` imports
    from another of its modules."""
    found = []
    for path, tree in _modules(package):
        here = path.relative_to(ROOT).with_suffix("").parts
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative: resolve against this module's package
                source = here[:len(here) - node.level] + tuple((node.module or "").split(".")) if node.module else \
                    here[:len(here) - node.level]
            else:
                source = tuple((node.module or "").split("."))
            if source[:1] != (package,) or source == here:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {'.'.join(source)}.{a.name}"
                      for a in node.names if a.name.startswith("_")]
    return found


def test_fedsec_modules_do_not_import_each_others_private_helpers():
    assert private_imports_between_modules() == []


def _imported_modules(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the module at ``path``."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [(node.lineno, f"{module}.{a.name}" if not node.module else module) for a in node.names]
    return found


def test_nothing_imports_the_command_line():
    """``fedsec.cli`` is the top of the tree: no module imports it back (no circle with ``fedsec.flower.cli``);
    what the commands print lives in ``fedsec.console``, the presets in ``fedsec.presets``."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}" for package in ("fedsec", "attacks", "reports")
             for path, tree in _modules(package) for line, name in _imported_modules(path, tree)
             if name == "fedsec.cli" or name.startswith("fedsec.cli.")]
    assert wrong == []


VERDICT_CONSTANTS = ("SUCCESS_MARGIN_DB", "LEAK_GAP_DB", "PRESENCE_THRESHOLD", "SUCCESS_RULE")


def test_the_verdict_rules_have_one_home():
    """The success rule, the leak gap, the presence threshold and the LOWER BOUND rule are defined in
    ``attacks/verdicts.py`` only (the others import them; ``reports`` receives what they decided)."""
    defined = []
    for package in ("fedsec", "attacks", "reports"):
        for path, tree in _modules(package):
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    defined += [(t.id, path.relative_to(ROOT).as_posix()) for t in node.targets
                                if isinstance(t, ast.Name) and t.id in VERDICT_CONSTANTS]
                elif isinstance(node, ast.FunctionDef) and node.name in ("is_lower_bound", "at_chance", "psnr_gap"):
                    defined.append((node.name, path.relative_to(ROOT).as_posix()))
    assert {where for _, where in defined} == {"attacks/verdicts.py"}
    assert sorted(name for name, _ in defined) == sorted(VERDICT_CONSTANTS + ("at_chance", "is_lower_bound",
                                                                             "psnr_gap"))
