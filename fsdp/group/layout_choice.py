"""Which layout ``fully_shard``'s default groups get: FSDP2's, or one flat row-atomic/ragged buffer.

``"chunk"`` (the process default): every parameter of a sharded strategy is split exactly like
FSDP2's ``Shard(0)``, ``torch.chunk(full, W, 0)[rank]``, and registered as a plain DTensor
(:class:`fsdp.group.layouts.ChunkedLayout`). That is what code written for FSDP2 assumes of ``p.to_local()`` (DTensor's
own meaning of ``Shard(0)``), at the price of FSDP2's copy out of each all-gather and into each
reduce-scatter. Groups this cannot serve (``no_shard``, HFSDP, explicit buckets, 0-D
parameters) get the flat layouts below, as under ``"auto"``.

``"auto"``, ``"row"``, ``"ragged"`` (Megatron-FSDP's way, opt-in with :func:`layout_policy`): a
group's parameters are packed into one flat buffer whose all-gather output *is* the unsharded
parameters, so gathers and reductions need no copies. Row-atomic (:func:`dbuffer.layout.compute_layout`) is the default: every parameter's shard is a
row range, a plain or row-sharded DTensor. At large worlds it can pad a lot (Llama-3-70B at 1024
ranks: 2.78%, since a shard boundary may not cut a row); the ragged layout
(:func:`dbuffer.layout.compute_ragged_layout`) cuts wherever the elements fall and pads less than
one element a shard, at the price of handing the parameters it cuts mid-row out as 1-D element
pieces (:class:`dbuffer.ElementShardedDTensor`, exact under every op, like the row-sharded kind).

``"auto"`` keeps a group row-atomic unless its padding is both above
``max_padding`` of the buffer (0.1%, :data:`dbuffer.layout.MAX_ROW_ATOMIC_PADDING`) *and* above
``min_padding_per_shard`` elements a shard (1024: 4 KiB in fp32). The second condition keeps small
models and small test worlds, whose padding is a few elements but easily 1% of a tiny buffer,
exactly as they were: padding that small is not worth giving up row pieces.

``layout_policy("auto")``, ``layout_policy("ragged")`` / ``layout_policy("row")`` choose for the
groups built inside it (a context manager around ``fully_shard``; the FSDP2 surface is
untouched). The setting is per thread (torch's threaded process group runs every rank as a
thread of one process, each entering its own), on top of the process default "chunk".
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
    """Build the groups of the ``fully_shard`` calls inside with layout ``kind``: ``"chunk"``
    (FSDP2's torch.chunk pieces, the default), ``"auto"`` (row-atomic unless it pads more than
    ``max_padding`` of the buffer and ``min_padding_per_shard`` elements a shard, then ragged),
    ``"row"`` (always row-atomic) or ``"ragged"`` (always element-granular). A context manager,
    per thread; groups that cannot be chunked (``no_shard``, HFSDP, explicit buckets) are flat
    whatever the kind. Raises ``ValueError`` for an unknown ``kind``, a ``max_padding`` outside
    [0, 1) or a negative ``min_padding_per_shard``, before anything changes. Every rank must
    choose alike (``fully_shard`` checks it). Guarantee: every layout hands out exact DTensors."""
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
    """The layout of one group's buffers over ``num_shards`` (the finest sharding of its mesh),
    by the current :func:`layout_policy` (``"chunk"``: as ``"auto"``, for the groups FSDP2's
    pieces cannot serve). Pure and deterministic: every rank picks the same."""
    policy = _current()
    kind = policy["kind"]
    if kind == "ragged":
        return compute_ragged_layout(shapes, num_shards)
    if kind == "row":
        return compute_layout(shapes, num_shards)
    floor = policy["min_padding_per_shard"] * num_shards
    return choose_layout(shapes, num_shards, max_padding=policy["max_padding"], min_padding_numel=floor)
