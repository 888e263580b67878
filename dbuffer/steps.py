"""The collectives behind one step of a redistribution: which call of :mod:`dbuffer.collectives`
moves a :class:`~dbuffer.placements.Step`'s data from one local buffer into another.

:meth:`DBuffer.redistribute <dbuffer.buffer.DBuffer.redistribute>` and its primitives validate,
plan (:func:`dbuffer.placements.plan_redistribute`) and allocate; :func:`launch` only starts the
step's collective, :func:`run_step` runs it between two DBuffers (the in-flight tracking that
keeps a release from freeing memory it touches included). :class:`PreparedRedistribute` is a
redistribute whose checks and plan were made once, for a caller that moves the same two buffers
the same way many times (fsdp, every step): its :meth:`~PreparedRedistribute.start` runs the
plan and tests nothing but the ``out`` storage. An Owned buffer whose shards are mostly padding
takes a sparse path: each owner's used range (:func:`owned_segments`) is broadcast, or reduced to its owner by one
all-to-all of unequal splits, instead of moving padded shards.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dbuffer import collectives
from dbuffer.collectives import Pending
from dbuffer.layout import OwnedLayout
from dbuffer.placements import AnyPlacement, Step
from dbuffer.storage import StorageLifetime

Buffer = StorageLifetime  # a DBuffer (dbuffer.buffer imports this module: named by its storage mixin)

__all__ = ["PreparedRedistribute", "PreparedSlot", "done", "launch", "owned_segments", "run_step"]

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


def run_step(
    source: Buffer, step: Step, out: Buffer, async_op: bool, size: int, group, segments: Segments | None
) -> Pending:
    """Run ``step`` (validated) from ``source`` into ``out``; the Pending's ``wait()`` returns
    ``out``. In flight (``async_op``), the collective is tracked by both buffers until waited
    for: a :meth:`~dbuffer.storage.StorageLifetime.release_storage` of either waits for it."""
    with out._refill_guard():
        work = launch(
            step, out.local_buffer, source.local_buffer, group, size, async_op,
            source.placements[step.axis], source._coordinate, segments,
        )
    if not async_op:
        return Pending([work], lambda: (work.wait(), out)[1])
    return _tracked(source, out, lambda finish: Pending([work], lambda: (work.wait(), finish())[1]))


def _tracked(source: Buffer, out: Buffer, start) -> Pending:
    """``start(finish)``'s Pending, tracked by both buffers until it is waited for (``finish``,
    which it runs last, untracks it and returns ``out``)."""

    def finish() -> Buffer:
        source._untrack(pending)
        out._untrack(pending)
        return out

    pending = start(finish)
    source._track(pending)
    out._track(pending)
    return pending


class PreparedRedistribute:
    """``source.redistribute(placements, out=out)``, validated and planned once by
    :meth:`DBuffer.prepare_redistribute <dbuffer.buffer.DBuffer.prepare_redistribute>`.

    It holds its two buffers (and keeps them alive: hold it only as long as their owner holds
    them). What it fixed is what a DBuffer never changes after construction (mesh, layout,
    placements, dtype, device); what may change between runs, whether ``out`` has storage, is
    tested at every run: ``ValueError`` (before any collective) if it was released and not
    reallocated. A plan of several steps runs the earlier ones synchronously into temporaries,
    as :meth:`~dbuffer.buffer.DBuffer.redistribute` does."""

    __slots__ = ("source", "out", "requested", "placements", "_steps", "_last", "_bound")

    def __init__(self, source: Buffer, out: Buffer, requested: Sequence[AnyPlacement], placements: tuple,
                 steps: Sequence[Step], last: Optional[tuple[int, object, Segments | None]]) -> None:
        """Built by ``prepare_redistribute``: ``requested`` the placements it was asked for,
        ``placements`` the validated target (out's), ``last`` the last step's ``(size, group,
        segments)``, None for a plan of no step."""
        self.source = source
        self.out = out
        self.requested = requested
        self.placements = placements
        self._steps = tuple(steps)
        self._last = last
        self._bound = None  # one all-gather or reduce-scatter: bound once, started directly
        if len(self._steps) == 1 and last[2] is None and self._steps[0].kind in ("allgather", "reduce_scatter"):
            step = self._steps[0]
            op = source.placements[step.axis].reduce_op if step.kind == "reduce_scatter" else None
            self._bound = collectives.bind(step.kind, out.local_buffer, source.local_buffer, op, last[1])

    def start(self) -> Pending:
        """Start the redistribution: the last step's collective is left in flight; the
        Pending's ``wait()`` returns ``out``."""
        bound = self._bound
        if bound is None:
            return self._run(async_op=True)
        out = self.out
        if out.is_storage_released():
            _released()
        with out._refill_guard():
            return _tracked(self.source, out, bound.start)

    def run(self) -> Buffer:
        """Run the redistribution to the end and return ``out``."""
        return self._run(async_op=False).wait()

    def _run(self, async_op: bool) -> Pending:
        out = self.out
        if out.is_storage_released():
            _released()
        if self._last is None:  # no step: a copy, unless out is the source's storage
            if out.local_buffer.data_ptr() != self.source.local_buffer.data_ptr():
                out.local_buffer.copy_(self.source.local_buffer)
            return done(out)
        current = self.source
        for step in self._steps[:-1]:
            current = current._run(step, None, False).wait()
        size, group, segments = self._last
        return run_step(current, self._steps[-1], out, async_op, size, group, segments)


def _released() -> None:
    raise ValueError("prepared redistribute: out has released storage; call out.reallocate_storage() first")


class PreparedSlot:
    """The last :class:`PreparedRedistribute` of one caller, reused while it is asked for the
    same ``(source, placements, out)`` objects and prepared again when any of them differs:
    for a caller that moves its own, long-lived buffers (what it holds, the slot holds: pass
    temporaries to ``redistribute`` instead). Never stale: a DBuffer never changes what a
    preparation fixed, and identity is compared, not equality. :meth:`start` raises what
    ``prepare_redistribute`` raises for a new set of arguments, and ``ValueError`` for an
    ``out`` whose storage is released, both before any collective."""

    __slots__ = ("_op",)

    def __init__(self) -> None:
        self._op: Optional[PreparedRedistribute] = None

    def start(self, source: Buffer, placements: Sequence[AnyPlacement], out: Buffer) -> Pending:
        """``source.redistribute(placements, out=out, async_op=True)``, prepared at most once."""
        op = self._op
        if op is None or op.source is not source or op.out is not out or op.requested is not placements:
            op = self._op = source.prepare_redistribute(placements, out=out)
        return op.start()

    def clear(self) -> None:
        """Drop the prepared move (and the buffers it holds): their owner replaced them."""
        self._op = None
