"""The API reference is the docstrings: every public name of ``fsdp``, ``dbuffer`` and
``fsdp.megatron`` (their ``__all__``) says what it takes, what it raises and what it guarantees,
and every public method and property the project defines on them says something.

What is checked mechanically: a docstring of at least :data:`MIN_CHARS` characters (for a class,
its own docstring plus its ``__init__``'s); every named parameter of the signature (a class's
``__init__``) mentioned by name; errors mentioned (an exception type, or "raise"). Names that are
torch's own objects (``fsdp.CPUOffloadPolicy`` is ``torch.distributed.fsdp.CPUOffloadPolicy``) are
torch's to document. :data:`PENDING` lists the gaps left in modules being restructured; the test
fails when one is closed, so the list stays true.
"""

from __future__ import annotations

import inspect
import re

import pytest

import dbuffer
import fsdp
import fsdp.megatron

MIN_CHARS = 200
ERRORS = re.compile(r"\b(raises?|raised|[A-Z]\w*(Error|Exception))\b", re.I)
# name -> what its docstring still lacks (parameters, "errors", or method names), to be written
# where the code is being restructured (fsdp/unit/fully_shard.py, fsdp/group/param_group.py).
PENDING: dict[str, set[str]] = {}


def _public() -> list[tuple[str, object]]:
    return [(f"{m.__name__}.{n}", getattr(m, n)) for m in (fsdp, dbuffer, fsdp.megatron) for n in m.__all__]


def _is_torchs(obj: object) -> bool:
    return (getattr(obj, "__module__", "") or "").startswith("torch")


def _doc(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    init = vars(obj).get("__init__") if inspect.isclass(obj) else None
    if init is not None and init.__doc__:
        doc += "\n" + inspect.getdoc(init)
    return doc


def _parameters(obj: object) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and (getattr(target, "__module__", "") or "").split(".")[0] not in ("fsdp", "dbuffer"):
        return []  # a class without an __init__ of the project's (object's, torch's)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    skip = (inspect.Parameter.VAR_POSITIONAL,)
    return [p.name for p in signature.parameters.values() if p.name != "self" and p.kind not in skip]


def _project_members(cls: type) -> list[tuple[str, object]]:
    """Public methods and properties that the project itself defines on ``cls`` (or its bases)."""
    out = []
    for name in dir(cls):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        target = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
        if not callable(target):
            continue
        module = getattr(target, "__module__", "") or ""
        if module.split(".")[0] in ("fsdp", "dbuffer"):
            out.append((name, target))
    return out


def gaps(name: str, obj: object) -> set[str]:
    """What ``obj``'s documentation lacks: parameter names, "errors", "length", method names."""
    if _is_torchs(obj):
        return set() if inspect.getdoc(obj) else {"length"}
    doc = _doc(obj)
    missing = {p for p in _parameters(obj) if not re.search(rf"\b{re.escape(p)}\b", doc)}
    if len(doc) < MIN_CHARS:
        missing.add("length")
    if not ERRORS.search(doc):
        missing.add("errors")
    if inspect.isclass(obj):
        missing |= {m for m, f in _project_members(obj) if not (inspect.getdoc(f) or "").strip()}
    return missing


@pytest.mark.parametrize("name,obj", _public(), ids=[n for n, _ in _public()])
def test_public_name_is_documented(name: str, obj: object) -> None:
    assert gaps(name, obj) == PENDING.get(name, set()), (
        f"{name}: its docstring lacks {sorted(gaps(name, obj) - PENDING.get(name, set()))} (arguments by "
        f"name, errors, at least {MIN_CHARS} characters, a docstring on every public method)"
        if gaps(name, obj) - PENDING.get(name, set())
        else f"{name}: now documents {sorted(PENDING[name] - gaps(name, obj))}: drop them from PENDING"
    )


def test_torchs_own_names_are_torchs_objects() -> None:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_common  # ShardPlacementResult's home (not exported)

    torchs = {n.split(".")[1] for n, obj in _public() if _is_torchs(obj) and n.count(".") == 1}
    assert torchs, "no torch objects found: the check of _is_torchs is vacuous"
    for n in torchs - {"clip_grad_norm_"}:
        assert getattr(fsdp, n) is getattr(torch_fsdp, n, getattr(_fsdp_common, n, None)), n
    from torch.distributed.tensor import placement_types

    megatrons = {n.rsplit(".", 1)[1] for n, obj in _public() if _is_torchs(obj) and n.startswith("fsdp.megatron.")}
    assert megatrons == {"Placement", "Replicate", "Shard"}, megatrons  # torch's placements, as Megatron-LM main uses them
    for n in megatrons:
        assert getattr(fsdp.megatron, n) is getattr(placement_types, n), n


def test_the_check_catches_a_poor_docstring() -> None:
    def poor(alpha: int, beta: int = 0) -> None:
        """Does a thing with alpha."""

    assert gaps("poor", poor) == {"beta", "length", "errors"}
