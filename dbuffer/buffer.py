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

Where the parts live: the class (construction, the primitives, :meth:`DBuffer.redistribute`) and
:func:`distribute_tensors` here; its tensors' local pieces and views in :mod:`dbuffer.views` and
the release / reallocation of its storage in :mod:`dbuffer.storage` (mixins: DBuffer's own
methods); each step's collective in :mod:`dbuffer.steps`; argument checks in
:mod:`dbuffer.buffer_checks`.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer import collectives
from dbuffer.agreement import check_agreement
from dbuffer.buffer_checks import (
    check_local_buffer, check_primitive, check_shapes, check_tensors, out_lacks_storage, out_mismatch, out_problem,
)
from dbuffer.collectives import Pending
from dbuffer.layout import Layout, OwnedLayout, RaggedLayout, compute_layout, compute_owned_layout
from dbuffer.placements import (
    AnyPlacement,
    Owned,
    Step,
    check_layout_kind,
    check_placements,
    num_shards,
    plan_redistribute,
    shard_index,
)
from dbuffer.steps import PreparedRedistribute, done, owned_segments, run_step
from dbuffer.storage import StorageLifetime
from dbuffer.views import TensorViews

__all__ = ["DBuffer", "distribute_tensors"]

Shapes = Sequence[Sequence[int]]


