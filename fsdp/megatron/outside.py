"""What a rank outside a DBuffer's mesh holds: Megatron-FSDP lets it build the buffer (its layout,
and for placements that shard nothing the whole local buffer), as when a test or a tool builds a
2-rank buffer on every rank of a larger world. dbuffer builds buffers only on their mesh's ranks
(its constructor checks every rank agrees, a collective over the mesh), so
:class:`~fsdp.megatron.buffer.DBuffer` holds an :class:`OutsideMesh` there instead of a
:class:`dbuffer.DBuffer`: the same local answers, and a ``ValueError`` naming the mesh for
anything that needs the mesh's ranks (a collective, a scatter, a DTensor view).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from dbuffer import Layout

__all__ = ["OutsideMesh"]


class OutsideMesh:
    """The local part of a buffer on a rank outside ``mesh``: the whole buffer under
    ``placements`` that shard nothing (``ValueError`` for a sharded one, whose piece this rank
    has none of), zero-filled unless ``local_buffer`` is given (no copy)."""

    shard_index = 0
    num_shards = 1

    def __init__(
        self, mesh: DeviceMesh, placements: Sequence[Placement], layout: Layout, dtype: torch.dtype,
        device, local_buffer: torch.Tensor | None = None,
    ) -> None:
        if any(isinstance(p, Shard) for p in placements):
            raise ValueError(f"this rank is not part of the mesh {mesh}, so it holds no shard of a Flat() buffer")
        self.mesh, self.placements, self.layout = mesh, tuple(placements), layout
        numel = layout.shard_numel_for(1)
        if local_buffer is None:
            local_buffer = torch.zeros(numel, dtype=dtype, device=device)
        elif local_buffer.dim() != 1 or local_buffer.numel() != numel or not local_buffer.is_contiguous():
            raise ValueError(f"local_buffer must be a contiguous 1-D tensor of {numel} elements, got {tuple(local_buffer.shape)}")
        self.local_buffer = local_buffer
        self._capacity = local_buffer.untyped_storage().nbytes()

    @property
    def dtype(self) -> torch.dtype:
        return self.local_buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.local_buffer.device

    def get_local_tensor(self, i: int) -> torch.Tensor:
        item = self.layout.items[i]
        return self.local_buffer[item.offset : item.offset + item.numel].view(item.shape)

    def local_piece(self, i: int, full: torch.Tensor) -> torch.Tensor:
        return full.reshape(self.layout.items[i].shape)

    def release_storage(self) -> None:
        self.local_buffer.untyped_storage().resize_(0)

    def reallocate_storage(self) -> None:
        if self.local_buffer.untyped_storage().nbytes() != self._capacity:
            self.local_buffer.untyped_storage().resize_(self._capacity)

    def cast(self, dtype: torch.dtype, out=None) -> "OutsideMesh":
        target = out if out is not None else OutsideMesh(self.mesh, self.placements, self.layout, dtype, self.device)
        target.local_buffer.copy_(self.local_buffer)
        return target

    def _refuse(self, *args, **kwargs):
        raise ValueError(
            f"this rank is not part of the mesh {self.mesh}: its DBuffer has the layout and the local buffer "
            f"only; run collectives, scatters and DTensor views on the mesh's ranks"
        )

    allgather = allreduce = reduce_scatter = scatter = redistribute = get_dtensor = sibling = _refuse
