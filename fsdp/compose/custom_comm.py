"""FSDP2's communication objects on fsdp's flat buffers: ``set_custom_all_gather``,
``set_custom_reduce_scatter`` and the comm-memory setters built on them.

FSDP2's protocols (torch 2.13, ``_fsdp_api``) share ``allocate(size, *, dtype, device) -> Tensor``:
``AllGather.__call__(output_tensor=, input_tensor=, group=, async_op=) -> Work | None``,
``ReduceScatter.__call__(output_tensor=, input_tensor=, group=, op=, async_op=) -> Work | None``.
A group with one calls it for its shard-axis gather or gradient reduce-scatter, on the flat,
shard-major tensors dbuffer would hand c10d. As in FSDP2 the collective runs on tensors
``allocate`` made, copied into (out of) fsdp's persistent buffers; an object with FSDP2's default
``allocate`` gets fsdp's buffers directly.

The reduce op is dbuffer's (``AVG`` where the backend has it, else ``SUM`` and a division), so a
torch.distributed-backed object gives bitwise dbuffer's result. dbuffer's collectives stay for the
HSDP all-reduce across replicas (as FSDP2's ``dist.all_reduce``), ``Owned()`` groups, the regather
of ``reshard_after_forward=n`` and all-reduces of unsharded gradients.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer import DBuffer, Pending, collectives
from dbuffer.collectives import c10d_reduce_op
from fsdp.group.comms import DBUFFER_COMMS
from fsdp.group.streams import CommStreams

if TYPE_CHECKING:
    from torch.distributed import Work

    from fsdp.group.comms import AllGatherComm, ReduceScatterComm
    from fsdp.group.param_group import ParameterGroup

try:  # FSDP2's default allocator mixin: torch.empty, nothing an extra copy would buy
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin as _DefaultAlloc
except ImportError:  # pragma: no cover - another torch
    _DefaultAlloc = None

__all__ = [
    "CustomComms", "MemoryAllGather", "MemoryReduceScatter", "all_gather", "check_comm", "install", "memory_comms",
    "reduce_scatter", "routes",
]


def check_comm(comm: object, what: str, needs: str) -> None:
    """``comm`` implements FSDP2's protocol (duck-typed: ``allocate`` and ``__call__``)."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{what}: comm must implement torch.distributed.fsdp's {needs} protocol: a callable object "
            f"with allocate(size, *, dtype, device); got {type(comm).__name__}"
        )


class CustomComms:
    """Group comms (:mod:`fsdp.group.comms`) via FSDP2's comm objects, as :func:`routes` says."""

    def __init__(self, all_gather_comm: Optional[AllGatherComm] = None,
                 reduce_scatter_comm: Optional[ReduceScatterComm] = None) -> None:
        self.all_gather_comm = all_gather_comm
        self.reduce_scatter_comm = reduce_scatter_comm

    def all_gather(self, source: DBuffer, placements: tuple, target: DBuffer) -> Pending:
        comm = self.all_gather_comm
        if comm is not None and routes(source, placements):
            return all_gather(comm, source, target)
        return source.redistribute(placements, out=target, async_op=True)

    def reduce(self, source: DBuffer, placements: tuple, out: DBuffer,
               async_op: bool = True) -> Union[Pending, DBuffer]:
        comm = self.reduce_scatter_comm
        if comm is None or not routes(source, placements):
            return source.redistribute(placements, out=out, async_op=async_op)
        if tuple(placements[:-1]) == tuple(source.placements[:-1]):
            pending = reduce_scatter(comm, source, out)
        else:  # HSDP: reduce-scatter in the shard group, then dbuffer's all-reduce across replicas
            mid_placements = tuple(source.placements[:-1]) + tuple(placements[-1:])
            mid = source.sibling(mid_placements, out.dtype, zero_fill=False)
            pending = reduce_scatter(comm, source, mid).wait().redistribute(placements, out=out, async_op=True)
        return pending if async_op else pending.wait()


_KEEP = object()


def install(group: ParameterGroup, all_gather_comm: object = _KEEP, reduce_scatter_comm: object = _KEEP) -> None:
    """Give ``group`` these comm objects (one not passed is kept); with neither, dbuffer's own."""
    have = group.comms
    gather = have.all_gather_comm if all_gather_comm is _KEEP else all_gather_comm
    reduce = have.reduce_scatter_comm if reduce_scatter_comm is _KEEP else reduce_scatter_comm
    group.comms = CustomComms(gather, reduce) if gather is not None or reduce is not None else DBUFFER_COMMS
    group.replan()


def _default_alloc(comm: Union[AllGatherComm, ReduceScatterComm]) -> bool:
    return _DefaultAlloc is not None and getattr(type(comm), "allocate", None) is _DefaultAlloc.allocate


def routes(source: DBuffer, after: tuple) -> bool:
    """Whether ``source`` -> ``after`` is a gather (``Shard`` -> ``Replicate``) or reduce-scatter
    (``Partial`` -> ``Shard``) on the shard axis of a packed buffer: what a comm object replaces."""
    if source.is_owned:
        return False
    have, want = source.placements[-1], after[-1]
    gather = isinstance(have, Shard) and isinstance(want, Replicate)
    reduce = isinstance(have, Partial) and isinstance(want, Shard)
    return gather or reduce


