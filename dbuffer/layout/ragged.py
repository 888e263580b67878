"""The ragged layout (:class:`RaggedLayout`, :func:`compute_ragged_layout`): element-granular
shards (a boundary may split a row), padding only the last shard's tail. Pure: no torch.

For when row atomicity pads too much (Llama-3-70B at 1024 ranks: 2.78%). ``DBuffer`` accepts it
(``layout=``): a tensor whose rows a boundary splits is then handed out as 1-D element pieces
(:class:`dbuffer.element_sharded.ElementShardedDTensor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dbuffer.layout.common import ItemLayout, ItemRef, _check_inputs, _clamp, _Shards
from dbuffer.layout.packed import Layout


@dataclass(frozen=True)
class RaggedLayout(_Shards):
    """Element-granular ("ragged") layout: tensors packed back to back in order, the buffer cut
    into ``num_shards`` (N) equal shards of ``shard_numel`` (S) wherever the elements fall, so a
    shard boundary may split a row. Padding is only the tail, ``N * S - total < N * align``
    elements, whatever the shapes: Llama-3-70B at 1024 ranks pads under one part in 10^7, where
    the row-atomic :class:`Layout` pads 2.78% (``tools/padding_report.py``).

    What it gives up: a shard's piece of a tensor is a range of its *elements* (row-major), not
    of its rows, so it is a 1-D slice, not a ``[rows, *shape[1:]]`` view. Only items for which
    :meth:`splits_rows` is False have row pieces (exposable as row-range DTensors); the others
    must be handed out flat (an exact DTensor over the flattened tensor) or as gathered full
    tensors. :func:`choose_layout` keeps the row-atomic layout where it pads little enough.

    The queries mirror :class:`Layout`'s and take the same optional coarser ``num_shards`` n | N
    (coarse boundaries are a subset of the fine ones); ``items`` holds one
    :class:`~dbuffer.layout.common.ItemLayout` per tensor. Built by
    :func:`compute_ragged_layout`; queries raise as :class:`Layout`'s do.
    """

    items: tuple[ItemLayout, ...]
    num_shards: int
    shard_numel: int

    def item_elements(self, item: ItemRef, index: int, num_shards: Optional[int] = None) -> tuple[int, int]:
        """Elements ``[e0, e1)`` of ``item`` (flattened, row-major) held by shard ``index``;
        empty (``e0 == e1``) if none. Monotone in ``index``, partitioning ``[0, numel)``."""
        _, size = self._resolve(num_shards, index)
        it = self._item(item)
        lo, hi = index * size - it.offset, (index + 1) * size - it.offset
        return _clamp(lo, 0, it.numel), _clamp(hi, 0, it.numel)

    def item_local_range(self, item: ItemRef, index: int, num_shards: Optional[int] = None) -> tuple[int, int]:
        """Where those elements sit in shard ``index``'s local buffer, ``[start, end)``."""
        _, size = self._resolve(num_shards, index)
        it = self._item(item)
        e0, e1 = self.item_elements(it, index, num_shards)
        base = it.offset - index * size
        if e0 == e1:  # nothing here: an empty range where the item would be, inside the shard
            return (_clamp(base, 0, size),) * 2
        return base + e0, base + e1

    def item_rows(self, item: ItemRef, index: int, num_shards: Optional[int] = None) -> tuple[int, int]:
        """Rows ``[r0, r1)`` of which shard ``index`` holds at least one element (the first and
        last may be partial: see :meth:`splits_rows`)."""
        it = self._item(item)
        n, size = self._resolve(num_shards, index)
        if it.numel == 0:  # rows without elements (shape (3, 0)): all on the shard holding offset
            home = Layout._home(it, n, size)
            return (0, 0) if index < home else (it.num_rows, it.num_rows) if index > home else (0, it.num_rows)
        e0, e1 = self.item_elements(it, index, num_shards)
        if e0 == e1:
            return (0, 0) if it.offset >= self.shard_range(index, num_shards)[1] else (it.num_rows, it.num_rows)
        return e0 // it.row_numel, -(-e1 // it.row_numel)

    def rows_per_shard(self, item: ItemRef, num_shards: Optional[int] = None) -> tuple[int, ...]:
        """Rows of ``item`` on every shard; a true row split only where :meth:`splits_rows` is
        False (otherwise a partial row counts on both shards holding part of it)."""
        n, _ = self._resolve(num_shards)
        return tuple(r1 - r0 for r0, r1 in (self.item_rows(item, k, n) for k in range(n)))

    def elements_per_shard(self, item: ItemRef, num_shards: Optional[int] = None) -> tuple[int, ...]:
        """How many elements of ``item`` each shard holds (summing to its ``numel``)."""
        n, _ = self._resolve(num_shards)
        return tuple(e1 - e0 for e0, e1 in (self.item_elements(item, k, n) for k in range(n)))

    def splits_rows(self, item: ItemRef, num_shards: Optional[int] = None) -> bool:
        """Whether a shard boundary falls strictly inside a row of ``item``."""
        n, size = self._resolve(num_shards)
        it = self._item(item)
        if it.numel == 0 or size == 0:
            return False
        first, last = it.offset // size + 1, (it.offset + it.numel - 1) // size
        return any((k * size - it.offset) % it.row_numel for k in range(first, last + 1))

    def owners(self, item: ItemRef, num_shards: Optional[int] = None) -> range:
        """The shards holding at least one element of ``item`` (empty for an empty tensor)."""
        n, size = self._resolve(num_shards)
        it = self._item(item)
        if it.numel == 0 or size == 0:
            return range(0)
        return range(it.offset // size, (it.offset + it.numel - 1) // size + 1)

    def _resolve(self, num_shards: Optional[int], index: Optional[int] = None) -> tuple[int, int]:
        return Layout._resolve(self, num_shards, index)  # type: ignore[arg-type]

    def _item(self, item: ItemRef) -> ItemLayout:
        return item if isinstance(item, ItemLayout) else self.items[item]


def compute_ragged_layout(shapes: Sequence[Sequence[int]], num_shards: int, *, align: int = 1) -> RaggedLayout:
    """Pack ``shapes`` back to back (registration order) and cut into ``num_shards`` equal shards
    of ``ceil(total / num_shards)`` elements rounded up to ``align``; see :class:`RaggedLayout`.

    Guarantee: padding below ``num_shards * align`` elements, whatever the shapes; the price is
    that a shard boundary may cut a row. Raises ``ValueError`` (naming the argument) for ``num_shards < 1``, ``align < 1``, a shape with a
    negative dimension or a value that is not an int; nothing else can fail (pure arithmetic).
    """
    n, align, dims_list, sizes = _check_inputs(shapes, num_shards, align)
    total = sum(numel for numel, _ in sizes)
    size = -(-(-(-total // n)) // align) * align
    items, pos = [], 0
    for d, (numel, row) in zip(dims_list, sizes):
        items.append(ItemLayout(d, pos, numel, row, d[0] if d else 1))
        pos += numel
    return RaggedLayout(tuple(items), n, size)
