"""Where every tensor of a DBuffer lives: pure layout arithmetic, no torch.

A DBuffer packs tensors into one flat buffer of ``num_shards * shard_numel``
elements cut into equal contiguous shards. Two rules shape the layout:

* Each tensor is one contiguous slice, placed in the order given (parameter
  registration order), so an all-gathered buffer holds every tensor as a plain
  view and the element order, hence every reduction, is reproducible.
* Row atomicity: no shard boundary falls strictly inside a row (``shape[1:]``).
  Each shard then holds whole rows of each tensor, so a local piece is a
  ``[rows, *shape[1:]]`` view, which is what DTensor ``Shard(0)`` needs.

A tensor spanning two or more boundaries forces ``row_numel | shard_numel``;
:func:`compute_layout` keeps padding small by searching ``shard_numel`` rather
than taking an LCM of all row sizes. No torch here: cheap to import and test.

:func:`compute_owned_layout` builds the other kind, an :class:`OwnedLayout`, for
the ``Owned()`` placement: every tensor lies whole inside the shard of one
owner, owners chosen by :func:`assign_owners` to balance the shards' sizes.
The shards are still equal (padded to the largest owner's load), so the same
all-gather and reduce-scatter serve both kinds.

:func:`compute_chunk_layout` builds the third kind, a :class:`ChunkLayout`, for parameters that
must be split exactly like ``torch.chunk(full, n, dim)`` (torch FSDP2's layout, asked for by
``shard_placement_fn``): every shard is the concatenation of its padded piece of every tensor,
so a gathered buffer is shard-major and a full tensor is not a view of it (a copy-out; and a
copy-in for gradients). It describes where things are; it does not pack rows.

:func:`compute_ragged_layout` builds the fourth kind, a :class:`RaggedLayout`: element-granular
shards (a boundary may split a row), padding only the last shard's tail, for when row atomicity
pads too much (Llama-3-70B at 1024 ranks: 2.78%); :func:`choose_layout` picks between it and the
row-atomic layout by a padding threshold. ``DBuffer`` accepts it (``layout=``): a tensor whose
rows a boundary splits is then handed out as 1-D element pieces
(:class:`dbuffer.element_sharded.ElementShardedDTensor`).
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass
from typing import Optional, Sequence, Union

__all__ = [
    "ChunkItem",
    "ChunkLayout",
    "ItemLayout",
    "Layout",
    "OwnedLayout",
    "RaggedLayout",
    "assign_owners",
    "choose_layout",
    "compute_chunk_layout",
    "compute_layout",
    "compute_owned_layout",
    "compute_ragged_layout",
]


@dataclass(frozen=True)
class ItemLayout:
    """One tensor's slice ``[offset, offset + numel)`` of the global buffer.

    A tensor with no elements still gets an offset (where it would start) so
    offsets stay non-decreasing; its rows, if it has any (e.g. shape ``(3, 0)``),
    all belong to the shard containing ``offset``, clamped to the last shard.
    """

    shape: tuple[int, ...]
    offset: int  # start in the global flat buffer, in elements
    numel: int
    row_numel: int  # prod(shape[1:]); 1 for 0-D and 1-D
    num_rows: int  # shape[0]; 1 for 0-D


ItemRef = Union[ItemLayout, int]


class _Numels:
    """Element counts every layout answers alike: ``num_shards`` shards of ``shard_numel``
    elements, of which the items' elements are data and the rest padding."""

    items: tuple
    num_shards: int
    shard_numel: int

    @property
    def total_numel(self) -> int:  # N * S
        return self.num_shards * self.shard_numel

    @property
    def data_numel(self) -> int:  # elements that belong to tensors
        return sum(it.numel for it in self.items)

    @property
    def padding_numel(self) -> int:  # elements that belong to no tensor
        return self.total_numel - self.data_numel


class _Shards(_Numels):
    """Shard queries of the layouts that may also be cut into a coarser ``num_shards`` n | N
    (each defines ``_resolve(num_shards, index=None) -> (n, shard size)``)."""

    @property
    def padding_fraction(self) -> float:
        return self.padding_numel / self.total_numel if self.total_numel else 0.0

    def shard_numel_for(self, num_shards: Optional[int] = None) -> int:
        """Shard size when the buffer is cut into ``num_shards`` pieces."""
        return self._resolve(num_shards)[1]

    def shard_range(self, index: int, num_shards: Optional[int] = None) -> tuple[int, int]:
        """Global ``[start, end)`` of shard ``index``."""
        _, size = self._resolve(num_shards, index)
        return index * size, (index + 1) * size


