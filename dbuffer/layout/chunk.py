"""The chunk layout (:class:`ChunkLayout`, :func:`compute_chunk_layout`): every tensor split like
``torch.chunk(full, n, dim)`` along any dim (torch FSDP2's layout, asked for by
``shard_placement_fn``). Pure: no torch.

Every shard is the concatenation of its padded piece of every tensor, so a gathered buffer is
shard-major and a full tensor is not a view of it (a copy-out; and a copy-in for gradients). It
describes where things are; it does not pack rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from dbuffer.layout.common import _as_int, _check_inputs, _Numels


@dataclass(frozen=True)
class ChunkItem:
    """One tensor of a :class:`ChunkLayout`, split along ``dim`` into pieces of ``chunk`` indices
    (the last ones short or empty), as ``torch.chunk`` splits it. Every shard reserves
    ``chunk * inner`` elements for it from ``offset``; its piece, contiguous in its own shape
    (``shape`` with ``shape[dim]`` replaced by the piece's length), fills that from the start."""

    shape: tuple[int, ...]
    dim: int
    offset: int  # start of the tensor's slot in every shard, in elements
    chunk: int  # ceil(shape[dim] / num_shards): length along dim of a whole piece
    inner: int  # elements per index along dim: prod(shape) / shape[dim] (prod of the other dims)

    @property
    def length(self) -> int:  # shape[dim]
        return self.shape[self.dim]

    @property
    def numel(self) -> int:
        return self.length * self.inner


@dataclass(frozen=True)
class ChunkLayout(_Numels):
    """``num_shards`` shards of ``shard_numel`` elements; shard ``i`` holds
    ``torch.chunk(t, num_shards, dim)[i]`` of every tensor ``t`` (empty where torch.chunk gives
    fewer pieces), in registration order, each in its own slot (see :class:`ChunkItem`)."""

    items: tuple[ChunkItem, ...]
    num_shards: int
    shard_numel: int

    def piece(self, item: int, index: int) -> tuple[int, int]:
        """``(start, length)`` along the item's dim of shard ``index``'s piece: torch.chunk's."""
        if not 0 <= index < self.num_shards:
            raise IndexError(f"shard index {index} is out of range for num_shards={self.num_shards}")
        it = self.items[item]
        start = min(index * it.chunk, it.length)
        return start, min(start + it.chunk, it.length) - start

    def piece_shape(self, item: int, index: int) -> tuple[int, ...]:
        it = self.items[item]
        return it.shape[: it.dim] + (self.piece(item, index)[1],) + it.shape[it.dim + 1 :]

    def local_range(self, item: int, index: int) -> tuple[int, int]:
        """Where shard ``index``'s piece of ``item`` lies in that shard, as ``[start, end)``."""
        it = self.items[item]
        return it.offset, it.offset + self.piece(item, index)[1] * it.inner

    def whole_pieces(self, item: int) -> int:
        """How many shards hold a whole piece (``chunk`` indices): the first ones; after them at
        most one shard holds a short piece, the rest nothing."""
        it = self.items[item]
        return it.length // it.chunk if it.chunk else 0

    def padding(self, index: int) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of shard ``index`` that belong to no tensor, in order."""
        gaps, pos = [], 0
        for k in range(len(self.items)):
            start, end = self.local_range(k, index)
            if start > pos:
                gaps.append((pos, start))
            pos = end
        if pos < self.shard_numel:
            gaps.append((pos, self.shard_numel))
        return [(a, b) for a, b in gaps if b > a]


def compute_chunk_layout(
    shapes: Sequence[Sequence[int]], dims: Sequence[int], num_shards: int, *, align: int = 1
) -> ChunkLayout:
    """Lay out ``shapes``, tensor ``k`` split along ``dims[k]`` (``0 <= dims[k] < len(shape)``)
    like ``torch.chunk`` into ``num_shards`` pieces. Slots follow registration order; the shard
    size is the sum of the slots (each ``ceil(shape[dim] / n) * inner``), rounded up to ``align``.
    Padding is at most ``(n - 1) * inner`` elements per tensor (what torch.chunk leaves short)."""
    n, align, dims_list, _ = _check_inputs(shapes, num_shards, align)
    dims = [_as_int(d, f"dims[{k}]") for k, d in enumerate(dims)]
    if len(dims) != len(dims_list):
        raise ValueError(f"dims has {len(dims)} entries for {len(dims_list)} shapes; pass one dim per tensor")
    items, pos = [], 0
    for k, (shape, dim) in enumerate(zip(dims_list, dims)):
        if not 0 <= dim < len(shape):
            raise ValueError(
                f"dims[{k}]={dim} is not a dim of shapes[{k}]={shape}; pass 0 <= dim < {len(shape)} (0-D tensors cannot be split)"
            )
        inner = math.prod(shape[:dim] + shape[dim + 1 :])
        chunk = -(-shape[dim] // n)
        items.append(ChunkItem(shape, dim, pos, chunk, inner))
        pos += chunk * inner
    return ChunkLayout(tuple(items), n, -(-pos // align) * align)
