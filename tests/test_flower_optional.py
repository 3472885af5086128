"""Flower stays optional: only fedsec.flower imports it, and fedsec works without it (these tests run
whether Flower is installed or not)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WITHOUT_FLOWER = "import sys; sys.modules['flwr'] = None; from fedsec.cli import main; main({argv!r})"


def test_only_fedsec_flower_imports_flower():
    wrong = []
    for package in ("fedecouple", "attacks", "fedsec", "reports"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "fedsec" / "flower"):
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                wrong += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "flwr"]
    assert wrong == []


def _without_flower(argv):
    return subprocess.run([sys.executable, "-c", WITHOUT_FLOWER.format(argv=argv)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_help_works_without_flower():
    done = _without_flower(["--help"])
    assert done.returncode == 0 and "flower" in done.stdout, done.stderr


def test_flower_commands_name_the_extra_without_flower():
    done = _without_flower(["flower", "audit", "examples/flower_mnist"])
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: fedsec flower needs Flower, which is not installed: pip install "
                                   "'flwr[simulation]>=1.41,<1.43' (from a checkout: pip install -e '.[flower]')")