@dataclass(frozen=True)
class Layout(_Shards):
    """Layout built for ``num_shards`` (N) shards of ``shard_numel`` (S) elements.

    Every query takes an optional ``num_shards`` n dividing N: coarse shard j is
    fine shards ``[j*N/n, (j+1)*N/n)``. Coarse boundaries are a subset of fine
    ones, so one layout serves every such sharding with rows still atomic.
    """

    items: tuple[ItemLayout, ...]
    num_shards: int
    shard_numel: int

    def item_rows(self, item: ItemRef, index: int, num_shards: Optional[int] = None) -> tuple[int, int]:
        """Rows ``[r0, r1)`` of ``item`` held by shard ``index``; ``r0 == r1`` if none.

        Monotone in ``index``: shards before the item give (0, 0), after it (R, R).
        """
        n, size = self._resolve(num_shards, index)
        return self._rows(self._item(item), index, n, size)

    def item_local_range(self, item: ItemRef, index: int, num_shards: Optional[int] = None) -> tuple[int, int]:
        """Where those rows sit in shard ``index``'s local buffer, as ``[start, end)``.

        Always within ``[0, shard size]``, empty (start == end) when the shard holds
        no rows, so callers can slice the local buffer without special cases.
        """
        n, size = self._resolve(num_shards, index)
        it = self._item(item)
        r0, r1 = self._rows(it, index, n, size)
        base = it.offset - index * size
        return _clamp(base + r0 * it.row_numel, 0, size), _clamp(base + r1 * it.row_numel, 0, size)

    def rows_per_shard(self, item: ItemRef, num_shards: Optional[int] = None) -> tuple[int, ...]:
        """Row count of ``item`` on every shard (only owners are visited)."""
        n, size = self._resolve(num_shards)
        it = self._item(item)
        counts = [0] * n
        for k in self._owners(it, n, size):
            r0, r1 = self._rows(it, k, n, size)
            counts[k] = r1 - r0
        return tuple(counts)

    def is_chunk_split(self, item: ItemRef, num_shards: Optional[int] = None) -> bool:
        """True iff rows split like ``torch.chunk(num_rows, n)``, padded with empty pieces.

        That split (pieces of ``ceil(R/n)`` rows, the last ones short or empty) is
        what DTensor ``Shard(0)`` assumes; when it holds, the local piece can be
        exposed as a DTensor without any copy.
        """
        n, _ = self._resolve(num_shards)
        rows = self._item(item).num_rows
        if rows == 0:
            return True
        chunk = -(-rows // n)
        full, rem = divmod(rows, chunk)
        expected = [chunk] * full + ([rem] if rem else [])
        return self.rows_per_shard(item, n) == tuple(expected + [0] * (n - len(expected)))

    def owners(self, item: ItemRef, num_shards: Optional[int] = None) -> range:
        """Shards holding at least one row of ``item`` (empty for 0 rows)."""
        n, size = self._resolve(num_shards)
        return self._owners(self._item(item), n, size)

    def _resolve(self, num_shards: Optional[int], index: Optional[int] = None) -> tuple[int, int]:
        n = self.num_shards if num_shards is None else _as_int(num_shards, "num_shards")
        if n < 1 or self.num_shards % n:
            raise ValueError(
                f"num_shards={n} must divide the layout's num_shards={self.num_shards}; "
                f"pass a divisor of {self.num_shards}, or recompute with "
                f"compute_layout(..., num_shards={n}) (or a multiple of it)"
            )
        if index is not None and not 0 <= index < n:
            raise IndexError(f"shard index {index} is out of range for num_shards={n}; use 0 <= index < {n}")
        return n, self.shard_numel * (self.num_shards // n)

    def _item(self, item: ItemRef) -> ItemLayout:
        return item if isinstance(item, ItemLayout) else self.items[item]

    @staticmethod
    def _home(it: ItemLayout, n: int, size: int) -> int:  # owner of an item with no elements
        return min(it.offset // size, n - 1) if size else 0

    def _rows(self, it: ItemLayout, k: int, n: int, size: int) -> tuple[int, int]:
        if it.numel == 0:
            home = self._home(it, n, size)
            return (0, 0) if k < home else (it.num_rows, it.num_rows) if k > home else (0, it.num_rows)
        r, rows = it.row_numel, it.num_rows
        # ceil((boundary - offset) / r), clamped to [0, rows]; exact inside the item.
        r0 = _clamp(-((it.offset - k * size) // r), 0, rows)
        r1 = _clamp(-((it.offset - (k + 1) * size) // r), 0, rows)
        return r0, r1

    def _owners(self, it: ItemLayout, n: int, size: int) -> range:
        if it.num_rows == 0:
            return range(0)
        if it.numel == 0:
            home = self._home(it, n, size)
            return range(home, home + 1)
        return range(it.offset // size, (it.offset + it.numel - 1) // size + 1)


@dataclass(frozen=True)
class OwnedLayout(Layout):
    """A layout in which every tensor lies whole inside one shard: its owner's.

    Built by :func:`compute_owned_layout` for the ``Owned()`` placement. For the fine sharding
    into ``num_shards`` (N) shards it guarantees:

    * each tensor lies entirely inside the shard of its :meth:`owner` (a tensor without elements
      too: its offset is inside that shard, so it is that shard's 0-element view);
    * the tensors a shard owns follow registration order, packed from the shard's start;
    * every shard has ``shard_numel`` elements, the largest owner load rounded up to ``align``;
      the rest of a lighter shard is padding.

    Offsets therefore do not grow with the item index. The queries inherited from
    :class:`Layout` never assumed they did: they derive an item's rows on a shard from its own
    offset, so they stay exact here (one owner per tensor, all rows on it). A coarser sharding
    into n | N shards keeps every tensor whole, in coarse shard ``owner // (N / n)``.

    A different class from :class:`Layout`, so the two never compare equal: a buffer with this
    layout and one with a packed layout of the same shapes are not interchangeable.
    """

    def owner(self, item: ItemRef, num_shards: Optional[int] = None) -> int:
        """The shard holding all of ``item`` (defined for every item, even one without rows)."""
        n, size = self._resolve(num_shards)
        return self._home(self._item(item), n, size)

    def owned_items(self, index: int, num_shards: Optional[int] = None) -> tuple[int, ...]:
        """Indices of the items shard ``index`` owns, in registration (= offset) order."""
        n, size = self._resolve(num_shards, index)
        return tuple(i for i, it in enumerate(self.items) if self._home(it, n, size) == index)

    def loads(self, num_shards: Optional[int] = None) -> tuple[int, ...]:
        """Tensor elements held by each shard; ``shard_numel_for(n)`` minus these is padding."""
        n, size = self._resolve(num_shards)
        loads = [0] * n
        for it in self.items:
            loads[self._home(it, n, size)] += it.numel
        return tuple(loads)


def compute_layout(shapes: Sequence[Sequence[int]], num_shards: int, *, align: int = 1) -> Layout:
    """Place ``shapes`` in order into ``num_shards`` equal, row-atomic shards.

    The shard size S is a multiple of ``align`` and never exceeds the bound
    ``U`` = smallest S >= max(ceil((total + (N-1)*(r_max-1)) / N), r_max) that
    ``row_numel`` divides for every tensor larger than S (contiguity forces it
    for tensors crossing two boundaries). A binary search looks for smaller S.
    """
    n, align, dims_list, sizes = _check_inputs(shapes, num_shards, align)
    size = _choose_shard_numel(sizes, n, align)
    offsets = _place_all(sizes, size, n) if size else [0] * len(sizes)
    assert offsets is not None, "internal error: the chosen shard size must be feasible"
    items = tuple(
        ItemLayout(d, off, numel, row, d[0] if d else 1)
        for d, off, (numel, row) in zip(dims_list, offsets, sizes)
    )
    return Layout(items, n, size)


def assign_owners(
    sizes: Sequence[int], num_shards: int, *, initial_loads: Optional[Sequence[int]] = None
) -> tuple[int, ...]:
    """The owner shard of each item: largest first onto the least-loaded shard (LPT).

    Items are taken by decreasing size, equal sizes in index order; each goes to the shard with
    the smallest load so far, equal loads to the lowest shard. ``initial_loads`` (default zeros)
    are loads already on the shards, e.g. from other buffers on the same ranks, so that many
    small buffers balance as one. Integer arithmetic only, so every rank computes the same
    owners. Guarantees with zero initial loads (``n = num_shards``, ``p = max(sizes)``):

    * ``max(load) <= min(load) + p`` (each item lands on a least-loaded shard);
    * ``max(load) <= sum(sizes) / n + (1 - 1/n) * p`` (list scheduling);
    * ``max(load) <= (4/3 - 1/(3n))`` times the best possible maximum (Graham's LPT bound).
    """
    n = _as_int(num_shards, "num_shards")
    if n < 1:
        raise ValueError(f"num_shards must be >= 1, got {n}; pass the number of shards (world size)")
    sizes = [_as_int(s, f"sizes[{i}]") for i, s in enumerate(sizes)]
    for i, s in enumerate(sizes):
        if s < 0:
            raise ValueError(f"sizes[{i}]={s} is negative; sizes must be >= 0")
    start = [0] * n if initial_loads is None else [_as_int(x, "initial_loads") for x in initial_loads]
    if len(start) != n:
        raise ValueError(f"initial_loads has {len(start)} entries; pass one per shard ({n})")
    heap = [(start[k], k) for k in range(n)]  # (load, shard): the minimum is the lightest, lowest shard
    heapq.heapify(heap)
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, k = heapq.heappop(heap)
        owners[i] = k
        heapq.heappush(heap, (load + sizes[i], k))
    return tuple(owners)


def compute_owned_layout(
    shapes: Sequence[Sequence[int]],
    num_shards: int,
    *,
    align: int = 1,
    initial_loads: Optional[Sequence[int]] = None,
) -> OwnedLayout:
    """Place every tensor whole inside one of ``num_shards`` equal shards (see :class:`OwnedLayout`).

    Owners come from :func:`assign_owners` on the tensors' element counts (starting from
    ``initial_loads``, which affect who owns what, not the shard size). Each shard holds its
    tensors in registration order from its start; the shard size is the largest load rounded up
    to a multiple of ``align``. Padding is ``num_shards * shard_numel - total``: small when many
    tensors share the shards, large when one tensor outweighs a fair share (``total / n``), since
    every shard is then padded to that tensor's size.
    """
    n, align, dims_list, sizes = _check_inputs(shapes, num_shards, align)
    owners = assign_owners([numel for numel, _ in sizes], n, initial_loads=initial_loads)
    loads = [0] * n
    for (numel, _), k in zip(sizes, owners):
        loads[k] += numel
    size = -(-max(loads) // align) * align
    fill = [0] * n  # next free element of each shard
    items = []
    for d, (numel, row), k in zip(dims_list, sizes, owners):
        if numel:
            offset = k * size + fill[k]
            fill[k] += numel
        else:  # no elements: an offset inside shard k (a full shard's end is the next shard's start)
            offset = k * size + min(fill[k], size - 1) if size else 0
        items.append(ItemLayout(d, offset, numel, row, d[0] if d else 1))
    return OwnedLayout(tuple(items), n, size)


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
    (coarse boundaries are a subset of the fine ones).
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
    of ``ceil(total / num_shards)`` elements rounded up to ``align``; see :class:`RaggedLayout`."""
    n, align, dims_list, sizes = _check_inputs(shapes, num_shards, align)
    total = sum(numel for numel, _ in sizes)
    size = -(-(-(-total // n)) // align) * align
    items, pos = [], 0
    for d, (numel, row) in zip(dims_list, sizes):
        items.append(ItemLayout(d, pos, numel, row, d[0] if d else 1))
        pos += numel
    return RaggedLayout(tuple(items), n, size)


# The padding above which :func:`choose_layout` gives up row atomicity.
MAX_ROW_ATOMIC_PADDING = 0.001


def choose_layout(
    shapes: Sequence[Sequence[int]],
    num_shards: int,
    *,
    align: int = 1,
    max_padding: float = MAX_ROW_ATOMIC_PADDING,
    min_padding_numel: int = 0,
) -> Union[Layout, RaggedLayout]:
    """The row-atomic :func:`compute_layout` when it pads at most ``max_padding`` (a fraction
    of the buffer) or at most ``min_padding_numel`` elements, else :func:`compute_ragged_layout`,
    whose padding is below ``num_shards * align`` elements. Row atomicity is worth keeping where
    it is cheap: every piece is then a row range (a DTensor without flattening)."""
    if not isinstance(max_padding, (int, float)) or isinstance(max_padding, bool) or not 0 <= max_padding < 1:
        raise ValueError(f"max_padding must be a fraction in [0, 1), got {max_padding!r}; e.g. 0.001 for 0.1%")
    min_padding_numel = _as_int(min_padding_numel, "min_padding_numel")
    if min_padding_numel < 0:
        raise ValueError(f"min_padding_numel must be >= 0, got {min_padding_numel}")
    packed = compute_layout(shapes, num_shards, align=align)
    if packed.padding_fraction <= max_padding or packed.padding_numel <= min_padding_numel:
        return packed
    return compute_ragged_layout(shapes, num_shards, align=align)


def _check_inputs(shapes, num_shards, align):
    """Validated ``(num_shards, align, shapes, [(numel, row_numel)])``; a 0-D tensor is one row
    of one element."""
    n = _as_int(num_shards, "num_shards")
    if n < 1:
        raise ValueError(f"num_shards must be >= 1, got {n}; pass the number of shards (world size)")
    align = _check_align(align)
    dims_list = _check_shapes(shapes)
    return n, align, dims_list, [(math.prod(d), math.prod(d[1:])) for d in dims_list]


def _place(pos: int, numel: int, row: int, size: int) -> Optional[int]:
    """Offset >= ``pos`` for a tensor, or None if no offset keeps rows atomic.

    Cheapest first: fit before the next boundary; else cross it after skipping
    only the partial row (< ``row`` padding); else restart at the boundary.
    A tensor crossing two or more boundaries needs ``row | size``.
    """
    room = size - pos % size
    if numel <= room:
        return pos
    fit = room // row
    if fit and (numel - fit * row <= size or size % row == 0):
        return pos + room - fit * row
    boundary = pos + room
    if numel <= size:
        return boundary
    fit = size // row
    if numel - fit * row <= size or size % row == 0:
        return boundary + size - fit * row
    return None


def _place_all(sizes: Sequence[tuple[int, int]], size: int, n: int) -> Optional[list[int]]:
    """Greedy in-order placement with shard size ``size``; None if it overflows."""
    pos, limit, offsets = 0, n * size, []
    for numel, row in sizes:
        off = _place(pos, numel, row, size) if numel else pos
        if off is None or off + numel > limit:
            return None
        offsets.append(off)
        pos = off + numel
    return offsets


def _choose_shard_numel(sizes: Sequence[tuple[int, int]], n: int, align: int) -> int:
    total = sum(numel for numel, _ in sizes)
    if total == 0:
        return 0
    largest: dict[int, int] = {}  # row_numel -> largest numel with that row size
    for numel, row in sizes:
        if numel:
            largest[row] = max(largest.get(row, 0), numel)
    r_max = max(largest)

    def lift(s: int, strict: bool) -> int:
        # Round s up to a multiple of align and of every row size that must divide it:
        # strict: tensors larger than s; else: tensors no offset can place otherwise.
        # Rows that must divide only shrink as s grows, so one rounding suffices.
        mod = align
        for row, numel in largest.items():
            if numel > (s if strict else s + s // row * row):
                mod = math.lcm(mod, row)
        return -(-s // mod) * mod

    lo = max(-(-total // n), r_max)
    best = lift(max(-(-(total + (n - 1) * (r_max - 1)) // n), r_max), strict=True)
    hi = best  # feasible: each of the first N-1 boundaries costs < r_max padding
    while lo < hi:  # feasibility is not monotone in S; any feasible S found is kept
        mid = (lo + hi) // 2
        cand = lift(mid, strict=False)
        ok = cand < best and _place_all(sizes, cand, n) is not None
        if ok:
            best = cand
        if ok or cand >= best:
            hi = mid
        else:
            lo = mid + 1
    return best


def _check_align(align: object) -> int:
    align = _as_int(align, "align")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}; use 1 for no alignment")
    return align


def _check_shapes(shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    dims_list = [tuple(_as_int(d, f"shapes[{i}]") for d in shape) for i, shape in enumerate(shapes)]
    for i, dims in enumerate(dims_list):
        if any(d < 0 for d in dims):
            raise ValueError(f"shapes[{i}]={dims} has a negative dimension; dimensions must be >= 0")
    return dims_list


def _as_int(value: object, name: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int (or ints), got {value!r}") from None


def _clamp(x: int, lo: int, hi: int) -> int:
    return lo if x < lo else hi if x > hi else x
