"""Exact DTensor views of a DBuffer's tensors, and exact broadcasts for state dicts.

DTensor's ``Shard(0)`` means "split like ``torch.chunk``" (nested per mesh axis), but a row-atomic
layout splits each tensor where the *buffer's* shard boundaries fall. :func:`make_dtensor`
therefore returns:

* a plain ``DTensor`` view when the placements shard nothing, or when the tensor's rows happen to
  be split exactly as DTensor expects;
* otherwise a :class:`~dbuffer.row_sharded.RowShardedDTensor` view: a DTensor that knows its true
  row ranges and is exact under every op (see :mod:`dbuffer.row_sharded` for how);
* for a 0-D tensor under sharding (DTensor cannot shard a scalar), a replicated copy;
* :func:`make_element_dtensor`: for a ragged layout's tensor cut mid-row, an
  :class:`~dbuffer.element_sharded.ElementShardedDTensor` over its 1-D element range.

DTensor does not know dbuffer's ``Owned()`` placement, so views of an Owned buffer say
``Shard(0)``: the owner's piece is every row, the others' pieces are empty.

For state dicts it also offers :func:`row_range` (which rows of the full tensor a DTensor's local
piece holds, for both kinds) and :func:`broadcast_` / :func:`broadcast_object` (one rank's tensor
or object to every rank, bit for bit), so that a full tensor held by rank 0 can be loaded into
row-sharded parameters and optimizer state.

This module takes plain values (a local tensor, a mesh, rows), not a DBuffer, so that
:mod:`dbuffer.buffer` can import it without a cycle.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from dbuffer import collectives
from dbuffer.broadcast import broadcast_, broadcast_object
from dbuffer.placements import Owned, is_shard, sharded_axes
from dbuffer.element_sharded import ElementShardedDTensor, element_range
from dbuffer.row_sharded import RowShardedDTensor, chunk_rows, row_range
from dbuffer.view import contiguous_stride, dtensor_view

__all__ = [
    "ElementShardedDTensor",
    "RowShardedDTensor",
    "broadcast_",
    "broadcast_object",
    "chunk_rows",
    "element_range",
    "make_dtensor",
    "make_element_dtensor",
    "row_range",
]


def dtensor_placements(placements: Sequence[Any]) -> tuple:
    """A DBuffer's placements as DTensor placements: ``Owned()`` becomes ``Shard(0)``."""
    return tuple(Shard(0) if isinstance(p, Owned) else p for p in placements)


def make_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Any],
    shape: Sequence[int],
    rows_per_shard: Sequence[int],
    shard: int,
) -> DTensor:
    """The DTensor view of ``local``: this rank's rows (shard ``shard`` of ``rows_per_shard``,
    row-major over the sharded mesh axes) of a tensor of ``shape`` placed by the DBuffer
    ``placements`` (``Owned()`` allowed)."""
    shape = torch.Size(shape)
    stride = contiguous_stride(shape)
    dt_placements = dtensor_placements(placements)
    axes = sharded_axes(placements)
    if not axes:
        return dtensor_view(local, mesh, dt_placements, shape, stride)
    if len(shape) == 0:
        return _replicated_scalar(local, mesh, placements)
    rows = tuple(rows_per_shard)
    if rows == chunk_rows(shape[0], [mesh.shape[a] for a in axes]):
        return dtensor_view(local, mesh, dt_placements, shape, stride)
    spec = DTensorSpec(mesh, dt_placements, TensorMeta(shape, stride, local.dtype))
    return RowShardedDTensor.wrap(local, spec, rows, sum(rows[:shard]))


def make_element_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Any],
    shape: Sequence[int],
    elements_per_shard: Sequence[int],
    start: int,
) -> ElementShardedDTensor:
    """The DTensor view of ``local``: this rank's elements ``[start, start + local.numel())`` of
    the flattened tensor of ``shape`` (1-D), ``elements_per_shard`` the counts of every shard
    (row-major over the sharded mesh axes), placed by the DBuffer ``placements``."""
    shape = torch.Size(shape)
    spec = DTensorSpec(mesh, dtensor_placements(placements), TensorMeta(shape, contiguous_stride(shape), local.dtype))
    return ElementShardedDTensor.wrap(local, spec, tuple(elements_per_shard), start)


def _replicated_scalar(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Any]) -> DTensor:
    value = local.sum() if local.numel() else local.new_zeros(())
    for axis in sharded_axes(placements):
        collectives.all_reduce(value, "sum", mesh.get_group(axis))
    placements = [Replicate() if is_shard(p) else p for p in placements]
    return DTensor.from_local(value, mesh, placements, run_check=False)

