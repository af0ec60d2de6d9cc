"""The import graph stays a stack of layers that only point down (the picture is in docs/design.md).

Every module under ``rlpost/`` is parsed with :mod:`ast`; every import counts, also those under ``TYPE_CHECKING``
and inside functions (a lazy import is still a dependency), and so does a string import: a string literal
outside docstrings naming an ``rlpost`` module or a module's attribute, which is what ``importlib.import_module``,
``__import__`` and a ``class_path`` resolve. ``from a import b`` depends on package ``a`` itself (it reads ``a``'s
namespace), so a submodule doing ``from rlpost.bench import stats`` while ``rlpost/bench/__init__.py`` imports it is
a cycle; ``import rlpost.bench.stats as stats`` is not. The test fails on

* any import cycle inside ``rlpost/``;
* any import from a lower layer to a higher one (:data:`LAYERS`);
* any module that no layer claims, or any import of an ``rlpost`` module that does not exist;
* any import in ``plugins/`` of something other than the facade ``rlpost`` (``from rlpost import ...``) and the
  plugin's own package: first-party plugins are the proof that a third party can write the same with the declared
  plugin API alone (docs/writing_plugins.md).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlpost"
PLUGINS = ROOT / "plugins"

# (level, name, module prefixes). A module may import modules of its own level or below, never above. Mirrored in
# docs/design.md ("Layers"); test_design_doc_mirrors_the_table keeps the two identical.
LAYERS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (0, "core", ("rlpost.core",)),
    (1, "ops", ("rlpost.ops",)),
    (2, "components, models", ("rlpost.components", "rlpost.models")),
    (3, "engine", ("rlpost.engine",)),
    (4, "facade", ("rlpost",)),
    (5, "apps", ("rlpost.apps", "rlpost.bench", "rlpost.testing")),
)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path, top: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(top.rglob("*.py"))}


DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring node (module, class, function): prose may name modules without importing them."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found.add(id(first.value))
    return found


@functools.cache
def _top_level_names(path: Path) -> frozenset[str]:
    """Names a module binds at its top level (also under ``if``/``try``) and the strings in its ``__all__``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names.update(
                    c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return frozenset(names)


def _named_module(text: str, modules: Mapping[str, Path]) -> str | None:
    """The module a dotted string names: itself, or the module whose top-level attribute it is (a ``class_path``)."""
    parts = text.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in modules:
            if cut == len(parts) or parts[cut] in _top_level_names(modules[head]):
                return head
            return None  # a module prefix followed by something it does not define: a plugin name, a stash key
    return None


def _imports(path: Path, module: str, modules: Mapping[str, Path]) -> list[tuple[str, int]]:
    """Every module ``path`` imports, as (dotted name, line).

    ``import a.b`` is ``a.b``; ``from a import b`` is ``a`` (its namespace is read) and also ``a.b`` when that is a
    module; a string literal outside docstrings that names a module or a module's attribute (what
    ``importlib.import_module("a.b")``, ``__import__`` or a ``class_path`` resolves) is that module.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    docstrings = _docstrings(tree)
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    found.append((sub, node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if DOTTED.fullmatch(node.value):
                named = _named_module(node.value, modules)
                if named is not None:
                    found.append((named, node.lineno))
    return sorted(found, key=lambda t: t[1])


def _layer(module: str) -> int | None:
    """The level of the most specific prefix claiming ``module`` (``rlpost`` itself is the facade)."""
    best: tuple[int, int] | None = None  # (prefix length, level)
    for level, _, prefixes in LAYERS:
        for prefix in prefixes:
            exact_facade = prefix == "rlpost" and module == "rlpost"
            if exact_facade or (prefix != "rlpost" and (module == prefix or module.startswith(prefix + "."))):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), level)
    return None if best is None else best[1]


def _graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """Import edges between the modules of ``root/rlpost`` and the problems found on the way."""
    modules = _modules(root, root / "rlpost")
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    problems: list[str] = []
    for module, path in modules.items():
        for target, line in _imports(path, module, modules):
            if target != "rlpost" and not target.startswith("rlpost."):
                continue
            if target not in known:
                problems.append(f"{path.relative_to(root)}:{line}: imports {target}, which is no module of rlpost")
                continue
            if target != module:
                graph[module].add(target)
    return graph, problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_rlpost_module_has_a_layer_and_imports_exist() -> None:
    graph, problems = _graph()
    unclaimed = sorted(m for m in graph if _layer(m) is None)
    assert not unclaimed, f"modules no layer claims (add them to LAYERS and docs/design.md): {unclaimed}"
    assert not problems, "\n".join(sorted(set(problems)))


def test_no_import_cycle_in_rlpost() -> None:
    graph, _ = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles in rlpost/ (each line one strongly connected set of modules):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def _upward(graph: dict[str, set[str]]) -> list[str]:
    names = {level: name for level, name, _ in LAYERS}
    upward = []
    for module, targets in sorted(graph.items()):
        here = _layer(module)
        for target in sorted(targets):
            there = _layer(target)
            if here is not None and there is not None and there > here:
                upward.append(f"{module} ({names[here]}) imports {target} ({names[there]})")
    return upward


def test_layers_only_point_down() -> None:
    upward = _upward(_graph()[0])
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def _plugin_packages() -> list[Path]:
    return sorted(p for p in PLUGINS.iterdir() if (p / "__init__.py").is_file())


def test_there_are_plugins_to_check() -> None:
    # An empty glob would make the next test pass vacuously.
    names = {p.name for p in _plugin_packages()}
    assert {"rlpost_treegrpo", "rlpost_rewards", "rlpost_digits"} <= names, names


@pytest.mark.parametrize("package", _plugin_packages(), ids=lambda p: p.name)
def test_plugins_import_only_the_declared_api(package: Path) -> None:
    modules = _modules(PLUGINS, package)
    everything = {**_modules(ROOT, PACKAGE), **_modules(PLUGINS, PLUGINS)}
    bad = []
    for module, path in modules.items():
        for target, line in _imports(path, module, everything):
            top = target.split(".")[0]
            if top == package.name or target == "rlpost":
                continue
            if top == "rlpost" or top.startswith("rlpost_"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not bad, (
        f"{package.name} may import only the facade (`from rlpost import ...`) and its own package:\n"
        + "\n".join(sorted(set(bad)))
    )


def test_design_doc_mirrors_the_table() -> None:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|", text, flags=re.M)
    documented = [(int(level), name, tuple(re.findall(r"rlpost[\w.]*", packages))) for level, name, packages in rows]
    assert documented == list(LAYERS), "docs/design.md's layer table differs from LAYERS in this test"


def _plant(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    # The checks must be able to fail: a two-module cycle and an upward import are reported.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _layer("rlpost.core.api") == 0 and _layer("rlpost.engine.runner") == 3 and _layer("rlpost") == 4
    assert _layer("rlpost.apps.cli") == 5 and _layer("rlpost.somewhere") is None
    pkg = tmp_path / "pkg"
    _plant(pkg, {"__init__.py": "", "n.py": ""})
    (pkg / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import n\n")
    modules = _modules(tmp_path, pkg)
    assert _imports(pkg / "m.py", "pkg.m", modules) == [("typing", 1), ("pkg", 3), ("pkg.n", 3)]


def test_the_checker_sees_string_imports_upward(tmp_path: Path) -> None:
    # importlib, __import__ and a class_path literal are imports; a docstring, a plugin name or a stash key that only
    # looks like a module path is not.
    _plant(
        tmp_path / "rlpost",
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": 'import importlib\nM = importlib.import_module("rlpost.apps.x")\n',
            "core/b.py": '__import__("rlpost.engine")\n',
            "core/c.py": 'CLASS_PATH = "rlpost.engine.y.Thing"\n',
            "core/d.py": '"""Like rlpost.apps.x."""\nNAME = "rlpost.apps.x.probe"\nKEY = "rlpost.last_eval"\n',
            "engine/__init__.py": "",
            "engine/y.py": "class Thing:\n    pass\n",
            "apps/__init__.py": "",
            "apps/x.py": "",
        },
    )
    graph, problems = _graph(tmp_path)
    assert not problems
    assert _upward(graph) == [
        "rlpost.core.a (core) imports rlpost.apps.x (apps)",
        "rlpost.core.b (core) imports rlpost.engine (engine)",
        "rlpost.core.c (core) imports rlpost.engine.y (engine)",
    ]
    assert graph["rlpost.core.d"] == set()


def test_the_checker_sees_a_submodule_importing_its_package(tmp_path: Path) -> None:
    # ``from rlpost.bench import stats`` in a module that rlpost/bench/__init__.py imports is a cycle (the package's
    # namespace is read while it is being built); ``import rlpost.bench.stats`` is not.
    files = {
        "__init__.py": "",
        "bench/__init__.py": "from rlpost.bench.aggregate import f\n",
        "bench/stats.py": "",
        "bench/aggregate.py": "from rlpost.bench import stats\n\ndef f() -> None:\n    pass\n",
    }
    _plant(tmp_path / "rlpost", files)
    assert _cycles(_graph(tmp_path)[0]) == [["rlpost.bench", "rlpost.bench.aggregate"]]
    (tmp_path / "rlpost" / "bench" / "aggregate.py").write_text("import rlpost.bench.stats as stats\n")
    assert _cycles(_graph(tmp_path)[0]) == []
