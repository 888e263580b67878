"""DBuffer: many tensors in one flat buffer, placed on a DeviceMesh.

The global buffer is laid out once by :func:`dbuffer.layout.compute_layout` for the finest
sharding the mesh allows (every rank its own shard), so the same layout serves every placement
on that mesh and no redistribution ever moves a tensor inside the buffer. Each rank stores only
its ``local_buffer``: the contiguous range of the global buffer that its placements give it.

A buffer built with :class:`~dbuffer.placements.Owned` in its placements is laid out by
:func:`dbuffer.layout.compute_owned_layout` instead (each tensor whole on one rank); buffers that
exchange data with it (its gather target, its gradient buffer) pass ``layout=`` that layout.

``layout=`` may also be a :class:`~dbuffer.layout.RaggedLayout` (element-granular: a shard
boundary may split a row, padding < one element per shard). Every primitive is a flat-buffer op
and works unchanged; views of unsharded placements are unchanged; under sharding, a tensor whose
rows a boundary splits is handed out as this rank's 1-D range of its flattened elements
(:meth:`DBuffer.get_local_tensor`) and as an exact
:class:`~dbuffer.element_sharded.ElementShardedDTensor` (:meth:`DBuffer.get_dtensor`); the other
tensors keep their row views.

Guarantees:

* Every primitive validates its arguments (``out`` included) before any collective, so a bad call
  raises on every rank alike and no rank is left waiting in a collective.
* With ``out=``, the result lives in ``out``'s storage; nothing of the result's size is allocated.
  Without it, a new buffer is allocated, except for :meth:`DBuffer.scatter`, which returns a view.
* The receiving DBuffer of a collective is a new object; ``self`` is never modified, except by
  :meth:`release_storage` / :meth:`reallocate_storage` and by passing ``out=self``, which
  :meth:`allreduce` allows (an in-place all-reduce).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer import collectives
from dbuffer.agreement import check_agreement
from dbuffer.collectives import Pending
from dbuffer.dtensor import make_dtensor, make_element_dtensor
from dbuffer.layout import Layout, OwnedLayout, RaggedLayout, compute_layout, compute_owned_layout
from dbuffer.placements import (
    AnyPlacement,
    Owned,
    Step,
    check_layout_kind,
    check_placements,
    is_shard,
    num_shards,
    plan_redistribute,
    shard_index,
)

__all__ = ["DBuffer", "distribute_tensors"]

Shapes = Sequence[Sequence[int]]


class DBuffer:
    """A flat buffer holding ``len(tensor_shapes)`` tensors, placed on ``mesh`` by ``placements``.

    Allocates a zero-filled local buffer (zeros, so padding never carries NaN or garbage into a
    reduction or a norm). Without ``layout``, the layout is packed (:func:`compute_layout`), or
    owned (:func:`compute_owned_layout`) when a placement is ``Owned()``; a buffer that is to
    exchange data with an Owned one (e.g. ``[Replicate()]`` or ``[Partial("avg")]``) takes
    ``layout=owned_buffer.layout``.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Sequence[AnyPlacement],
        tensor_shapes: Shapes,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        layout: Layout | RaggedLayout | None = None,
        local_buffer: torch.Tensor | None = None,
        zero_fill: bool = True,
        check_ranks: bool = True,
    ) -> None:
        """The local buffer is zero-filled, or left uninitialised with ``zero_fill=False`` (no
        page is written: cheap for a buffer whose storage is released right after its views are
        made), or ``local_buffer`` is used as is (no copy).

        ``check_ranks``: first check that every rank of the mesh passed the same shapes, dtype,
        placements and layout (one all-gather of 8 bytes per mesh axis; see
        :mod:`dbuffer.agreement`), so that a mismatch raises
        :class:`~dbuffer.agreement.RankMismatchError` on every rank instead of crashing the
        first collective. Pass False only for a buffer known to be built alike everywhere (a
        sibling of a checked one)."""
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.mesh = mesh
        self.placements = check_placements(placements, mesh.ndim)
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"this rank is not part of the mesh {mesh}; build the DBuffer only on its ranks")
        self._coordinate = tuple(coordinate)
        if layout is None:
            owned = any(isinstance(p, Owned) for p in self.placements)
            layout = (compute_owned_layout if owned else compute_layout)(_shapes(tensor_shapes), mesh.size())
        elif not isinstance(layout, (Layout, RaggedLayout)):
            raise TypeError(f"layout must be a dbuffer Layout or RaggedLayout (or None), got {type(layout).__name__}")
        check_layout_kind(self.placements, isinstance(layout, OwnedLayout))
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else collectives.mesh_device(mesh)
        self.num_shards = num_shards(mesh.shape, self.placements)
        self.shard_index = shard_index(mesh.shape, self.placements, self._coordinate)
        numel = self.layout.shard_numel_for(self.num_shards)
        if local_buffer is not None:
            _check_local_buffer(local_buffer, numel, dtype, self.device)
        if check_ranks:  # the arguments are valid: the one collective of the constructor
            self._check_ranks()
        if local_buffer is None:
            make = torch.zeros if zero_fill else torch.empty
            local_buffer = make(numel, dtype=dtype, device=self.device)
        self.local_buffer = local_buffer
        self._refill_pending = False
        self._capacity_bytes = local_buffer.untyped_storage().nbytes()

    def _check_ranks(self) -> None:
        entries = [
            ("mesh", f"shape {tuple(self.mesh.shape)}"),
            ("placements", repr(self.placements)),
            ("dtype", str(self.dtype)),
        ]
        entries += [(f"tensor {i}", f"shape {tuple(item.shape)}") for i, item in enumerate(self.layout.items)]
        entries.append(
            ("layout", f"{type(self.layout).__name__} of {self.layout.shard_numel_for(self.num_shards)} elements a shard")
        )
        check_agreement(
            self.mesh, entries, "DBuffer", "Every rank of the mesh must build the buffer with the same arguments."
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_local(
        cls,
        local_buffer: torch.Tensor,
        mesh: DeviceMesh,
        placements: Sequence[AnyPlacement],
        tensor_shapes: Shapes,
        *,
        layout: Layout | None = None,
    ) -> "DBuffer":
        """Wrap an existing local buffer (no copy). It must be 1-D, contiguous and exactly the
        size this rank's shard has under ``placements``."""
        if not isinstance(local_buffer, torch.Tensor):
            raise TypeError(f"local_buffer must be a torch.Tensor, got {type(local_buffer).__name__}")
        return cls(
            mesh,
            placements,
            tensor_shapes,
            local_buffer.dtype,
            local_buffer.device,
            layout=layout,
            local_buffer=local_buffer,
        )

    def _like(self, placements: Sequence[AnyPlacement], dtype: torch.dtype | None = None, local_buffer=None) -> "DBuffer":
        """A sibling on the same mesh and layout. ``placements`` come from the planner (already
        valid), so this skips the constructor's checks: it runs once per collective."""
        out = object.__new__(DBuffer)
        out.mesh, out.layout, out.device, out._coordinate = self.mesh, self.layout, self.device, self._coordinate
        out.placements = tuple(placements)
        out.dtype = dtype or self.dtype
        out.num_shards = num_shards(self.mesh.shape, out.placements)
        out.shard_index = shard_index(self.mesh.shape, out.placements, self._coordinate)
        numel = self.layout.shard_numel_for(out.num_shards)
        if local_buffer is None:
            local_buffer = torch.zeros(numel, dtype=out.dtype, device=self.device)
        out.local_buffer = local_buffer
        out._refill_pending = False
        out._capacity_bytes = local_buffer.untyped_storage().nbytes()
        return out

    # ------------------------------------------------------------------ inspection

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(item.shape for item in self.layout.items)

    def __len__(self) -> int:
        return len(self.layout.items)

    def __repr__(self) -> str:
        return (
            f"DBuffer({len(self)} tensors, placements={list(self.placements)}, dtype={self.dtype}, "
            f"local={tuple(self.local_buffer.shape)}, shard {self.shard_index}/{self.num_shards})"
        )

    def local_rows(self, i: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of tensor ``i`` held by this rank (of a ragged layout: rows of
        which it holds at least one element; see :meth:`is_flat`)."""
        return self.layout.item_rows(self._item(i), self.shard_index, self.num_shards)

    def local_elements(self, i: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of the flattened tensor ``i`` held by this rank."""
        i = self._item(i)
        if isinstance(self.layout, RaggedLayout):
            return self.layout.item_elements(i, self.shard_index, self.num_shards)
        r0, r1 = self.local_rows(i)
        return r0 * self.layout.items[i].row_numel, r1 * self.layout.items[i].row_numel

    def is_flat(self, i: int) -> bool:
        """Whether tensor ``i``'s pieces are element ranges (1-D) rather than row ranges: a
        ragged layout whose shard boundaries, under these placements, split one of its rows.
        The same answer on every rank (it depends on the layout and placements only)."""
        if not isinstance(self.layout, RaggedLayout) or self.num_shards == 1:
            return False
        cache = self.__dict__.setdefault("_flat_cache", {})
        key = (self._item(i), self.num_shards)
        if key not in cache:
            cache[key] = self.layout.splits_rows(key[0], self.num_shards)
        return cache[key]

    def local_piece(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of tensor ``i`` cut out of ``full`` (its whole value), shaped like
        :meth:`get_local_tensor` (a view of ``full`` where possible): what to copy into it."""
        local_shape = self.get_local_tensor(i).shape
        if self.num_shards == 1:
            return full.reshape(local_shape)
        if self.is_flat(i):
            e0, e1 = self.local_elements(i)
            return full.reshape(-1)[e0:e1]
        r0, r1 = self.local_rows(i)
        return (full.reshape(1) if full.dim() == 0 else full)[r0:r1].reshape(local_shape)

    @property
    def is_owned(self) -> bool:
        """Whether the layout is owned (each tensor whole on one rank), whatever the placements."""
        return isinstance(self.layout, OwnedLayout)

    def owner(self, i: int) -> int:
        """The rank (coordinate on the mesh's one axis) that holds all of tensor ``i`` under
        ``Owned()``; the same on every rank and for every placement of this buffer. Only for
        buffers with an owned layout: under ``Shard(0)`` a tensor may span several ranks."""
        if not isinstance(self.layout, OwnedLayout):
            raise ValueError(
                "owner(): this buffer has a packed layout, where a tensor may span several ranks; "
                "build it with Owned() (or layout=<an Owned buffer>.layout) to have owners"
            )
        return self.layout.owner(self._item(i))

    def get_local_tensor(self, i: int) -> torch.Tensor:
        """A view of this rank's rows of tensor ``i``.

        Unsharded placements give the whole tensor in its own shape; sharded ones give
        ``(k, *shape[1:])`` with ``k`` possibly 0 (a 0-D tensor is one row: ``(k,)``). Under
        ``Owned()`` that is all rows on the owner and 0 rows elsewhere, so a loop over tensors
        needs no special case for the tensors a rank does not own. Of a ragged layout, a tensor
        whose rows a shard boundary splits (:meth:`is_flat`) gives this rank's elements, 1-D.
        """
        item = self.layout.items[self._item(i)]
        start, end = self.layout.item_local_range(self._item(i), self.shard_index, self.num_shards)
        flat = self.local_buffer[start:end]
        if self.num_shards == 1:
            return flat.view(item.shape)
        if self.is_flat(i):  # rows cut by a shard boundary: this rank's elements
            return flat
        r0, r1 = self.local_rows(i)
        return flat.view(r1 - r0, *item.shape[1:])

    def get_dtensor(self, i: int):
        """Tensor ``i`` as an exact DTensor view of this buffer; see :mod:`dbuffer.dtensor`."""
        i = self._item(i)
        shape = self.layout.items[i].shape
        if self.is_flat(i):
            counts = self.layout.elements_per_shard(i, self.num_shards)
            start = self.local_elements(i)[0]
            return make_element_dtensor(self.get_local_tensor(i), self.mesh, self.placements, shape, counts, start)
        rows = self.layout.rows_per_shard(i, self.num_shards)
        return make_dtensor(self.get_local_tensor(i), self.mesh, self.placements, shape, rows, self.shard_index)

    def _item(self, i: int) -> int:
        if not -len(self) <= i < len(self):
            raise IndexError(f"tensor index {i} out of range for a DBuffer of {len(self)} tensors")
        return i % len(self)

    # ------------------------------------------------------------------ redistribution

    def redistribute(
        self, placements: Sequence[AnyPlacement], *, out: "DBuffer | None" = None, async_op: bool = False
    ):
        """Move to ``placements``, changing any number of mesh axes in one call.

        The changed axes are inferred and ordered by :func:`dbuffer.placements.plan_redistribute`.
        With ``async_op=True`` the last collective is left in flight and a handle is returned whose
        ``wait()`` gives the result; earlier steps of a multi-step plan run synchronously.
        """
        target = check_placements(placements, self.mesh.ndim)
        check_layout_kind(target, self.is_owned)
        steps = plan_redistribute(self.placements, target)
        if out is not None:
            self._check_out(out, target, self.dtype, "redistribute")
        if not steps:
            if out is not None and out.local_buffer.data_ptr() != self.local_buffer.data_ptr():
                out.local_buffer.copy_(self.local_buffer)
            result = out if out is not None else self
            return _done(result) if async_op else result
        current = self
        for n, step in enumerate(steps):
            last = n == len(steps) - 1
            pending = current._run(step, out if last else None, async_op and last)
            if not last:
                current = pending.wait()
        return pending if async_op else pending.wait()

    def allgather(self, axis: int, *, out: "DBuffer | None" = None, async_op: bool = False):
        """All-gather over mesh ``axis``: ``Shard(0) -> Replicate()`` (or ``Owned() ->
        Replicate()``). The axis must be the innermost sharded one (otherwise the gathered shards
        would not be contiguous)."""
        return self._primitive("allgather", axis, Replicate(), out, async_op)

    def reduce_scatter(
        self,
        axis: int,
        placement: AnyPlacement | None = None,
        *,
        out: "DBuffer | None" = None,
        async_op: bool = False,
    ):
        """Reduce-scatter over mesh ``axis``: ``Partial(op) -> placement``, which is ``Shard(0)``
        for a packed layout and ``Owned()`` for an owned one (each tensor's reduction lands on
        its owner); ``None`` picks it. The axis becomes the innermost sharded one."""
        placement = self._shard_placement("reduce_scatter", placement)
        return self._primitive("reduce_scatter", axis, placement, out, async_op)

    def allreduce(self, axis: int, *, out: "DBuffer | None" = None, async_op: bool = False):
        """All-reduce over mesh ``axis``: ``Partial(op) -> Replicate()``. ``out=self`` reduces in place."""
        return self._primitive("allreduce", axis, Replicate(), out, async_op)

    def scatter(
        self,
        axis: int,
        placement: AnyPlacement | None = None,
        *,
        out: "DBuffer | None" = None,
        async_op: bool = False,
    ):
        """Local scatter over mesh ``axis``: ``Replicate() -> Shard(0)`` (``Owned()`` for an owned
        layout; ``None`` picks it), no communication. Without ``out`` the result is a view of
        this buffer."""
        placement = self._shard_placement("scatter", placement)
        return self._primitive("scatter", axis, placement, out, async_op)

    def _shard_placement(self, op: str, placement: AnyPlacement | None) -> AnyPlacement:
        expected: AnyPlacement = Owned() if self.is_owned else Shard(0)
        if placement is None:
            return expected
        if placement != expected:
            kind = "an owned" if self.is_owned else "a packed"
            raise ValueError(
                f"{op} on a buffer with {kind} layout produces {expected}; got placement={placement}"
            )
        return placement

    def cast(self, dtype: torch.dtype, *, out: "DBuffer | None" = None) -> "DBuffer":
        """The same placements in ``dtype`` (a rounding copy; exact when ``dtype`` can hold every
        value, e.g. bf16 -> fp32)."""
        if out is not None:
            self._check_out(out, self.placements, dtype, "cast")
        else:
            out = self._like(self.placements, dtype)
        out.local_buffer.copy_(self.local_buffer)
        return out

    _SOURCES = {"allgather": (Shard, Owned), "reduce_scatter": (Partial,), "allreduce": (Partial,), "scatter": (Replicate,)}

    def _primitive(self, kind: str, axis: int, new: AnyPlacement, out, async_op: bool):
        if not 0 <= axis < self.mesh.ndim:
            raise ValueError(f"axis must be in [0, {self.mesh.ndim}) for this mesh, got {axis}")
        have = self.placements[axis]
        if not isinstance(have, self._SOURCES[kind]):
            needs = " or ".join(t.__name__ for t in self._SOURCES[kind])
            raise ValueError(
                f"{kind} on axis {axis} needs a {needs} placement there, "
                f"but the buffer is {have}; use redistribute() to get there"
            )
        after = list(self.placements)
        after[axis] = new
        step = Step(kind, axis, tuple(after))  # type: ignore[arg-type]
        if kind in ("allgather", "reduce_scatter", "scatter"):
            inner = [a for a in range(axis + 1, self.mesh.ndim) if is_shard(self.placements[a])]
            if inner:
                raise ValueError(
                    f"{kind} on axis {axis} while inner axes {inner} are sharded would make "
                    f"non-contiguous shards; use redistribute(), which orders the axes for you"
                )
        if out is self and kind == "allreduce":  # in place: a new view of the same storage
            out = self._like(step.after, local_buffer=self.local_buffer)
        elif out is not None:
            self._check_out(out, step.after, self.dtype, kind)
        pending = self._run(step, out, async_op)
        return pending if async_op else pending.wait()

    def _run(self, step: Step, out: "DBuffer | None", async_op: bool) -> Pending:
        """Run one step (arguments already validated). The Pending's wait() returns a DBuffer."""
        group = self.mesh.get_group(step.axis)
        size = self.mesh.shape[step.axis]
        if out is None:
            if step.kind == "scatter":
                piece = self.local_buffer.view(size, -1)[self._coordinate[step.axis]]
                out = self._like(step.after, local_buffer=piece)
                return _done(out)
            out = self._like(step.after, local_buffer=_empty_for(self, step.after))
        dst = out.local_buffer
        src = self.local_buffer
        with out._refill_guard():
            work = self._launch(step, dst, src, group, size, async_op)
        if not async_op:
            return Pending([work], lambda: (work.wait(), out)[1])

        def finish() -> "DBuffer":
            work.wait()
            self._untrack(pending)
            out._untrack(pending)
            return out

        pending = Pending([work], finish)
        self._track(pending)  # until it is waited for, release_storage() of either waits for it
        out._track(pending)
        return pending

    def _launch(self, step: Step, dst: torch.Tensor, src: torch.Tensor, group, size: int, async_op: bool) -> Pending:
        if step.kind == "allgather":
            segments = self._sparse_owned_segments(size)
            if segments is None:
                work = collectives.all_gather(dst, src, group, async_op)
            else:
                work = self._gather_owned(dst, src, segments, group, size, async_op)
        elif step.kind == "reduce_scatter":
            op = self.placements[step.axis].reduce_op
            segments = self._sparse_owned_segments(size)
            if segments is None:
                work = collectives.reduce_scatter(dst, src, op, group, async_op)
            else:
                work = collectives.reduce_to_owners(dst, src, segments, op, group, async_op)
        elif step.kind == "allreduce":
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
            work = collectives.all_reduce(dst, self.placements[step.axis].reduce_op, group, async_op)
        else:  # scatter into out
            dst.copy_(src.view(size, -1)[self._coordinate[step.axis]])
            work = _done(dst)
        return work

    # Owned buffers move only each owner's used range (gather: broadcasts; reduction to the
    # owners: one all-to-all of unequal splits) once padded shards would carry this many times
    # the elements the tensors hold.
    _OWNED_BROADCAST_ABOVE = 1.25

    def _sparse_owned_segments(self, size: int) -> list[tuple[int, int, int]] | None:
        """``(owner, start, end)`` of each owner's tensors in the full buffer, if this is an Owned
        buffer over ``size`` ranks whose shards are mostly padding; else None."""
        if not self.is_owned or size < 2:
            return None
        cache = self.__dict__.setdefault("_segments_cache", {})  # per buffer: fixed layout, hot path
        if size not in cache:
            cache[size] = self._owned_segments(size)
        return cache[size]

    def _owned_segments(self, size: int) -> list[tuple[int, int, int]] | None:
        loads = self.layout.loads(size)
        shard = self.layout.shard_numel_for(size)
        if size * shard <= self._OWNED_BROADCAST_ABOVE * sum(loads):
            return None
        ends = [r * shard for r in range(size)]
        for k, item in enumerate(self.layout.items):  # packed from the start of the owner's shard
            r = self.layout.owner(k, size)
            ends[r] = max(ends[r], item.offset + item.numel)
        return [(r, r * shard, ends[r]) for r in range(size)]

    def _gather_owned(self, dst, src, segments, group, size: int, async_op: bool) -> Pending:
        """Own shard copied in, every owner's used range broadcast from it (every rank takes
        part in every broadcast, in the same order); the padding reads as zeros. One memset of
        the whole buffer: it is mostly padding, or this path would not be taken."""
        shard = src.numel()
        rank = self._coordinate[0]
        dst.zero_()
        dst[rank * shard : (rank + 1) * shard].copy_(src)
        return collectives.broadcast_segments(dst, segments, group, async_op)

    def _check_out(self, out: "DBuffer", placements: Sequence[AnyPlacement], dtype: torch.dtype, op: str) -> None:
        problem = None
        if not isinstance(out, DBuffer):
            problem = f"is a {type(out).__name__}, not a DBuffer"
        elif out.mesh != self.mesh:
            problem = f"lives on mesh {out.mesh}, not {self.mesh}"
        elif tuple(out.placements) != tuple(placements):
            problem = f"has placements {list(out.placements)}; the result has {list(placements)}"
        elif out.layout is not self.layout and out.layout != self.layout:
            if isinstance(out.layout, OwnedLayout) != self.is_owned:
                mine, theirs = ("an owned", "a packed") if self.is_owned else ("a packed", "an owned")
                problem = (
                    f"has {theirs} layout but this buffer has {mine} one; build out with "
                    f"layout=<this buffer>.layout"
                )
            else:
                problem = "holds different tensor shapes (a different layout)"
        elif out.dtype != dtype:
            problem = f"has dtype {out.dtype}; the result has {dtype}"
        elif out.device != self.device:
            problem = f"is on {out.device}; the result is on {self.device}"
        elif out.local_buffer.numel() != out.layout.shard_numel_for(out.num_shards):
            problem = "has released storage; call out.reallocate_storage() first"
        if problem:
            raise ValueError(f"{op}: out {problem}. Build out with DBuffer(mesh, placements, shapes, dtype) to match.")

    # ------------------------------------------------------------------ storage

    def release_storage(self) -> None:
        """Free the local storage. Views (``get_local_tensor``, parameters, tensors autograd saved)
        stay valid objects and see the storage again after :meth:`reallocate_storage`; their
        values are undefined until something writes the buffer again.

        A collective started with ``async_op=True`` that still reads this buffer (its source) or
        writes it (its ``out``) is waited for first, so that it never touches freed memory; its
        handle's ``wait()`` then returns at once."""
        self._check_owns_storage("release_storage")
        in_flight = self.__dict__.pop("_in_flight", None)
        for pending in in_flight or ():
            pending.wait()
        self.local_buffer.untyped_storage().resize_(0)

    def _track(self, pending: Pending) -> None:
        """Remember an async collective that reads or writes this buffer until it is waited for."""
        self.__dict__.setdefault("_in_flight", []).append(pending)

    def _untrack(self, pending: Pending) -> None:
        in_flight = self.__dict__.get("_in_flight")
        if in_flight and pending in in_flight:
            in_flight.remove(pending)

    def reallocate_storage(self) -> None:
        """Give the local buffer its storage back (uninitialised); a no-op if it has it.

        The first primitive that then writes into this buffer (as ``out=``) refills it without
        bumping autograd's version counter, so tensors saved for backward before the release
        stay usable: the refill restores data, it is not an in-place modification.
        """
        self._check_owns_storage("reallocate_storage")
        storage = self.local_buffer.untyped_storage()
        if storage.nbytes() != self._capacity_bytes:
            storage.resize_(self._capacity_bytes)
            self._refill_pending = True

    def _refill_guard(self):
        if not self._refill_pending:
            return contextlib.nullcontext()
        self._refill_pending = False
        return torch.autograd._unsafe_preserve_version_counter(self.local_buffer)

    def is_storage_released(self) -> bool:
        return self.local_buffer.untyped_storage().nbytes() == 0 and self._capacity_bytes > 0

    def _check_owns_storage(self, op: str) -> None:
        if self.local_buffer.storage_offset() != 0 or self._capacity_bytes != self.local_buffer.numel() * self.local_buffer.element_size():
            raise ValueError(
                f"{op}: the local buffer is a view into a larger storage (from scatter() or a "
                f"user-supplied local_buffer), so freeing it would free its neighbours too"
            )


def distribute_tensors(
    tensors: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    placements: Sequence[AnyPlacement],
    *,
    layout: Layout | None = None,
) -> DBuffer:
    """A DBuffer holding ``tensors`` (every rank passes the same full tensors), copying only the
    ranges this rank owns. ``Partial("sum")`` puts the values on the first rank of each partial
    axis and zeros elsewhere; ``Partial("avg")`` puts them everywhere. ``layout`` as for
    :class:`DBuffer` (default: owned if a placement is ``Owned()``, else packed). Only the
    values are taken: the buffer is not part of any autograd graph (``nn.Parameter`` s and tensors
    that require grad are read detached, as by torch's ``distribute_tensor``)."""
    tensors = list(tensors)
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{k}] is a {type(t).__name__}, not a torch.Tensor")
    tensors = [t.detach() for t in tensors]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"tensors have mixed dtypes {sorted(map(str, dtypes))}; a DBuffer holds one dtype, cast first")
    devices = {t.device for t in tensors}
    buf = DBuffer(
        mesh,
        placements,
        [t.shape for t in tensors],
        dtypes.pop() if dtypes else torch.float32,
        devices.pop() if len(devices) == 1 else None,
        layout=layout,
    )
    holds = all(
        buf._coordinate[a] == 0 for a, p in enumerate(buf.placements) if isinstance(p, Partial) and p.reduce_op == "sum"
    )
    if holds:
        for i, t in enumerate(tensors):
            buf.get_local_tensor(i).copy_(buf.local_piece(i, t))
    return buf


def _shapes(shapes: Shapes) -> list[tuple[int, ...]]:
    try:
        return [tuple(int(d) for d in s) for s in shapes]
    except TypeError:
        raise TypeError("tensor_shapes must be a sequence of shapes (sequences of ints)") from None


def _empty_for(buf: DBuffer, placements: Sequence[AnyPlacement]) -> torch.Tensor:
    numel = buf.layout.shard_numel_for(num_shards(buf.mesh.shape, placements))
    return torch.empty(numel, dtype=buf.dtype, device=buf.device)


def _check_local_buffer(t: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"local_buffer must be a contiguous 1-D tensor, got shape {tuple(t.shape)} "
            f"(contiguous={t.is_contiguous()}); pass t.reshape(-1).contiguous()"
        )
    if t.numel() != numel:
        raise ValueError(
            f"local_buffer has {t.numel()} elements but this rank's shard holds {numel} "
            f"(layout for these shapes and placements)"
        )
    if t.dtype != dtype:
        raise ValueError(f"local_buffer has dtype {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValueError(f"local_buffer is on {t.device}, expected {device}")


def _done(result) -> Pending:
    return Pending([], lambda: result)
