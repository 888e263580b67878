"""What every layout shares: :class:`ItemLayout` (one tensor's slice of the global buffer), the
element counts and shard ranges all layouts answer alike, and the argument checks of their
``compute_*`` functions. Pure: no torch.

Kept apart from the layouts themselves so that each kind (:mod:`.packed`, :mod:`.owned`,
:mod:`.chunk`, :mod:`.ragged`) imports only this, never a sibling it does not build on.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Sequence, Union


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
        """Elements in all shards together, padding included."""
        return self.num_shards * self.shard_numel

    @property
    def data_numel(self) -> int:  # elements that belong to tensors
        """Elements that belong to tensors."""
        return sum(it.numel for it in self.items)

    @property
    def padding_numel(self) -> int:  # elements that belong to no tensor
        """Elements that belong to no tensor."""
        return self.total_numel - self.data_numel


class _Shards(_Numels):
    """Shard queries of the layouts that may also be cut into a coarser ``num_shards`` n | N
    (each defines ``_resolve(num_shards, index=None) -> (n, shard size)``)."""

    @property
    def padding_fraction(self) -> float:
        """``padding_numel / total_numel`` (0 for an empty layout)."""
        return self.padding_numel / self.total_numel if self.total_numel else 0.0

    def shard_numel_for(self, num_shards: Optional[int] = None) -> int:
        """Shard size when the buffer is cut into ``num_shards`` pieces."""
        return self._resolve(num_shards)[1]

    def shard_range(self, index: int, num_shards: Optional[int] = None) -> tuple[int, int]:
        """Global ``[start, end)`` of shard ``index``."""
        _, size = self._resolve(num_shards, index)
        return index * size, (index + 1) * size


def _check_inputs(shapes, num_shards, align):
    """Validated ``(num_shards, align, shapes, [(numel, row_numel)])``; a 0-D tensor is one row
    of one element."""
    n = _as_int(num_shards, "num_shards")
    if n < 1:
        raise ValueError(f"num_shards must be >= 1, got {n}; pass the number of shards (world size)")
    align = _check_align(align)
    dims_list = _check_shapes(shapes)
    return n, align, dims_list, [(math.prod(d), math.prod(d[1:])) for d in dims_list]


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
