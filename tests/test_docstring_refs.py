"""Every cross-reference in the docstrings of dbuffer/ and fsdp/ (``:func:``, ``:class:``,
``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:mod:``, ``:obj:``) names something that exists:
a rename that leaves a docstring pointing at nothing fails here, not in a reader's search
(tools/'s: ``tests/tools/test_tool_docstring_refs.py``, as only those tests import tools/).

A name (``~`` and a trailing ``()`` dropped; of ``title <name>``, the name) resolves, in this
order: as a full dotted path (``fsdp.group.plan.GroupPlan``, ``torch.nn.Module``); relative to
the docstring's module (``GroupPlan.buffer``; ``.files`` from its package); relative to the
enclosing class and its bases; in a module's docstring, as a member of a class the module
defines; as a public name of ``fsdp`` or ``dbuffer``. A class's member is an attribute, an
annotation, or an instance attribute one of its methods assigns (``self.name =``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dbuffer", "fsdp")
ROLE = re.compile(r":(func|class|mod|meth|attr|data|exc|obj):`([^`]+)`")
_MISSING = object()


def _lookup(path: str) -> object:
    """The object a dotted ``path`` names (importing its longest module prefix), else _MISSING."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, name in enumerate(parts[i:], start=i):
            if isinstance(obj, type) and j == len(parts) - 1:
                return obj if _has_member(obj, name) else _MISSING
            obj = getattr(obj, name, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def _has_member(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\b\s*(:[^=\n]+)?=[^=]")
    for base in cls.__mro__:
        if name in getattr(base, "__annotations__", {}):
            return True
        if base.__module__.split(".")[0] in PACKAGES + ("tools",) and assigned.search(inspect.getsource(base)):
            return True
    return False


def resolves(name: str, module: ModuleType, cls: Optional[str], in_module_doc: bool) -> bool:
    """Whether a reference ``name`` written in ``module`` (inside class ``cls``, dotted if nested)
    names an object, by the rules of this module's docstring."""
    explicit = re.search(r"<([^>]+)>$", name)  # ``title <target>``
    name = re.sub(r"\s+", "", explicit.group(1) if explicit else name).lstrip("~").removesuffix("()")
    here = module.__name__
    package = here if Path(module.__file__).name == "__init__.py" else here.rpartition(".")[0]
    if name.startswith("."):
        return _lookup(package + name) is not _MISSING
    candidates = [name, f"{here}.{name}", f"{package}.{name}"]
    if cls is not None:
        outer = cls.split(".")
        candidates += [f"{here}.{'.'.join(outer[:k])}.{name}" for k in range(len(outer), 0, -1)]
    if in_module_doc and "." not in name:
        candidates += [f"{here}.{c}.{name}" for c, obj in vars(module).items()
                       if isinstance(obj, type) and obj.__module__ == here]
    candidates += [f"{p}.{name}" for p in PACKAGES]
    return any(_lookup(c) is not _MISSING for c in candidates)


def _references(path: Path):
    """(line, role, name, class or None, whether in the module docstring) of every reference."""
    tree = ast.parse(path.read_text())

    def visit(node: ast.AST, cls: Optional[str]):
        doc = ast.get_docstring(node, clean=False)
        if doc:
            for m in ROLE.finditer(doc):
                yield getattr(node, "lineno", 1), m.group(1), m.group(2), cls, isinstance(node, ast.Module)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, child.name if cls is None else f"{cls}.{child.name}")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, cls)

    yield from visit(tree, None)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unresolved_in(top: str) -> list[str]:
    """``path:line :role:`name``` of each reference in the modules under ``ROOT / top`` that names
    nothing."""
    unresolved = []
    for path in sorted((ROOT / top).rglob("*.py")):
        module = importlib.import_module(_module_name(path))
        for line, role, name, cls, in_module_doc in _references(path):
            if not resolves(name, module, cls, in_module_doc):
                unresolved.append(f"{path.relative_to(ROOT)}:{line} :{role}:`{name}`")
    return unresolved


def test_every_docstring_reference_names_something_that_exists() -> None:
    unresolved = [ref for package in PACKAGES for ref in unresolved_in(package)]
    assert not unresolved, "docstring references to nothing (renamed or removed?):\n" + "\n".join(unresolved)


def test_the_check_tells_a_stale_reference_from_a_live_one() -> None:
    state = importlib.import_module("fsdp.unit.state")
    atomic = importlib.import_module("fsdp.checkpoint.atomic")
    assert resolves("fsdp.FSDPModule.finalize_backward", state, None, True)
    assert not resolves("FSDPState.finalize_backward", state, None, True)  # the method lives elsewhere
    assert resolves("~fsdp.unit.root.RootContext", state, None, True)
    assert not resolves("fsdp.unit.root.NoSuchContext", state, None, True)
    assert resolves(".files", atomic, None, True) and not resolves(".no_such_module", atomic, None, True)
    assert resolves("_pre_backward", state, "FSDPState", False)  # a method of the enclosing class
    assert resolves("fqn", state, "FSDPState", False)  # an instance attribute its __init__ assigns
    assert not resolves("no_such_member", state, "FSDPState", False)
    assert resolves("torch.no_grad()", state, None, False)
    assert not resolves("RootContext.finish <fsdp.unit.root.RootContext.no_such_method>", state, None, False)
