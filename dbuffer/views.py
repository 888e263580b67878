"""What a DBuffer holds and where: the :class:`TensorViews` mixin of
:class:`~dbuffer.buffer.DBuffer`.

Which rows (or, of a ragged layout, which elements) of each tensor this rank holds under the
buffer's placements, and views of them: :meth:`~TensorViews.get_local_tensor` (a view of the
local buffer), :meth:`~TensorViews.get_dtensor` (an exact DTensor over it, built by
:mod:`dbuffer.dtensor`), :meth:`~TensorViews.local_piece` (this rank's piece of a full tensor).
Nothing here communicates or allocates.

A mixin rather than functions: these are DBuffer's public methods, read the buffer's layout,
placements and local buffer, and stay methods of the one object users hold.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuffer.dtensor import make_dtensor, make_element_dtensor
from dbuffer.layout import Layout, OwnedLayout, RaggedLayout
from dbuffer.placements import AnyPlacement

__all__ = ["TensorViews"]


class TensorViews:
    """Mixin of :class:`~dbuffer.buffer.DBuffer`: its tensors' local pieces and views (see the
    module docstring). The attributes below are set by DBuffer's constructor."""

    mesh: DeviceMesh
    placements: tuple[AnyPlacement, ...]
    layout: Layout | RaggedLayout
    local_buffer: torch.Tensor
    num_shards: int
    shard_index: int

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The full shape of every tensor, in buffer order."""
        return tuple(item.shape for item in self.layout.items)

    def __len__(self) -> int:
        return len(self.layout.items)

    def local_rows(self, i: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of tensor ``i`` held by this rank (of a ragged layout: rows of
        which it holds at least one element; see :meth:`is_flat`)."""
        return self.layout.item_rows(self._item(i), self.shard_index, self.num_shards)

    def local_elements(self, i: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the flattened tensor ``i`` held by this rank."""
        i = self._item(i)
        if isinstance(self.layout, RaggedLayout):
            return self.layout.item_elements(i, self.shard_index, self.num_shards)
        r0, r1 = self.local_rows(i)
        return r0 * self.layout.items[i].row_numel, r1 * self.layout.items[i].row_numel

    def is_flat(self, i: int) -> bool:
        """Whether tensor ``i``'s pieces are element ranges (1-D) rather than row ranges: a
        ragged layout whose shard boundaries, under these placements, split one of its rows.
        The same answer on every rank (it depends on the layout and placements only)."""
        if not isinstance(self.layout, RaggedLayout) or self.num_shards == 1:
            return False
        cache = self.__dict__.setdefault("_flat_cache", {})
        key = (self._item(i), self.num_shards)
        if key not in cache:
            cache[key] = self.layout.splits_rows(key[0], self.num_shards)
        return cache[key]

    def local_piece(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of tensor ``i`` cut out of ``full`` (its whole value), shaped like
        :meth:`get_local_tensor` (a view of ``full`` where possible): what to copy into it."""
        local_shape = self.get_local_tensor(i).shape
        if self.num_shards == 1:
            return full.reshape(local_shape)
        if self.is_flat(i):
            e0, e1 = self.local_elements(i)
            return full.reshape(-1)[e0:e1]
        r0, r1 = self.local_rows(i)
        return (full.reshape(1) if full.dim() == 0 else full)[r0:r1].reshape(local_shape)

    @property
    def is_owned(self) -> bool:
        """Whether the layout is owned (each tensor whole on one rank), whatever the placements."""
        return isinstance(self.layout, OwnedLayout)

    def owner(self, i: int) -> int:
        """The rank (coordinate on the mesh's one axis) that holds all of tensor ``i`` under
        ``Owned()``; the same on every rank and for every placement of this buffer. Only for
        buffers with an owned layout: under ``Shard(0)`` a tensor may span several ranks."""
        if not isinstance(self.layout, OwnedLayout):
            raise ValueError(
                "owner(): this buffer has a packed layout, where a tensor may span several ranks; "
                "build it with Owned() (or layout=<an Owned buffer>.layout) to have owners"
            )
        return self.layout.owner(self._item(i))

    def get_local_tensor(self, i: int) -> torch.Tensor:
        """A view of this rank's rows of tensor ``i``.

        Unsharded placements give the whole tensor in its own shape; sharded ones give
        ``(k, *shape[1:])`` with ``k`` possibly 0 (a 0-D tensor is one row: ``(k,)``). Under
        ``Owned()`` that is all rows on the owner and 0 rows elsewhere, so a loop over tensors
        needs no special case for the tensors a rank does not own. Of a ragged layout, a tensor
        whose rows a shard boundary splits (:meth:`is_flat`) gives this rank's elements, 1-D.
        """
        item = self.layout.items[self._item(i)]
        start, end = self.layout.item_local_range(self._item(i), self.shard_index, self.num_shards)
        flat = self.local_buffer[start:end]
        if self.num_shards == 1:
            return flat.view(item.shape)
        if self.is_flat(i):  # rows cut by a shard boundary: this rank's elements
            return flat
        r0, r1 = self.local_rows(i)
        return flat.view(r1 - r0, *item.shape[1:])

    def get_dtensor(self, i: int):
        """Tensor ``i`` as an exact DTensor view of this buffer; see :mod:`dbuffer.dtensor`."""
        i = self._item(i)
        shape = self.layout.items[i].shape
        if self.is_flat(i):
            counts = self.layout.elements_per_shard(i, self.num_shards)
            start = self.local_elements(i)[0]
            return make_element_dtensor(self.get_local_tensor(i), self.mesh, self.placements, shape, counts, start)
        rows = self.layout.rows_per_shard(i, self.num_shards)
        return make_dtensor(self.get_local_tensor(i), self.mesh, self.placements, shape, rows, self.shard_index)

    def _item(self, i: int) -> int:
        if not -len(self) <= i < len(self):
            raise IndexError(f"tensor index {i} out of range for a DBuffer of {len(self)} tensors")
        return i % len(self)
