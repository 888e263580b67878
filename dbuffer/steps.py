"""The collectives behind one step of a redistribution: which call of :mod:`dbuffer.collectives`
moves a :class:`~dbuffer.placements.Step`'s data from one local buffer into another.

:meth:`DBuffer.redistribute <dbuffer.buffer.DBuffer.redistribute>` and its primitives validate,
plan (:func:`dbuffer.placements.plan_redistribute`) and allocate; :func:`launch` only starts the
step's collective. An Owned buffer whose shards are mostly padding takes a sparse path: each
owner's used range (:func:`owned_segments`) is broadcast, or reduced to its owner by one
all-to-all of unequal splits, instead of moving padded shards.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dbuffer import collectives
from dbuffer.collectives import Pending
from dbuffer.layout import OwnedLayout
from dbuffer.placements import AnyPlacement, Step

__all__ = ["done", "launch", "owned_segments"]

Segments = Sequence[tuple[int, int, int]]  # (owner, start, end) in the full buffer


def launch(
    step: Step,
    dst: torch.Tensor,
    src: torch.Tensor,
    group,
    size: int,
    async_op: bool,
    placement: AnyPlacement,
    coordinate: tuple[int, ...],
    segments: Segments | None,
) -> Pending:
    """Start ``step``'s collective over ``group`` (``size`` ranks) from ``src``, this rank's
    local buffer, into ``dst``, the result's. ``placement`` is the source's placement on the
    step's axis, ``coordinate`` this rank's on the mesh, ``segments`` the sparse Owned path's
    ranges (:func:`owned_segments`) or None for padded shards."""
    if step.kind == "allgather":
        if segments is None:
            work = collectives.all_gather(dst, src, group, async_op)
        else:
            work = _gather_owned(dst, src, segments, coordinate[0], group, async_op)
    elif step.kind == "reduce_scatter":
        op = placement.reduce_op
        if segments is None:
            work = collectives.reduce_scatter(dst, src, op, group, async_op)
        else:
            work = collectives.reduce_to_owners(dst, src, segments, op, group, async_op)
    elif step.kind == "allreduce":
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        work = collectives.all_reduce(dst, placement.reduce_op, group, async_op)
    else:  # scatter into out
        dst.copy_(src.view(size, -1)[coordinate[step.axis]])
        work = done(dst)
    return work


def owned_segments(layout: OwnedLayout, size: int, threshold: float) -> list[tuple[int, int, int]] | None:
    """``(owner, start, end)`` of each owner's tensors in the full buffer of ``layout`` cut into
    ``size`` shards, if those padded shards would carry more than ``threshold`` times the
    elements the tensors hold; else None (padded shards are moved as they are)."""
    loads = layout.loads(size)
    shard = layout.shard_numel_for(size)
    if size * shard <= threshold * sum(loads):
        return None
    ends = [r * shard for r in range(size)]
    for k, item in enumerate(layout.items):  # packed from the start of the owner's shard
        r = layout.owner(k, size)
        ends[r] = max(ends[r], item.offset + item.numel)
    return [(r, r * shard, ends[r]) for r in range(size)]


def _gather_owned(dst, src, segments, rank: int, group, async_op: bool) -> Pending:
    """Own shard copied in, every owner's used range broadcast from it (every rank takes
    part in every broadcast, in the same order); the padding reads as zeros. One memset of
    the whole buffer: it is mostly padding, or this path would not be taken."""
    shard = src.numel()
    dst.zero_()
    dst[rank * shard : (rank + 1) * shard].copy_(src)
    return collectives.broadcast_segments(dst, segments, group, async_op)


def done(result) -> Pending:
    """A handle whose ``wait()`` gives ``result`` at once (a step with nothing in flight)."""
    return Pending([], lambda: result)
