"""Structure the project holds itself to: short functions, and imports that flow one way
(``fedecouple`` ← ``attacks`` ← ``defenses`` ← ``fedsec`` → ``reports``)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
# package → the project packages it may import
ALLOWED = {"fedecouple": {"fedecouple"}, "attacks": {"fedecouple", "attacks"},
           "defenses": {"fedecouple", "attacks", "defenses"},
           "fedsec": {"fedecouple", "attacks", "defenses", "fedsec", "reports"}, "reports": {"reports"}}


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"))


def long_functions(packages=("fedsec", "attacks", "defenses", "fedecouple"), limit: int = MAX_LINES) -> list[str]:
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
    """``fedsec.cli`` is the top of the tree: no module imports it back (no circle with ``fedsec.flower_commands``);
    what the commands print lives in ``fedsec.console``, the presets in ``fedsec.presets``."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}" for package in ("fedsec", "attacks", "reports")
             for path, tree in _modules(package) for line, name in _imported_modules(path, tree)
             if name == "fedsec.cli" or name.startswith("fedsec.cli.")]
    assert wrong == []


VERDICT_CONSTANTS = ("SUCCESS_MARGIN_DB", "LEAK_GAP_DB", "PRESENCE_THRESHOLD", "SUCCESS_RULE")


def test_the_verdict_rules_have_one_home():
    """The success rule, the leak gap and the presence threshold are defined in ``attacks/verdicts.py`` only
    (the others import them; the verdict words' one rule is ``reports.exposure.judge``)."""
    defined = []
    for package in ("fedsec", "attacks", "reports"):
        for path, tree in _modules(package):
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    defined += [(t.id, path.relative_to(ROOT).as_posix()) for t in node.targets
                                if isinstance(t, ast.Name) and t.id in VERDICT_CONSTANTS]
                elif isinstance(node, ast.FunctionDef) and node.name in ("at_chance", "psnr_gap"):
                    defined.append((node.name, path.relative_to(ROOT).as_posix()))
    assert {where for _, where in defined} == {"attacks/verdicts.py"}
    assert sorted(name for name, _ in defined) == sorted(VERDICT_CONSTANTS + ("at_chance", "psnr_gap"))


# -- the attacks are peers: an attack module imports no other, and the inversion attacks optimise through
#    one template (``attacks.inversion.optimise``)