class DBuffer(TensorViews, StorageLifetime):
    """A flat buffer holding ``len(tensor_shapes)`` tensors, placed on ``mesh`` by ``placements``.

    Allocates a zero-filled local buffer (zeros, so padding never carries NaN or garbage into a
    reduction or a norm). Without ``layout``, the layout is packed (:func:`compute_layout`), or
    owned (:func:`compute_owned_layout`) when a placement is ``Owned()``; a buffer that is to
    exchange data with an Owned one (e.g. ``[Replicate()]`` or ``[Partial("avg")]``) takes
    ``layout=owned_buffer.layout``.

    Its tensors' local pieces and views (:meth:`get_local_tensor`, :meth:`get_dtensor`, ...) come
    from :class:`~dbuffer.views.TensorViews`, the release and reallocation of its storage from
    :class:`~dbuffer.storage.StorageLifetime`.
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
        made), or ``local_buffer`` is used as is (no copy). ``device``: where the local buffer
        lives (default: the mesh's device, :func:`dbuffer.mesh_device`).

        ``check_ranks``: first check that every rank of the mesh passed the same shapes, dtype,
        placements and layout (one all-gather of 8 bytes per mesh axis; see
        :mod:`dbuffer.agreement`), so that a mismatch raises
        :class:`~dbuffer.agreement.RankMismatchError` on every rank instead of crashing the
        first collective. Pass False only for a buffer known to be built alike everywhere (a
        sibling of a checked one).

        Raises, before that collective and identically on every rank: ``TypeError`` for a
        ``mesh``, ``dtype``, ``layout`` or ``tensor_shapes`` of the wrong type; ``ValueError`` for
        placements that do not fit the mesh (one per axis: ``Shard(0)``, ``Replicate()``,
        ``Partial("sum" | "avg")``, ``Owned()`` on 1-D meshes), an Owned placement without an owned
        layout (or the reverse), a rank outside the mesh, or a ``local_buffer`` of the wrong size,
        dtype or device."""
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
            layout = (compute_owned_layout if owned else compute_layout)(check_shapes(tensor_shapes), mesh.size())
        elif not isinstance(layout, (Layout, RaggedLayout)):
            raise TypeError(f"layout must be a dbuffer Layout or RaggedLayout (or None), got {type(layout).__name__}")
        check_layout_kind(self.placements, isinstance(layout, OwnedLayout))
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else collectives.mesh_device(mesh)
        self.num_shards = num_shards(mesh.shape, self.placements)
        self.shard_index = shard_index(mesh.shape, self.placements, self._coordinate)
        numel = self._shard_numel = self.layout.shard_numel_for(self.num_shards)
        if local_buffer is not None:
            check_local_buffer(local_buffer, numel, dtype, self.device)
        if check_ranks:  # the arguments are valid: the one collective of the constructor
            self._check_ranks()
        if local_buffer is None:
            make = torch.zeros if zero_fill else torch.empty
            local_buffer = make(numel, dtype=dtype, device=self.device)
        self._hold(local_buffer)

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

    def sibling(
        self,
        placements: Sequence[AnyPlacement] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        zero_fill: bool = True,
        local_buffer: torch.Tensor | None = None,
        mesh: DeviceMesh | None = None,
    ) -> "DBuffer":
        """A new DBuffer of the same tensors and layout as this one, at ``placements`` (default
        this one's), in ``dtype`` and on ``device`` (defaults: this one's), zero-filled unless
        ``zero_fill=False``, or around ``local_buffer`` (no copy); on ``mesh`` (default this
        one's: another mesh of the same ranks, e.g. a sub-mesh view, must fit the layout). No
        rank check: this buffer was built alike on every rank, so its sibling is. Raises what
        the constructor raises for placements, a local buffer or a mesh that do not fit."""
        return DBuffer(
            self.mesh if mesh is None else mesh,
            self.placements if placements is None else placements,
            self.shapes,
            self.dtype if dtype is None else dtype,
            self.device if device is None else device,
            layout=self.layout,
            local_buffer=local_buffer,
            zero_fill=zero_fill,
            check_ranks=False,
        )

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
        numel = out._shard_numel = self.layout.shard_numel_for(out.num_shards)
        if local_buffer is None:
            local_buffer = torch.zeros(numel, dtype=out.dtype, device=self.device)
        out._hold(local_buffer)
        return out

    # ------------------------------------------------------------------ inspection

    def __repr__(self) -> str:
        return (
            f"DBuffer({len(self)} tensors, placements={list(self.placements)}, dtype={self.dtype}, "
            f"local={tuple(self.local_buffer.shape)}, shard {self.shard_index}/{self.num_shards})"
        )

    # ------------------------------------------------------------------ redistribution

    def redistribute(
        self, placements: Sequence[AnyPlacement], *, out: "DBuffer | None" = None, async_op: bool = False
    ):
        """Move to ``placements``, changing any number of mesh axes in one call.

        The changed axes are inferred and ordered by :func:`dbuffer.placements.plan_redistribute`.
        With ``async_op=True`` the last collective is left in flight and a handle is returned whose
        ``wait()`` gives the result; earlier steps of a multi-step plan run synchronously.
        """
        target, steps = self._plan_to(placements)
        if out is not None:
            self._check_out(out, target, self.dtype, "redistribute")
        if not steps:
            if out is not None and out.local_buffer.data_ptr() != self.local_buffer.data_ptr():
                out.local_buffer.copy_(self.local_buffer)
            result = out if out is not None else self
            return done(result) if async_op else result
        current = self
        for n, step in enumerate(steps):
            last = n == len(steps) - 1
            pending = current._run(step, out if last else None, async_op and last)
            if not last:
                current = pending.wait()
        return pending if async_op else pending.wait()

    def prepare_redistribute(self, placements: Sequence[AnyPlacement], *, out: "DBuffer") -> PreparedRedistribute:
        """:meth:`redistribute` into ``out``, validated and planned now, run by the returned
        object's ``start()`` (async) or ``run()`` as often as needed: for a caller that moves
        the same two buffers the same way every step. Raises here what :meth:`redistribute`
        raises for ``placements`` and ``out`` (out's storage may be released now; it must have
        storage when the prepared redistribute runs)."""
        target, steps = self._plan_to(placements)
        self._check_out(out, target, self.dtype, "prepare_redistribute", out_mismatch)
        last = self._step_facts(steps[-1]) if steps else None
        return PreparedRedistribute(self, out, placements, target, steps, last)

    # Plans kept per buffer: more distinct targets than this (a user's loop over many) start over.
    _PLANS_KEPT = 8

    def _plan_to(self, placements: Sequence[AnyPlacement]) -> tuple[tuple, list]:
        """The validated target placements and the steps that reach them from this buffer's.
        Pure in this buffer's placements, mesh and layout kind, all fixed at construction: kept
        per tuple object (immutable, and what fsdp passes each step), so a repeated redistribute
        skips validation and planning; a list is validated every time (it could change)."""
        plans = self.__dict__.setdefault("_plans", {})
        hit = plans.get(id(placements)) if isinstance(placements, tuple) else None
        if hit is not None and hit[0] is placements:
            return hit[1], hit[2]
        target = check_placements(placements, self.mesh.ndim)
        check_layout_kind(target, self.is_owned)
        steps = plan_redistribute(self.placements, target)
        if isinstance(placements, tuple):
            if len(plans) >= self._PLANS_KEPT:
                plans.clear()
            plans[id(placements)] = (placements, target, steps)  # holds it: its id is not reused
        return target, steps

    def _axis_group(self, axis: int) -> tuple[int, torch.distributed.ProcessGroup]:
        """``(size, process group)`` of mesh ``axis``: fixed for the mesh, asked by every
        collective (DeviceMesh computes both in Python at each call)."""
        groups = self.__dict__.setdefault("_axis_groups", {})
        hit = groups.get(axis)
        if hit is None or hit[0] is not self.mesh:
            hit = groups[axis] = (self.mesh, self.mesh.shape[axis], self.mesh.get_group(axis))
        return hit[1], hit[2]

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
        if out is None:
            out = self._like(self.placements, dtype)
        else:  # out's fit (mesh, placements, layout, dtype, device: fixed) checked once per out
            fits = self.__dict__.get("_cast_fits")
            if fits is None or fits[0]() is not out or fits[1] is not dtype or out_lacks_storage(out):
                self._check_out(out, self.placements, dtype, "cast")
                self.__dict__["_cast_fits"] = (weakref.ref(out), dtype)  # weak: out is the caller's to drop
        out.local_buffer.copy_(self.local_buffer)
        return out

    def _primitive(self, kind: str, axis: int, new: AnyPlacement, out, async_op: bool):
        check_primitive(kind, axis, self.placements, self.mesh.ndim)
        after = list(self.placements)
        after[axis] = new
        step = Step(kind, axis, tuple(after))  # type: ignore[arg-type]
        if out is self and kind == "allreduce":  # in place: a new view of the same storage
            out = self._like(step.after, local_buffer=self.local_buffer)
        elif out is not None:
            self._check_out(out, step.after, self.dtype, kind)
        pending = self._run(step, out, async_op)
        return pending if async_op else pending.wait()

    def _run(self, step: Step, out: "DBuffer | None", async_op: bool) -> Pending:
        """Run one step (arguments already validated). The Pending's wait() returns a DBuffer."""
        size, group, segments = self._step_facts(step)
        if out is None and step.kind == "scatter":  # a local slice: a view
            piece = self.local_buffer.view(size, -1)[self._coordinate[step.axis]]
            return done(self._like(step.after, local_buffer=piece))
        if out is None:
            out = self._like(step.after, local_buffer=_empty_for(self, step.after))
        return run_step(self, step, out, async_op, size, group, segments)

    def _step_facts(self, step: Step) -> tuple[int, object, list[tuple[int, int, int]] | None]:
        """``(size, process group, sparse Owned segments)`` a step of this buffer runs with: a
        local scatter has no group, only gathers and reductions to owners take segments."""
        if step.kind == "scatter":
            return self.mesh.shape[step.axis], None, None
        size, group = self._axis_group(step.axis)
        return size, group, self._sparse_owned_segments(size) if step.kind in ("allgather", "reduce_scatter") else None

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
            cache[size] = owned_segments(self.layout, size, self._OWNED_BROADCAST_ABOVE)
        return cache[size]

    def _check_out(self, out: "DBuffer", placements: Sequence[AnyPlacement], dtype: torch.dtype, op: str,
                   find=out_problem) -> None:
        """Raise ``ValueError`` naming ``op`` if ``find`` (default :func:`out_problem`) finds
        ``out`` unfit for the result."""
        if not isinstance(out, DBuffer):
            problem = f"is a {type(out).__name__}, not a DBuffer"
        else:
            problem = find(self, out, placements, dtype)
        if problem:
            raise ValueError(f"{op}: out {problem}. Build out with DBuffer(mesh, placements, shapes, dtype) to match.")


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
    that require grad are read detached, as by torch's ``distribute_tensor``).

    ``mesh`` and ``placements`` as for :class:`DBuffer`. Raises ``TypeError`` for an element that
    is not a tensor, ``ValueError`` for mixed dtypes, and what :class:`DBuffer` raises
    (its rank check included: every rank must pass tensors of the same shapes)."""
    tensors, dtype, device = check_tensors(tensors)
    buf = DBuffer(
        mesh,
        placements,
        [t.shape for t in tensors],
        dtype,
        device,
        layout=layout,
    )
    holds = all(
        buf._coordinate[a] == 0 for a, p in enumerate(buf.placements) if isinstance(p, Partial) and p.reduce_op == "sum"
    )
    if holds:
        for i, t in enumerate(tensors):
            buf.get_local_tensor(i).copy_(buf.local_piece(i, t))
    return buf


def _empty_for(buf: DBuffer, placements: Sequence[AnyPlacement]) -> torch.Tensor:
    numel = buf.layout.shard_numel_for(num_shards(buf.mesh.shape, placements))
    return torch.empty(numel, dtype=buf.dtype, device=buf.device)
