"""The architecture as a test: the import graph of dbuffer/ and fsdp/ has no cycles (imports under
``TYPE_CHECKING`` and inside functions included), the layers point one way, and modules and
classes (with their in-project bases) stay short.

Layers, each importing only those after it: ``fsdp.megatron`` (Megatron-FSDP's API, a layer on
top that nothing else imports) -> ``fsdp`` (the entry point) -> ``fsdp.unit`` (the unit and its
hooks) -> ``fsdp.checkpoint`` / ``fsdp.optim`` / ``fsdp.compose`` (optional parts) ->
``fsdp.group`` (the core: groups, layouts, gradients) -> ``dbuffer``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dbuffer", "fsdp")
MAX_LINES = 500
MAX_CLASS_LINES = 700  # a class together with its in-project bases: composition, not towers
# Modules still over MAX_LINES. The test fails when one is no longer over, so the list stays true.
KNOWN_LONG: set[str] = set()
# What each layer may import (besides itself and dbuffer). The core imports no optional feature.
ALLOWED = {
    "fsdp.megatron": {"fsdp", "fsdp.unit", "fsdp.compose", "fsdp.optim", "fsdp.checkpoint", "fsdp.group"},
    "fsdp.group": set(),
    "fsdp.compose": {"fsdp.group"},
    "fsdp.optim": {"fsdp.group"},
    "fsdp.checkpoint": {"fsdp.group"},
    "fsdp.unit": {"fsdp.group", "fsdp.compose", "fsdp.optim", "fsdp.checkpoint"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every project module ``path`` names in an import statement (anywhere in the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _layer(name: str) -> str:
    for layer in ALLOWED:
        if name == layer or name.startswith(layer + "."):
            return layer
    return name.split(".")[0] if name.startswith("dbuffer") else name


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_layers_point_one_way() -> None:
    wrong = []
    for name, targets in _graph().items():
        layer = _layer(name)
        if layer not in ALLOWED:
            continue
        for target in targets:
            other = _layer(target)
            if other != layer and other != "dbuffer" and other not in ALLOWED[layer]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_megatron_layer_is_imported_by_nothing_else() -> None:
    """``fsdp.megatron`` maps Megatron-FSDP's API onto fsdp and dbuffer: neither the core nor the
    entry point (``import fsdp``) may depend on it."""
    wrong = [
        f"{name} -> {target}"
        for name, targets in _graph().items()
        if not name.startswith("fsdp.megatron")
        for target in targets
        if target == "fsdp.megatron" or target.startswith("fsdp.megatron.")
    ]
    assert not wrong, "modules outside fsdp.megatron import it:\n" + "\n".join(wrong)


def test_modules_stay_short() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    long = {path for path, n in lengths.items() if n > MAX_LINES}
    assert long - KNOWN_LONG == set(), {p: lengths[p] for p in long - KNOWN_LONG}
    assert KNOWN_LONG - long == set(), f"no longer over {MAX_LINES} lines: drop from KNOWN_LONG: {KNOWN_LONG - long}"


def _class_lines() -> dict[str, int]:
    """Lines of every project class together with its in-project bases (transitively), by
    ``module.Class``; a base is found by its name among the project's classes."""
    own: dict[str, tuple[int, list[str]]] = {}
    by_name: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]
                qual = f"{name}.{node.name}"
                own[qual] = (node.end_lineno - node.lineno + 1, bases)
                by_name.setdefault(node.name, []).append(qual)

    def total(qual: str, seen: frozenset) -> int:
        lines, bases = own[qual]
        return lines + sum(total(b, seen | {qual}) for base in bases for b in by_name.get(base, []) if b not in seen)

    return {qual: total(qual, frozenset()) for qual in own}


def test_classes_with_their_bases_stay_small() -> None:
    big = {qual: n for qual, n in _class_lines().items() if n > MAX_CLASS_LINES}
    assert not big, f"classes over {MAX_CLASS_LINES} lines with their in-project bases: {big}"


def test_the_graph_sees_type_only_and_function_level_imports(tmp_path) -> None:
    """The checker itself: an import under TYPE_CHECKING or inside a function is an edge."""
    modules = {"fsdp.a": tmp_path / "a.py", "fsdp.b": tmp_path / "b.py"}
    modules["fsdp.a"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fsdp.b import X\n")
    modules["fsdp.b"].write_text("def f():\n    from fsdp import a\n")
    assert _imports(modules["fsdp.a"], "fsdp.a", modules) == {"fsdp.b"}
    assert _imports(modules["fsdp.b"], "fsdp.b", modules) == {"fsdp.a"}
