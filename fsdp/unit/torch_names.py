"""fsdp under torch's names: a switch for frameworks that call torch FSDP2 themselves.

Frameworks (accelerate, Lightning Fabric, torchtitan) call ``torch.distributed.fsdp.fully_shard``
and test ``isinstance(m, torch.distributed.fsdp.FSDPModule)``, so :func:`torch_names` rebinds
those names to fsdp's objects; subclassing torch's ``FSDPModule`` would not do, as torch's own code
then reaches into FSDP2's private state. Only later lookups change: frameworks importing inside
functions get fsdp's, torch's internals keep theirs. ``torch.distributed.pipelining``, driving
FSDP2 stages through names bound at import (:mod:`fsdp.unit.pipelining`), is rebound too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

from fsdp.group.policy import MixedPrecisionPolicy
from fsdp.unit.fully_shard import fully_shard
from fsdp.unit.module import FSDPModule, GradientReductionHandle, UnshardHandle, register_fsdp_forward_method
from fsdp.unit.surface import share_comm_ctx

__all__ = ["torch_names"]

# FSDP2's public names (the old ``_composable`` path too), and the class's private module.
_PUBLIC = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
_CLASS_ONLY = ("torch.distributed.fsdp._fully_shard._fully_shard",)
# Bound FSDP2's names at import: rebound if already imported (a later import gets fsdp's anyway).
_PIPELINING = ("torch.distributed.pipelining.stage", "torch.distributed.pipelining.schedules")

_SAVED: Optional[dict[tuple[str, str], object]] = None  # torch's objects while fsdp's are bound


def _ours() -> dict[str, object]:
    return {
        "fully_shard": fully_shard,
        "FSDPModule": FSDPModule,
        "MixedPrecisionPolicy": MixedPrecisionPolicy,
        "UnshardHandle": UnshardHandle,
        "GradientReductionHandle": GradientReductionHandle,
        "register_fsdp_forward_method": register_fsdp_forward_method,
        "share_comm_ctx": share_comm_ctx,
    }


def _targets():
    ours = _ours()
    imported = tuple(path for path in _PIPELINING if path in sys.modules)
    for path in _PUBLIC + _CLASS_ONLY + imported:
        try:
            module = importlib.import_module(path)
        except ImportError:  # a path this torch does not have
            continue
        names = ("FSDPModule",) if path in _CLASS_ONLY else tuple(ours)
        for name in names:
            if hasattr(module, name):  # only names torch has there: restoring then puts back all
                yield path, module, name, ours[name]


class _Switch:
    """:func:`torch_names`'s result: a context manager restoring on exit what the call found."""

    def __init__(self, was: bool) -> None:
        self.was = was

    def __enter__(self) -> "_Switch":
        return self

    def __exit__(self, *exc: object) -> None:
        torch_names(self.was)


def torch_names(enabled: bool = True) -> _Switch:
    """Bind fsdp's ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, the handles,
    ``register_fsdp_forward_method`` and ``share_comm_ctx`` under torch's FSDP2 names, or
    (``enabled=False``) put torch's back, exactly. Idempotent, process-wide; as a context manager
    (``with fsdp.torch_names():``) restores what it found. Switch it on before a framework imports
    these names at module level. Raises ``TypeError`` for a non-bool."""
    global _SAVED
    if not isinstance(enabled, bool):
        raise TypeError(f"torch_names(enabled): pass True or False, got {enabled!r}")
    was = _SAVED is not None
    if enabled and not was:
        saved = {}
        for path, module, name, ours in _targets():
            saved[(path, name)] = getattr(module, name)
            setattr(module, name, ours)
        _SAVED = saved
    elif not enabled and was:
        for (path, name), theirs in _SAVED.items():
            setattr(importlib.import_module(path), name, theirs)
        _restore_pipelining(_SAVED)
        _SAVED = None
    return _Switch(was)


def _restore_pipelining(saved: dict[tuple[str, str], object]) -> None:
    """Give pipelining modules imported while the switch was on torch's objects back."""
    ours = {id(obj): name for name, obj in _ours().items()}
    for path in _PIPELINING:
        module = sys.modules.get(path)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            name = ours.get(id(value))
            if name is not None and (_PUBLIC[0], name) in saved:
                setattr(module, attr, saved[(_PUBLIC[0], name)])
