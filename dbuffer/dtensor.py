"""Exact DTensor views of a DBuffer's tensors.

DTensor's ``Shard(0)`` means "split like ``torch.chunk``" (nested per mesh axis), but a row-atomic
layout splits each tensor where the *buffer's* shard boundaries fall, so rank 0 may hold 0 rows
of a tensor and rank 1 all of them. A plain DTensor built on such a local piece would report the
wrong global offsets to DCP and compute ``full_tensor()`` from the wrong sizes (it pads to chunk
sizes and hangs or returns garbage). :func:`make_dtensor` therefore returns:

* a plain ``DTensor`` view when the placements shard nothing, or when the tensor's rows happen to
  be split exactly as DTensor expects;
* otherwise a :class:`RowShardedDTensor` view: a DTensor (elementwise ops, optimizers,
  norms and ``torch.nn.utils.clip_grad_norm_`` work on it as on any DTensor) that knows its true
  row ranges, and uses them for ``full_tensor()``, ``redistribute(..., [Replicate()]*n)`` and the
  DCP hooks (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``);
* for a 0-D tensor under sharding (DTensor cannot shard a scalar), a replicated copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from dbuffer import collectives
from dbuffer.placements import sharded_axes

if TYPE_CHECKING:
    from dbuffer.buffer import DBuffer

__all__ = ["RowShardedDTensor", "chunk_rows", "make_dtensor"]


def chunk_rows(num_rows: int, axis_sizes: Sequence[int]) -> tuple[int, ...]:
    """Rows per shard that DTensor assumes for ``Shard(0)`` on axes of ``axis_sizes`` (nested
    ``torch.chunk``, outer axis first), in row-major shard order."""
    pieces = [num_rows]
    for size in axis_sizes:
        nxt = []
        for rows in pieces:
            step = -(-rows // size) if rows else 0
            nxt.extend(max(0, min(step, rows - k * step)) for k in range(size))
        pieces = nxt
    return tuple(pieces)


def make_dtensor(buf: "DBuffer", i: int) -> DTensor:
    item = buf.layout.items[i]
    local = buf.get_local_tensor(i)
    shape, stride = torch.Size(item.shape), _contiguous_stride(item.shape)
    if buf.num_shards == 1:
        return DTensor.from_local(local, buf.mesh, buf.placements, run_check=False, shape=shape, stride=stride)
    if len(item.shape) == 0:
        return _replicated_scalar(buf, local)
    axes = sharded_axes(buf.placements)
    rows = buf.layout.rows_per_shard(i, buf.num_shards)
    if rows == chunk_rows(item.num_rows, [buf.mesh.shape[a] for a in axes]):
        return DTensor.from_local(local, buf.mesh, buf.placements, run_check=False, shape=shape, stride=stride)
    spec = DTensorSpec(buf.mesh, tuple(buf.placements), TensorMeta(shape, stride, buf.dtype))
    out = RowShardedDTensor(local, spec, requires_grad=False)
    out._rows_per_shard = rows
    out._row_start = sum(rows[: buf.shard_index])
    return out


class RowShardedDTensor(DTensor):
    """A DTensor whose ``Shard(0)`` pieces are arbitrary contiguous row ranges (one per shard,
    row-major over the sharded mesh axes), as a row-atomic DBuffer layout produces them."""

    _rows_per_shard: tuple[int, ...]
    _row_start: int

    @torch.no_grad()
    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank (a new tensor; not differentiable)."""
        mesh, placements = self.device_mesh, self.placements
        local = self._local_tensor
        for axis, p in enumerate(placements):
            if isinstance(p, Partial):
                local = local.clone() if local is self._local_tensor else local
                collectives.all_reduce(local, p.reduce_op, mesh.get_group(axis))
        row_shape = tuple(self.shape[1:])
        most = max(self._rows_per_shard)
        padded = local.new_zeros((most, *row_shape))
        padded[: local.shape[0]] = local
        gathered = padded.reshape(-1)
        for axis in reversed(sharded_axes(placements)):
            out = gathered.new_empty(gathered.numel() * mesh.shape[axis])
            collectives.all_gather(out, gathered, mesh.get_group(axis))
            gathered = out
        pieces = gathered.view(len(self._rows_per_shard), most, *row_shape)
        return torch.cat([pieces[k, :rows] for k, rows in enumerate(self._rows_per_shard)])

    def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False, **kwargs):  # type: ignore[override]
        mesh = device_mesh or self.device_mesh
        if mesh != self.device_mesh or placements is None or not all(isinstance(p, Replicate) for p in placements):
            raise NotImplementedError(
                "a RowShardedDTensor (row ranges of a DBuffer) redistributes only to "
                "[Replicate()] * mesh.ndim on its own mesh; redistribute the DBuffer instead"
            )
        return DTensor.from_local(self.full_tensor(), mesh, list(placements), run_check=False)

    def detach(self) -> "RowShardedDTensor":  # type: ignore[override]
        """Keep the subclass (and its row ranges): ``nn.Parameter(x)`` requires ``detach()`` to
        return the same type, and FSDP-style sharded parameters are Parameters of these views."""
        out = RowShardedDTensor(self._local_tensor.detach(), self._spec, requires_grad=False)
        out._rows_per_shard = self._rows_per_shard
        out._row_start = self._row_start
        return out

    # DCP: describe the true piece instead of the torch.chunk one.
    def _chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        offsets = torch.Size([self._row_start] + [0] * (self.dim() - 1))
        return ChunkStorageMetadata(offsets=offsets, sizes=self._local_tensor.shape)

    def __create_write_items__(self, fqn: str, object: Any):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self._raise_if_contains_partial_placements()
        if self._local_tensor.shape[0] == 0:  # this rank holds none of the rows
            return []
        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._local_tensor),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self):
        self._raise_if_contains_partial_placements()
        return [] if self._local_tensor.shape[0] == 0 else [self._chunk()]

    def __get_tensor_shard__(self, index):
        return self._local_tensor


def _replicated_scalar(buf: "DBuffer", local: torch.Tensor) -> DTensor:
    value = local.sum() if local.numel() else local.new_zeros(())
    for axis in sharded_axes(buf.placements):
        collectives.all_reduce(value, "sum", buf.mesh.get_group(axis))
    placements = [Replicate() if isinstance(p, Shard) else p for p in buf.placements]
    return DTensor.from_local(value, buf.mesh, placements, run_check=False)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))