def _flat(t: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    if t.numel() != numel or not t.is_contiguous():
        raise ValueError(f"{what}.allocate returned a tensor of {t.numel()} elements (contiguous: "
                         f"{t.is_contiguous()}); it must return {numel} contiguous elements")
    return t.view(-1)


def _finish(work: Optional[Work], then: Callable[[], DBuffer]) -> Pending:
    return Pending([work], then)


def all_gather(comm: AllGatherComm, source: DBuffer, target: DBuffer) -> Pending:
    """Gather the shard group's ``source`` shards into ``target`` by ``comm``; wait() returns it."""
    axis = source.mesh.ndim - 1
    group = source.mesh.get_group(axis)
    shard, full = source.local_buffer, target.local_buffer
    direct = _default_alloc(comm)
    out = full if direct else _flat(comm.allocate((full.numel(),), dtype=full.dtype, device=full.device),
                                    full.numel(), "all-gather comm")
    work = comm(output_tensor=out, input_tensor=shard, group=group, async_op=True)

    def finish() -> DBuffer:
        if out is not full:
            full.copy_(out)
            _keep_until_used(out)
        return target

    return _finish(work, finish)


def reduce_scatter(comm: ReduceScatterComm, source: DBuffer, target: DBuffer) -> Pending:
    """``target`` = this rank's chunk of ``source`` reduced over the shard group, by ``comm``;
    ``wait()`` returns ``target``."""
    axis = source.mesh.ndim - 1
    group, size = source.mesh.get_group(axis), source.mesh.shape[axis]
    full, shard = source.local_buffer, target.local_buffer
    if size == 1:  # as FSDP2: nothing to reduce, no call
        shard.copy_(full)
        return Pending([], lambda: target)
    op, divide = c10d_reduce_op(source.placements[axis].reduce_op, group)
    direct = _default_alloc(comm)
    if direct:
        inp, out = full, shard
    else:
        inp = _flat(comm.allocate((full.numel(),), dtype=full.dtype, device=full.device), full.numel(), "reduce-scatter comm")
        inp.copy_(full)
        out = _flat(comm.allocate((shard.numel(),), dtype=shard.dtype, device=shard.device), shard.numel(), "reduce-scatter comm")
    work = comm(output_tensor=out, input_tensor=inp, group=group, op=op, async_op=True)

    def finish() -> DBuffer:
        if out is not shard:
            shard.copy_(out)
            _keep_until_used(inp, out)
        if divide:
            shard.div_(size)
        return target

    return _finish(work, finish)


def _keep_until_used(*tensors: torch.Tensor) -> None:
    """Staging tensors from a comm side stream's pool, just read on the current stream: each side
    stream's next launch waits for an event recorded after the read before reusing the memory (as
    FSDP2 orders its copy-out; no ``record_stream``: :mod:`fsdp.group.streams`, item 5)."""
    for device in {t.device for t in tensors}:
        streams = CommStreams.for_device(device)
        streams.after_read(streams.record())


class _MemoryComm:
    """FSDP2's comm-memory setters: process-group or symmetric memory, dbuffer's collective."""

    def __init__(self, allocate: Optional[Callable[[int, torch.dtype], torch.Tensor]], symmetric: bool) -> None:
        self._allocate = allocate
        self.symmetric = symmetric

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(n) for n in size)
        if self._allocate is None:  # the backend has no allocator of its own (gloo): as FSDP2
            return torch.empty(numel, dtype=dtype, device=device)
        return self._allocate(numel, dtype)


class MemoryAllGather(_MemoryComm):
    """The all-gather of :func:`memory_comms`."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if self.symmetric:  # an in-place style gather: only the output need be symmetric
            collectives.rendezvous_symmetric(output_tensor, group)
        return collectives.all_gather(output_tensor, input_tensor, group, async_op)


class MemoryReduceScatter(_MemoryComm):
    """The reduce-scatter of :func:`memory_comms`."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        name = collectives.reduce_op_name(op)
        if self.symmetric and name == "sum":  # NCCL's symmetric reduce-scatter only sums
            collectives.rendezvous_symmetric(input_tensor, group)
            collectives.rendezvous_symmetric(output_tensor, group)
        return collectives.reduce_scatter(output_tensor, input_tensor, name, group, async_op)


def memory_comms(kind: str, mesh: DeviceMesh, device: torch.device, backend: str = "NCCL"):
    """``(all_gather, reduce_scatter)`` for ``mesh``'s shard axis, allocating from the process group
    (``kind="process_group"``; None without an allocator) or symmetric memory (collective)."""
    group = mesh.get_group(mesh.ndim - 1)
    if kind == "process_group":
        allocate = collectives.group_allocator(group, device)
        if allocate is None:
            return None
        return MemoryAllGather(allocate, False), MemoryReduceScatter(allocate, False)
    allocate = collectives.symmetric_allocator(group, device, backend)
    return MemoryAllGather(allocate, True), MemoryReduceScatter(allocate, True)
