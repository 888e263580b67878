"""The packed, row-atomic layout (:class:`Layout`, :func:`compute_layout`): the default of every
DBuffer. Pure: no torch.

Tensors are placed in the order given, each one contiguous slice, and no shard boundary falls
strictly inside a row (``shape[1:]``), so each shard holds whole rows of each tensor: a local
piece is a ``[rows, *shape[1:]]`` view, which is what DTensor ``Shard(0)`` needs. A tensor
spanning two or more boundaries forces ``row_numel | shard_numel``; :func:`compute_layout`
keeps padding small by searching ``shard_numel`` rather than taking an LCM of all row sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from dbuffer.layout.common import ItemLayout, ItemRef, _as_int, _check_inputs, _clamp, _Shards


@dataclass(frozen=True)
class Layout(_Shards):
    """Layout built for ``num_shards`` (N) shards of ``shard_numel`` (S) elements.

    Every query takes an optional ``num_shards`` n dividing N: coarse shard j is
    fine shards ``[j*N/n, (j+1)*N/n)``. Coarse boundaries are a subset of fine
    ones, so one layout serves every such sharding with rows still atomic.

    A frozen value built by :func:`compute_layout` (not by hand): ``items`` holds one
    :class:`~dbuffer.layout.common.ItemLayout` per tensor (shape, offset, element and row counts),
    in the order given. Guarantees: no shard boundary falls strictly inside a row of any tensor,
    tensors are contiguous and in order, every shard has ``shard_numel`` elements. A query with an
    ``n`` that does not divide N, or an item index out of range, raises ``ValueError`` /
    ``IndexError``.
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


def compute_layout(shapes: Sequence[Sequence[int]], num_shards: int, *, align: int = 1) -> Layout:
    """Place ``shapes`` in order into ``num_shards`` equal, row-atomic shards.

    The shard size S is a multiple of ``align`` and never exceeds the bound
    ``U`` = smallest S >= max(ceil((total + (N-1)*(r_max-1)) / N), r_max) that
    ``row_numel`` divides for every tensor larger than S (contiguity forces it
    for tensors crossing two boundaries). A binary search looks for smaller S.

    ``shapes``: the tensors' shapes in order; ``num_shards``: the finest sharding (the mesh's
    size); ``align``: the shard size is a multiple of it. Raises ``ValueError`` (naming the argument) for ``num_shards < 1``, ``align < 1``, a shape with a
    negative dimension or a value that is not an int; nothing else can fail (pure arithmetic).
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
