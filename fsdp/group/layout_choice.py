"""Which layout ``fully_shard``'s default groups get: FSDP2's, or one flat row-atomic/ragged buffer.

``"chunk"`` (the default) splits parameters like FSDP2's ``Shard(0)`` into plain DTensors
(:class:`fsdp.group.layouts.ChunkedLayout`), as FSDP2 code expects, at the price of FSDP2's copies
around each collective. The flat layouts (Megatron-FSDP's) pack a group into one buffer whose
all-gather output *is* the unsharded parameters. Row-atomic (:func:`dbuffer.layout.compute_layout`)
shards are whole rows, so large worlds can pad a lot; ragged
(:func:`dbuffer.layout.compute_ragged_layout`) pads under one element a shard but hands rows cut
mid-way out as 1-D :class:`dbuffer.ElementShardedDTensor` pieces. ``"auto"``'s
``min_padding_per_shard`` floor keeps small models (padding easily 1% of a tiny buffer) row-atomic.
The setting is per thread, as torch's threaded process group runs ranks as threads.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence, Union

from dbuffer.layout import (
    MAX_ROW_ATOMIC_PADDING,
    Layout,
    RaggedLayout,
    choose_layout,
    compute_layout,
    compute_ragged_layout,
)

__all__ = ["LAYOUT_KINDS", "chunk_by_default", "describe_layout_policy", "group_layout", "layout_policy"]

LAYOUT_KINDS = ("chunk", "auto", "row", "ragged")
MIN_PADDING_PER_SHARD = 1024

_DEFAULT = {"kind": "chunk", "max_padding": MAX_ROW_ATOMIC_PADDING, "min_padding_per_shard": MIN_PADDING_PER_SHARD}
_local = threading.local()  # .policy: this thread's setting inside layout_policy, else absent


def _current() -> dict:
    return getattr(_local, "policy", None) or _DEFAULT


@contextlib.contextmanager
def layout_policy(
    kind: str = "chunk",
    *,
    max_padding: float = MAX_ROW_ATOMIC_PADDING,
    min_padding_per_shard: int = MIN_PADDING_PER_SHARD,
) -> Iterator[None]:
    """Build the groups of the ``fully_shard`` calls inside with layout ``kind``: ``"chunk"`` (the
    default), ``"auto"`` (row-atomic unless it pads more than both ``max_padding`` of the buffer and
    ``min_padding_per_shard`` elements a shard, then ragged), ``"row"`` or ``"ragged"``. Per thread;
    groups that cannot be chunked (``no_shard``, HFSDP, explicit buckets, 0-D parameters) are flat
    whatever the kind. Raises ``ValueError``, changing nothing, for an unknown ``kind``, a
    ``max_padding`` outside [0, 1) or a negative ``min_padding_per_shard``. All ranks must choose
    alike (``fully_shard`` checks); all layouts give exact DTensors."""
    if kind not in LAYOUT_KINDS:
        raise ValueError(f"layout_policy: kind must be one of {LAYOUT_KINDS}, got {kind!r}")
    if not isinstance(max_padding, (int, float)) or isinstance(max_padding, bool) or not 0 <= max_padding < 1:
        raise ValueError(f"layout_policy: max_padding must be a fraction in [0, 1), got {max_padding!r}; e.g. 0.001")
    if not isinstance(min_padding_per_shard, int) or isinstance(min_padding_per_shard, bool) or min_padding_per_shard < 0:
        raise ValueError(f"layout_policy: min_padding_per_shard must be an int >= 0, got {min_padding_per_shard!r}")
    before = getattr(_local, "policy", None)
    _local.policy = {"kind": kind, "max_padding": max_padding, "min_padding_per_shard": min_padding_per_shard}
    try:
        yield
    finally:
        _local.policy = before


def chunk_by_default() -> bool:
    """Whether parameters ``shard_placement_fn`` leaves to fsdp get FSDP2's ``Shard(0)`` pieces."""
    return _current()["kind"] == "chunk"


def describe_layout_policy() -> str:
    """This thread's policy, for fully_shard's check that every rank builds the same layouts."""
    policy = _current()
    return f"{policy['kind']} (max_padding={policy['max_padding']}, min_padding_per_shard={policy['min_padding_per_shard']})"


def group_layout(shapes: Sequence[Sequence[int]], num_shards: int) -> Union[Layout, RaggedLayout]:
    """The layout of one group's buffers over ``num_shards`` (its mesh's finest sharding) by
    :func:`layout_policy` (``"chunk"``: as ``"auto"``), deterministic: every rank picks the same."""
    policy = _current()
    kind = policy["kind"]
    if kind == "ragged":
        return compute_ragged_layout(shapes, num_shards)
    if kind == "row":
        return compute_layout(shapes, num_shards)
    floor = policy["min_padding_per_shard"] * num_shards
    return choose_layout(shapes, num_shards, max_padding=policy["max_padding"], min_padding_numel=floor)
