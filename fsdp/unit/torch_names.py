"""fsdp under torch's names: a switch for frameworks that call torch FSDP2 themselves.

Hugging Face accelerate / ``Trainer``, Lightning Fabric and torchtitan call
``torch.distributed.fsdp.fully_shard`` and test ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
in their own code, so changing a user's import is not enough. :func:`torch_names` binds fsdp's
objects under torch's public FSDP2 names; off, it puts torch's objects back, exactly.

Why rebinding the names, and not making fsdp's module class also a subclass of torch's
``FSDPModule``: torch's own code (DCP's state-dict helpers, ``clip_grad_norm_`` paths, the FSDP2
internals) tests that class and then reaches into FSDP2's private state (``_get_fsdp_state``,
``FSDPParamGroup``), which fsdp does not have; an fsdp module that claimed to be one would break
there. Rebinding changes only what a name looked up *after* the switch gives: code that runs
``from torch.distributed.fsdp import fully_shard`` (or reads ``torch.distributed.fsdp.FSDPModule``)
inside its functions, as these frameworks do, gets fsdp's; torch's internals, which bound their
names at import, keep torch's. So switch it on before the framework imports those names at
module level, and keep one implementation per process: the switch is process-wide, as the names are.

One part of torch is rebound on purpose: ``torch.distributed.pipelining`` binds ``FSDPModule``,
``fully_shard`` and the handles at import and, for a stage module that is an ``FSDPModule``,
drives the stage's gradient sync through them (``set_manual_backward_finalization``,
``finalize_backward``; before torch 2.15 the private names :mod:`fsdp.unit.pipelining` answers).
So its modules, if already imported, are rebound too, and a pipeline of fsdp stages works
whichever was imported first.

``CPUOffloadPolicy``, ``OffloadPolicy`` and ``DataParallelMeshDims`` are torch's own classes in
fsdp too (the same objects), so they need no rebinding and work either way (torch 2.11 has no
``DataParallelMeshDims``: fsdp's is then a stand-in that raises, :mod:`dbuffer.compat`).
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

# Where torch exposes FSDP2's public names (the old ``_composable`` path included), and the
# private module that defines the class, where frameworks also import ``FSDPModule`` from.
_PUBLIC = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
_CLASS_ONLY = ("torch.distributed.fsdp._fully_shard._fully_shard",)
# Modules that bound FSDP2's names at their import and drive FSDP2 stages through them: rebound
# when already imported (a later import takes the names from torch.distributed.fsdp anyway).
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
    """What :func:`torch_names` returns: as a context manager, it restores on exit the state the
    call found."""

    def __init__(self, was: bool) -> None:
        self.was = was

    def __enter__(self) -> "_Switch":
        return self

    def __exit__(self, *exc: object) -> None:
        torch_names(self.was)


def torch_names(enabled: bool = True) -> _Switch:
    """Bind fsdp's ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``UnshardHandle``,
    ``register_fsdp_forward_method`` and ``share_comm_ctx`` under torch's FSDP2 names
    (``torch.distributed.fsdp``, its ``_fully_shard`` modules, ``torch.distributed._composable.fsdp``),
    or (``enabled=False``) put torch's back, exactly. Idempotent, process-wide. Use it as a call
    (on until ``torch_names(False)``) or a context manager (``with fsdp.torch_names(): ...``
    restores what it found). Switch it on before a framework imports these names at module level.
    Raises ``TypeError`` for a non-bool."""
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
    """Pipelining modules imported while the switch was on bound fsdp's objects: give them
    torch's (as ``torch.distributed.fsdp`` had them)."""
    ours = {id(obj): name for name, obj in _ours().items()}
    for path in _PIPELINING:
        module = sys.modules.get(path)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            name = ours.get(id(value))
            if name is not None and (_PUBLIC[0], name) in saved:
                setattr(module, attr, saved[(_PUBLIC[0], name)])
