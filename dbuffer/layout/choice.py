"""Which flat layout a group of tensors gets: :func:`choose_layout` keeps the row-atomic
:class:`~dbuffer.layout.packed.Layout` where it pads little, else takes the
:class:`~dbuffer.layout.ragged.RaggedLayout`. Pure: no torch.
"""

from __future__ import annotations

from typing import Sequence, Union

from dbuffer.layout.common import _as_int
from dbuffer.layout.packed import Layout, compute_layout
from dbuffer.layout.ragged import RaggedLayout, compute_ragged_layout


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
    it is cheap: every piece is then a row range (a DTensor without flattening).

    ``shapes``, ``num_shards`` and ``align`` as for :func:`compute_layout`. Raises ``ValueError``
    for ``max_padding`` outside [0, 1), a negative ``min_padding_numel``, and what
    :func:`compute_layout` raises."""
    if not isinstance(max_padding, (int, float)) or isinstance(max_padding, bool) or not 0 <= max_padding < 1:
        raise ValueError(f"max_padding must be a fraction in [0, 1), got {max_padding!r}; e.g. 0.001 for 0.1%")
    min_padding_numel = _as_int(min_padding_numel, "min_padding_numel")
    if min_padding_numel < 0:
        raise ValueError(f"min_padding_numel must be >= 0, got {min_padding_numel}")
    packed = compute_layout(shapes, num_shards, align=align)
    if packed.padding_fraction <= max_padding or packed.padding_numel <= min_padding_numel:
        return packed
    return compute_ragged_layout(shapes, num_shards, align=align)
