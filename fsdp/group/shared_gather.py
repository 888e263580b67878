"""One all-gather for several groups of a unit, as FSDP2 gathers a unit's parameters in one collective.

A unit has one group per (dtype, ``requires_grad``, mesh) bucket. Groups whose plan lets them
share (``Sharing.MAY_SHARE``: ZeRO-3, the chunked layout's rank-major rows they copy out of anyway,
dbuffer's comms; :meth:`~fsdp.group.unsharder.Unsharder.can_share_gather`) pack their shards into
one byte shard, gathered once; each joins it (:meth:`~fsdp.group.unsharder.Unsharder.join_gather`)
and copies its columns out when it waits (:meth:`~fsdp.group.unsharder.Unsharder.wait_unshard`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from dbuffer import DBuffer, Pending, PreparedSlot
from dbuffer.layout import compute_layout
from fsdp.group.profiling import label
from fsdp.group.parts import GatherKind

if TYPE_CHECKING:
    from fsdp.group.param_group import ParameterGroup

__all__ = ["SharedGather", "gather_together"]

_ALIGN = 16  # byte offset of each group's part, so every dtype view of it is aligned


def can_share(groups: Sequence[ParameterGroup]) -> bool:
    """Whether one collective serves ``groups``: two or more, same mesh, placements and device."""
    if len(groups) < 2:
        return False
    first = groups[0]
    return all(
        g.mesh is first.mesh and g.placements.sharded == first.placements.sharded
        and g.placements.replicated == first.placements.replicated and g.compute_device == first.compute_device
        for g in groups
    )


class SharedGather:
    """Packed send and receive buffers of ``groups``, sized by ``sources``; storage only in use."""

    def __init__(self, groups: Sequence[ParameterGroup], sources: Sequence[DBuffer]) -> None:
        first = groups[0]
        self.world = first.mesh.shape[-1]
        self.parts: list[tuple[int, int, torch.dtype]] = []  # (byte offset, bytes, dtype) per group
        pos = 0
        for src in sources:
            nbytes = src.local_buffer.numel() * src.dtype.itemsize
            self.parts.append((pos, nbytes, src.dtype))
            pos = -(-(pos + nbytes) // _ALIGN) * _ALIGN
        self.shard_bytes = max(pos, _ALIGN)
        flat = [(self.world * self.shard_bytes,)]
        layout = compute_layout(flat, self.world)
        common = dict(layout=layout, zero_fill=False, check_ranks=False)
        self.send = DBuffer(first.mesh, first.placements.sharded, flat, torch.uint8, first.compute_device, **common)
        self.recv = DBuffer(first.mesh, first.placements.replicated, flat, torch.uint8, first.compute_device, **common)
        self.replicated = first.placements.replicated
        self.call_label = first.call_label
        self.send.release_storage()
        self.recv.release_storage()
        self._gather = PreparedSlot()  # send -> recv, both kept: prepared once
        self.key = self.key_of(sources)
        self._waiting = 0  # groups that have not copied their part out yet

    @staticmethod
    def key_of(sources: Sequence[DBuffer]) -> tuple:
        """What the packing depends on: each source's size and dtype."""
        return tuple((src.local_buffer.numel(), src.dtype) for src in sources)

    def launch(self, sources: Sequence[DBuffer]) -> Pending:
        """Pack ``sources`` and start the all-gather on the current stream (the caller opens the
        all-gather stream's launch)."""
        with label("fsdp::all_gather", call=self.call_label):
            self.send.reallocate_storage()
            self.recv.reallocate_storage()
            local = self.send.local_buffer
            for (offset, nbytes, _), src in zip(self.parts, sources):
                local[offset : offset + nbytes].copy_(src.local_buffer.view(torch.uint8))
            self._waiting = len(self.parts)
            return self._gather.start(self.send, self.replicated, self.recv)

    def rows(self, i: int) -> torch.Tensor:
        """Group ``i``'s gathered part: ``[world, shard numel]`` in its dtype."""
        offset, nbytes, dtype = self.parts[i]
        return self.recv.local_buffer.view(self.world, self.shard_bytes)[:, offset : offset + nbytes].view(dtype)

    def copied_out(self) -> None:
        """One group has copied its part out; the last one frees the buffers."""
        self._waiting -= 1
        if self._waiting == 0:
            self.send.release_storage()
            self.recv.release_storage()


def shared_gather_for(cache: dict, groups: Sequence[ParameterGroup], sources: Sequence[DBuffer]) -> SharedGather:
    """The :class:`SharedGather` of ``groups`` in ``cache``, rebuilt when ``sources`` changed."""
    key = tuple(id(g) for g in groups)
    shared: Optional[SharedGather] = cache.get(key)
    if shared is None or shared.key != SharedGather.key_of(sources):
        shared = cache[key] = SharedGather(groups, sources)
    return shared


def gather_together(groups: Sequence[ParameterGroup], cache: dict) -> list[ParameterGroup]:
    """Launch one gather for those of ``groups`` that need one and can share it; return them
    ([]: each gathers alone). ``cache``: the unit's :class:`SharedGather` objects."""
    if len(groups) < 2:
        return []
    batch = [g for g in groups if g.unsharder.can_share_gather() and g.unsharder.needs_gather()]  # refreshed by the unit already
    if not can_share(batch):
        return []
    for g in batch:  # on the compute stream: a released model shard is cast again
        g.weights.begin_gather(GatherKind.SHARED)
    streams = batch[0].streams
    with streams.launch(streams.all_gather):
        sources = [g.weights.gather_source() for g in batch]
        shared = shared_gather_for(cache, batch, sources)
        pending = shared.launch(sources)
    for index, g in enumerate(batch):
        g.unsharder.join_gather(pending, shared, index)
    return batch
