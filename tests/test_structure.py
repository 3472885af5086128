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
