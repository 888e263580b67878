"""Megatron-FSDP's global layout of a :class:`~fsdp.megatron.buffer.DBuffer`: where each tensor
sits in the flat buffer, as ``tensor_shapes``, ``tensor_to_offset`` and ``size``.

Megatron-FSDP packs a buffer for its whole data-parallel mesh at once (every rank its own shard,
``dp_size = mesh.size()``) around one granule, ``chunk``: the least common multiple of every
tensor's row size (``shape[1:]``). Shards are multiples of ``chunk`` and every tensor starts on a
multiple of its own row size, so no shard boundary of any coarser sharding cuts a row: each
rank's piece of each tensor is whole rows, as dbuffer's row-atomic layouts promise. The packing
is Megatron-FSDP's, so offsets are the ones its users (and its tests) see:

* tensors of at least ``chunk`` elements ("regular") go in order, each on a ``chunk`` boundary;
* a regular tensor that does not fill its last ``chunk`` leaves a gap; the first later regular
  tensor whose own remainder fits in it ends its remainder at the next boundary instead ("its
  conjugate", which then continues on whole chunks), and what is left of the gap takes the
  smaller tensors ("fragments", largest first), each aligned to its own row size;
* fragments that found no gap follow at the end; the total is padded to ``chunk * dp_size``.

:class:`GlobalLayout` *is* a :class:`dbuffer.Layout` (the same items, shards of
``size / dp_size`` elements), so dbuffer's buffers run every collective on it unchanged, and it
adds Megatron-FSDP's names. :meth:`GlobalLayout.of` names an existing dbuffer layout the same way
(fsdp's groups are packed by :func:`dbuffer.compute_layout`, which pads less where row sizes have
a large LCM). Pure: no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from dbuffer import Layout
from dbuffer.layout import ItemLayout

__all__ = ["GlobalLayout", "row_numel"]


def row_numel(shape: Sequence[int]) -> int:
    """Elements of one row (``shape[1:]``). Megatron-FSDP lays out no 0-D tensor: ``ValueError``."""
    if len(shape) == 0:
        raise ValueError("a Megatron-FSDP DBuffer holds no 0-D tensors; make the tensor 1-D of size 1")
    return math.prod(shape[1:])


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class GlobalLayout(Layout):
    """A :class:`dbuffer.Layout` under Megatron-FSDP's names (``tensor_shapes``,
    ``tensor_to_offset``, ``size``): ``items``, one :class:`dbuffer.layout.ItemLayout` per tensor,
    cut into ``num_shards`` (``dp_size``) shards of ``shard_numel`` elements. Built by
    :meth:`build` (Megatron-FSDP's packing) or :meth:`of` (an existing dbuffer layout), not by
    hand; equal layouts compare equal. Every dbuffer query works on it; :meth:`build` raises
    ``ValueError`` for shapes it cannot lay out, :meth:`of` ``TypeError`` for a layout that is
    not row-atomic."""

    @property
    def tensor_shapes(self) -> tuple[torch.Size, ...]:
        """Every tensor's full shape, in buffer order."""
        return tuple(torch.Size(item.shape) for item in self.items)

    @property
    def tensor_to_offset(self) -> tuple[int, ...]:
        """Every tensor's first element in the global flat buffer."""
        return tuple(item.offset for item in self.items)

    @property
    def size(self) -> int:
        """Elements of the global buffer, padding included (``dp_size`` shards)."""
        return self.num_shards * self.shard_numel

    @classmethod
    def of(cls, layout: Layout) -> "GlobalLayout":
        """``layout`` (a dbuffer row-atomic layout) under these names: the same items and shards."""
        if isinstance(layout, cls):
            return layout
        if type(layout) is not Layout:
            raise TypeError(
                f"a Megatron-FSDP view needs a row-atomic dbuffer Layout, got {type(layout).__name__}; "
                f"fsdp.megatron builds its groups with fsdp.layout_policy('row')"
            )
        return cls(layout.items, layout.num_shards, layout.shard_numel)

    @classmethod
    def build(cls, shapes: Iterable[Sequence[int]], dp_size: int) -> "GlobalLayout":
        """Megatron-FSDP's packing of ``shapes`` for ``dp_size`` shards (see the module docstring).
        ``ValueError`` for ``dp_size < 1``, a 0-D shape or a shape with empty rows."""
        if dp_size < 1:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        dims = [tuple(int(d) for d in shape) for shape in shapes]
        rows = [row_numel(d) for d in dims]
        for d, r in zip(dims, rows):
            if r <= 0:
                raise ValueError(f"cannot lay out a tensor of shape {d}: its rows (shape[1:]) hold no elements")
        chunk = math.lcm(1, *rows)
        numels = [math.prod(d) for d in dims]
        offsets = _pack(numels, rows, chunk)
        end = max((o + n for o, n in zip(offsets, numels)), default=0)
        items = tuple(
            ItemLayout(d, o, n, r, d[0]) for d, o, n, r in zip(dims, offsets, numels, rows)
        )
        return cls(items, dp_size, _up(end, chunk * dp_size) // dp_size)


def _pack(numels: list[int], rows: list[int], chunk: int) -> list[int]:
    """Megatron-FSDP's offsets (see the module docstring), in tensor order."""
    offsets = [-1] * len(numels)
    regular = [k for k, n in enumerate(numels) if n >= chunk]
    fragments = sorted((k for k, n in enumerate(numels) if n < chunk), key=lambda k: -numels[k])
    cursor = 0
    while regular:
        k = regular.pop(0)
        offsets[k] = cursor
        remainder = numels[k] % chunk
        if remainder == 0:
            cursor += numels[k]
            continue
        gap, cursor = cursor + numels[k], _up(cursor + numels[k], chunk)
        gap_end = cursor
        partner = next((c for c in regular if 0 < numels[c] % chunk <= chunk - remainder), None)
        if partner is not None:
            regular.remove(partner)
            offsets[partner] = gap_end = cursor - numels[partner] % chunk
            cursor += numels[partner] - numels[partner] % chunk
        for f in list(fragments):
            start = _up(gap, rows[f])
            if start + numels[f] <= gap_end:
                offsets[f], gap = start, start + numels[f]
                fragments.remove(f)
    for f in fragments:
        cursor = _up(cursor, rows[f])
        offsets[f] = cursor
        cursor += numels[f]
    return offsets