# an attack module builds its spec (one of these types)
SPEC_TYPES = ("ClientAttackSpec", "MaliciousSpec", "RoundAttackSpec", "MaliciousRoundSpec", "MembershipSpec")
OPTIMISE_TEMPLATE = "attacks/inversion/optimise/"
# training that is not an inversion, which an attack may run with its own optimiser: (file, function)
TRAINING_ALLOWED = {
    # prototype inversion's surrogate extractor: the server trains a copy of the model on its public
    # data towards the round's prototypes (the auxiliary-data threat model), before any inversion
    ("attacks/inversion/prototypes.py", "fit_surrogate"),
}
TV_PACKAGES = ("attacks", "fedecouple", "fedsec", "defenses")


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _attack_modules_imported(path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    """The modules of ``known`` (dotted names) the module at ``path`` imports, anywhere in it: ``from X
    import a`` counts X, and X.a where that is a module."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found & known


def attack_modules_importing_attack_modules() -> list[str]:
    """``a imports b (via ...)`` for every module of ``attacks/`` that builds an attack's spec (a call to
    one of ``SPEC_TYPES``) and imports another such module, directly or through the modules of
    ``attacks/`` it imports."""
    modules = {_module_of(path): (path, tree) for path, tree in _modules("attacks")}
    calls = {name: {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                    for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and isinstance(node.func, (ast.Name, ast.Attribute))} for name, (_, tree) in modules.items()}
    attacks = {name for name, called in calls.items() if called & set(SPEC_TYPES)}
    imports = {name: _attack_modules_imported(path, tree, set(modules)) for name, (path, tree) in modules.items()}
    wrong = []
    for attack in sorted(attacks):
        via: dict[str, str] = {m: attack for m in imports[attack]}
        stack = sorted(imports[attack])
        while stack:
            module = stack.pop()
            if module == attack:
                continue
            if module in attacks:
                chain, step = [], via[module]
                while step != attack:
                    chain.append(step)
                    step = via[step]
                wrong.append(f"{attack} imports {module}" + (f" (via {' -> '.join(chain[::-1])})" if chain else ""))
                continue
            for nxt in sorted(imports[module] - set(via)):
                via[nxt] = module
                stack.append(nxt)
    return wrong


def test_no_attack_module_imports_another():
    """An attack module (one that builds an attack's spec) imports no other attack module, directly or
    through the modules it imports: what attacks share lives in modules named for what it does, so
    each attack loads alone, on first use."""
    assert attack_modules_importing_attack_modules() == []


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ""


def _optimiser_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to torch.optim or to something in it, names bound to scipy.optimize.minimize or its
    module) by the module's imports."""
    optim, minimize = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.optim", "torch.optim.lr_scheduler"):
            optim |= {a.asname or a.name for a in node.names if node.module != "torch" or a.name == "optim"}
        elif isinstance(node, ast.ImportFrom) and node.module in ("scipy", "scipy.optimize"):
            minimize |= {a.asname or a.name for a in node.names if a.name in ("optimize", "minimize")}
        elif isinstance(node, ast.Import):
            optim |= {a.asname for a in node.names if a.asname and a.name.startswith("torch.optim")}
            minimize |= {a.asname for a in node.names if a.asname and a.name == "scipy.optimize"}
    return optim, minimize


def optimisers_outside_the_template() -> list[str]:
    """``path:line what (in function)`` for every construction of a ``torch.optim`` optimiser or
    scheduler, call of ``scipy.optimize.minimize`` or L-BFGS class in ``attacks/`` outside the
    optimisation template and ``TRAINING_ALLOWED``."""
    found = []
    for path, tree in _modules("attacks"):
        where = path.relative_to(ROOT).as_posix()
        if where.startswith(OPTIMISE_TEMPLATE):
            continue
        optim, minimize = _optimiser_names(tree)
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and "lbfgs" in node.name.lower():
                what = f"class {node.name}"
            elif isinstance(node, ast.Call):
                name = _dotted(node.func)
                head = name.split(".")[0]
                optimiser = name.startswith("torch.optim.") or head in optim
                scipy = name == "scipy.optimize.minimize" or (name.split(".")[-1] == "minimize" and head in minimize)
                if not (optimiser or scipy):
                    continue
                what = name
            else:
                continue
            inside = [f for f in functions if f.lineno <= node.lineno <= f.end_lineno and f is not node]
            function = min(inside, key=lambda f: f.end_lineno - f.lineno).name if inside else None
            if (where, function) not in TRAINING_ALLOWED:
                found.append(f"{where}:{node.lineno} {what} (in {function})")
    return found


def test_inversion_optimisers_live_in_the_template():
    """Every inversion loop runs on ``attacks.inversion.optimise`` (Adam with its step schedule, torch's
    and the batched L-BFGS, scipy's L-BFGS-B): no other module of ``attacks/`` builds an optimiser,
    except for the training ``TRAINING_ALLOWED`` names."""
    assert optimisers_outside_the_template() == []


def test_one_total_variation():
    """The image prior has one definition (``attacks.inversion.optimise.priors.total_variation``, its forms
    chosen by arguments): no second formula elsewhere."""
    defined = [f"{path.relative_to(ROOT).as_posix()}:{node.lineno}" for package in TV_PACKAGES
               if (ROOT / package).is_dir() for path, tree in _modules(package) for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "total_variation"]
    assert len(defined) == 1, defined


# -- no import circle inside a package: every module of a package can be read (and loaded) after the
#    modules it imports

# circles a package may keep, each named by its modules (sorted) with the reason it cannot be broken
# simply; every other circle fails the test. Empty: no package has one.
CIRCLES_ALLOWED: dict[tuple[str, ...], str] = {}


def _module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name → file, for every module of ``package`` under ``root`` (a package is its
    ``__init__``)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports, at module level or inside a function.
    Relative imports are resolved; ``from X import a`` counts ``X.a`` where that is a module of the
    package, else ``X``; ``import X.Y`` counts ``X.Y`` (not the parent packages it also loads)."""
    modules = _module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        # the package a relative import starts from: a package's __init__ is inside itself
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (each an import circle),
    each sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return sorted(circles)


def describe_circle(graph: dict[str, set[str]], circle: list[str]) -> str:
    """The circle's modules and the imports that tie them (``a -> b, c``)."""
    members = set(circle)
    ties = [f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in circle]
    return f"{len(circle)} modules:\n" + "\n".join(ties)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_circle_inside_a_package(package):
    graph = import_graph(ROOT, package)
    circles = [c for c in import_circles(graph) if tuple(c) not in CIRCLES_ALLOWED]
    assert not circles, "import circles:\n" + "\n".join(describe_circle(graph, c) for c in circles)


def test_the_circle_check_sees_imports_inside_functions_and_submodules_named_by_from(tmp_path):
    """The check on a made-up package: ``a`` imports ``b`` inside a function through ``from . import b``,
    ``b`` imports ``a`` through a relative ``from .a import``; ``c`` only imports ``a``."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (package / "b.py").write_text("from .a import f\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert import_circles(graph) == [["pkg.a", "pkg.b"]]
