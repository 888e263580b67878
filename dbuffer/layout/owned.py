"""The owned layout (:class:`OwnedLayout`, :func:`compute_owned_layout`) of the ``Owned()``
placement: every tensor whole inside the shard of one owner, owners chosen by
:func:`assign_owners` to balance the shards' sizes. Pure: no torch.

The shards are still equal (padded to the largest owner's load), so the same all-gather and
reduce-scatter serve it and the packed :class:`~dbuffer.layout.packed.Layout`, whose queries it
inherits.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from dbuffer.layout.common import ItemLayout, ItemRef, _as_int, _check_inputs
from dbuffer.layout.packed import Layout


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

    ``items``, ``num_shards``, ``shard_numel`` as for :class:`Layout` (built by
    :func:`compute_owned_layout`, not by hand); queries raise as :class:`Layout`'s do.
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

    ``ValueError`` (naming the argument) for ``num_shards < 1``, a negative size, or
    ``initial_loads`` of another length than ``num_shards``.
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

    ``shapes``: the tensors' shapes in registration order; ``align`` as for
    :func:`compute_layout`. Raises ``ValueError`` (naming the argument) for ``num_shards < 1``, ``align < 1``, a shape with a
    negative dimension or a value that is not an int; nothing else can fail (pure arithmetic).
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
