"""Every difference between the torch releases dbuffer and fsdp support (2.11 to 2.15), each
behind one small named function, so that no other module asks which torch it runs on.

Where torch has a name to look for, a function detects the *feature* (a name torch has or
lacks), so a torch in between (a nightly, a backport) gets whatever it actually has; only a fix
with no name to look for is told by version (:func:`dtensor_subclass_dispatch_bypassed`). Each
takes what it inspects as an argument with torch's as the default, or can be switched on, so
that a test on any torch drives the other branch (``tests/dbuffer/test_compat.py``).

The differences:

* c10d's one-call all-gather / reduce-scatter: ``all_gather_single`` / ``reduce_scatter_single``
  (2.13+; the old names remain as deprecated aliases that warn), ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` before (:func:`all_gather_name`, :func:`reduce_scatter_name`). Only
  the name differs: same arguments, same result. The calls themselves stay in
  :mod:`dbuffer.collectives`.
* DTensor subclasses' own ``__torch_dispatch__``: torch 2.11's C++ fast path for DTensor ops
  takes every *instance* of DTensor, subclasses included, so the ``__torch_dispatch__`` of
  dbuffer's :class:`~dbuffer.row_sharded.RowShardedDTensor` and
  :class:`~dbuffer.element_sharded.ElementShardedDTensor` never runs there (their ops would run
  as plain DTensor ops on the wrong pieces; ``nn.Parameter`` of one fails, since ``detach()``
  returns a plain DTensor). torch 2.12 keeps the fast path to the exact type (pytorch#177878).
  Where :func:`dtensor_subclass_dispatch_bypassed`, :func:`route_subclass_dispatch` gives their
  base a ``__torch_function__`` that runs each op under a dispatch mode handing the aten op to
  the subclass's ``__torch_dispatch__``: the same calls, with the same arguments, as on 2.12.
* DTensors on a ``"meta"`` mesh (``tools/plan_memory.py`` plans a fake world there): torch
  2.15's sharding propagation of ``detach`` prices redistributions from the mesh device's
  ``device_count()``, and ``"meta"`` has no device module, so ``nn.Parameter(dtensor)`` raises.
  :func:`meta_mesh_device_count` gives ``"meta"`` the CPU's count while a planner shards there.
* FSDP2's ``DataParallelMeshDims`` (fully_shard's ``dp_mesh_dims``; torch 2.12+):
  :func:`data_parallel_mesh_dims` gives torch's class, or a stand-in that raises
  :class:`~dbuffer.torch_version.TorchVersionError` naming the torch it needs when constructed;
  ``fully_shard(dp_mesh_dims=<anything>)`` raises the same (:func:`require_data_parallel_mesh_dims`).
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dbuffer.torch_version import parse, require

__all__ = [
    "DP_MESH_DIMS_TORCH",
    "all_gather_name",
    "data_parallel_mesh_dims",
    "dtensor_subclass_dispatch_bypassed",
    "meta_mesh_device_count",
    "reduce_scatter_name",
    "require_data_parallel_mesh_dims",
    "route_subclass_dispatch",
]

DP_MESH_DIMS_TORCH = (2, 12)  # the first torch with FSDP2's DataParallelMeshDims


# ---------------------------------------------------------------- c10d


def all_gather_name(c10d: ModuleType = dist) -> str:
    """The name of ``c10d``'s one-call all-gather into one tensor (``torch.distributed`` by
    default): ``"all_gather_single"`` where it exists, else ``"all_gather_into_tensor"`` (torch
    before 2.13, same arguments). The new name first: on 2.13+ the old one warns."""
    return "all_gather_single" if hasattr(c10d, "all_gather_single") else "all_gather_into_tensor"


def reduce_scatter_name(c10d: ModuleType = dist) -> str:
    """The name of ``c10d``'s one-call reduce-scatter of one tensor: ``"reduce_scatter_single"``
    where it exists, else ``"reduce_scatter_tensor"`` (torch before 2.13, same arguments)."""
    return "reduce_scatter_single" if hasattr(c10d, "reduce_scatter_single") else "reduce_scatter_tensor"


# ---------------------------------------------------------------- DTensor subclasses


def dtensor_subclass_dispatch_bypassed(version: Optional[str] = None) -> bool:
    """Whether DTensor's C++ fast path runs ops of DTensor *subclasses* itself, never calling
    their ``__torch_dispatch__``: torch 2.11 (``version``, default the installed torch's).
    By version, not by probing, because a probe needs a DTensor and so a process group, and
    the fix (pytorch#177878) has no name to look for."""
    return parse(torch.__version__ if version is None else version) < (2, 12)


class _SubclassRoute(TorchDispatchMode):
    """While active: each aten op with an operand of a subclass of ``base`` goes to that
    subclass's ``__torch_dispatch__`` (torch function re-enabled, as at the top level, so ops
    it runs on such tensors come back here); every other op runs as it would without the mode."""

    def __init__(self, base: type) -> None:
        super().__init__()
        self.base = base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = next((t for t in types if issubclass(t, self.base)), None)
        if owner is None:
            return func(*args, **kwargs)
        with torch._C._EnableTorchFunction():
            return owner.__torch_dispatch__(func, types, args, kwargs)


def route_subclass_dispatch(base: type, on: bool) -> None:
    """On: ``base`` (a DTensor subclass; its subclasses inherit it) gets a
    ``__torch_function__`` that runs every torch function on its instances under
    :class:`_SubclassRoute`, so that their ``__torch_dispatch__`` sees each aten op even where
    :func:`dtensor_subclass_dispatch_bypassed`. Off: removes it (torch's default again).
    ``dbuffer.pieces`` turns it on where needed; tests turn it on anywhere to run that path."""
    if not on:
        if "__torch_function__" in base.__dict__:
            delattr(base, "__torch_function__")
        return

    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass(), _SubclassRoute(base):
            return func(*args, **(kwargs or {}))

    base.__torch_function__ = classmethod(__torch_function__)


@contextlib.contextmanager
def meta_mesh_device_count() -> Iterator[None]:
    """While active, DTensor's sharding propagation works on a ``"meta"`` mesh on every torch.

    torch 2.15 prices the redistributions of an op's candidate placements (``detach`` among
    them, so ``nn.Parameter(dtensor)``; torch's own ``parallelize_module`` does that) from
    ``_mesh_resources.num_devices_per_host(mesh.device_type)``, i.e. the device module's
    ``device_count()``, and ``"meta"`` has no device module: every such op raises. Here
    ``"meta"`` counts one device per host, as ``"cpu"`` does (the price only ranks placements
    that give the same values). Other device types are asked as before; on exit the method is
    put back. For planners that shard on a fake world's meta mesh (``tools/plan_memory.py``)."""
    from torch.distributed.device_mesh import _mesh_resources

    env = type(_mesh_resources)
    original = env.__dict__["num_devices_per_host"]

    def num_devices_per_host(device_type: str) -> int:
        return 1 if device_type == "meta" else original.__func__(device_type)

    env.num_devices_per_host = staticmethod(num_devices_per_host)
    try:
        yield
    finally:
        env.num_devices_per_host = original


# ---------------------------------------------------------------- FSDP2's public names


def _dp_mesh_dims_missing() -> None:
    require(
        "DataParallelMeshDims (fully_shard's dp_mesh_dims)",
        DP_MESH_DIMS_TORCH,
        "Without it, pass fully_shard the data-parallel sub-mesh: mesh=full_mesh['dp_shard'] "
        "(HSDP: mesh=full_mesh['dp_replicate', 'dp_shard'])",
    )


class _DataParallelMeshDimsMissing:
    """Stands for FSDP2's ``DataParallelMeshDims`` on a torch without it (before 2.12), so that
    ``fsdp.DataParallelMeshDims`` exists on every supported torch and using it says why it
    cannot work: constructing one raises :class:`~dbuffer.torch_version.TorchVersionError`,
    naming the torch it needs and what to pass ``fully_shard`` instead."""

    def __init__(self, shard: Any = None, replicate: Any = None) -> None:
        """``shard`` / ``replicate``: FSDP2's mesh dim names (unused: this always raises
        ``TorchVersionError``)."""
        _dp_mesh_dims_missing()


_DataParallelMeshDimsMissing.__name__ = _DataParallelMeshDimsMissing.__qualname__ = "DataParallelMeshDims"


def data_parallel_mesh_dims(fsdp_module: Optional[ModuleType] = None) -> type:
    """FSDP2's ``DataParallelMeshDims`` (from ``fsdp_module``, default
    ``torch.distributed.fsdp``), or, where that torch lacks it (before 2.12), a class of the
    same name whose constructor raises :class:`~dbuffer.torch_version.TorchVersionError`."""
    if fsdp_module is None:
        import torch.distributed.fsdp as fsdp_module
    return getattr(fsdp_module, "DataParallelMeshDims", _DataParallelMeshDimsMissing)


def require_data_parallel_mesh_dims(fsdp_module: Optional[ModuleType] = None) -> None:
    """Raise :class:`~dbuffer.torch_version.TorchVersionError` where ``fsdp_module`` (default
    ``torch.distributed.fsdp``) has no ``DataParallelMeshDims``: ``fully_shard`` calls it when
    given ``dp_mesh_dims``, so any value there names the torch needed. Else nothing."""
    if data_parallel_mesh_dims(fsdp_module) is _DataParallelMeshDimsMissing:
        _dp_mesh_dims_missing()
