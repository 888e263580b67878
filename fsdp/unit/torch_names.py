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

``CPUOffloadPolicy``, ``OffloadPolicy`` and ``DataParallelMeshDims`` are torch's own classes in
fsdp too (the same objects), so they need no rebinding and work either way (torch 2.11 has no
``DataParallelMeshDims``: fsdp's is then a stand-in that raises, :mod:`dbuffer.compat`).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from fsdp.group.policy import MixedPrecisionPolicy
from fsdp.unit.fully_shard import fully_shard
from fsdp.unit.module import FSDPModule, UnshardHandle, register_fsdp_forward_method
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

_SAVED: Optional[dict[tuple[str, str], Any]] = None  # torch's objects while fsdp's are bound


def _ours() -> dict[str, Any]:
    return {
        "fully_shard": fully_shard,
        "FSDPModule": FSDPModule,
        "MixedPrecisionPolicy": MixedPrecisionPolicy,
        "UnshardHandle": UnshardHandle,
        "register_fsdp_forward_method": register_fsdp_forward_method,
        "share_comm_ctx": share_comm_ctx,
    }


def _targets():
    ours = _ours()
    for path in _PUBLIC + _CLASS_ONLY:
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
        _SAVED = None
    return _Switch(was)
