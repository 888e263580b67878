"""Megatron-FSDP's ``DBuffer``, on :class:`dbuffer.DBuffer`.

Megatron-FSDP's DBuffer is the design dbuffer descends from: many tensors in one flat buffer on
a ``DeviceMesh``, moved between placements by whole-buffer collectives. This class gives its
names (``distribute_tensors``, ``from_local``, ``offset``, ``layout.tensor_to_offset``,
``allgather(axis)``, ``reduce_scatter(axis, Flat())``, ...) over a dbuffer, which runs every
collective, and follows Megatron-FSDP's conventions where the two differ:

* **Layout.** Megatron-FSDP's packing (:class:`~fsdp.megatron.layout.GlobalLayout`), built for
  the whole mesh whatever the placements, so a replicated and a sharded buffer of the same
  tensors share one layout.
* **Nesting of sharded axes.** Megatron-FSDP keeps ``Flat`` axes a suffix and cuts the buffer
  by the *last* axis first: on an ``(outer, inner)`` mesh ``[Flat(), Flat()]`` gives rank
  ``(o, i)`` the ``o``-th piece of the ``i``-th inner shard, so that reduce-scattering the outer
  axis of an ``[Partial, Flat]`` gradient lands inside the inner shard it already holds
  (HFSDP). dbuffer nests row-major (the first axis outermost), so the dbuffer underneath lives
  on the *reversed* mesh, axes last to first, built on the same process groups: Megatron axis
  ``a`` is its axis ``ndim - 1 - a`` and the local ranges are Megatron-FSDP's.
* **Partial values.** ``distribute_tensors(tensors, mesh, [Partial()])`` keeps every rank's
  values as its partial contribution (a reduction sums them over ranks), where
  :func:`dbuffer.distribute_tensors` follows ``torch.distributed.tensor.distribute_tensor``
  (the values once, on the first rank of the axis).
* **Ranks outside the mesh** may build a buffer that shards nothing: its layout and whole local
  buffer (:mod:`fsdp.megatron.outside`); whatever needs the mesh's ranks raises there.
* **Relabelling.** ``redistribute`` from ``Replicate()`` to ``Partial("avg")`` relabels the
  buffer without communication (the mean of equal values is the value), as Megatron-FSDP does;
  dbuffer refuses to make data Partial.

Views are dbuffer's: :meth:`DBuffer.get_dtensor` is an exact DTensor (a
:class:`dbuffer.RowShardedDTensor` where the rows are not ``torch.chunk``'s) on the user's mesh
when at most one axis is sharded, else on the reversed mesh (whose nesting the rows follow).
Every check of a primitive runs before its collective, on every rank alike.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

import dbuffer
from fsdp.compose.outer_shard import transposed_mesh
from fsdp.megatron.layout import GlobalLayout
from fsdp.megatron.outside import OutsideMesh
from fsdp.megatron.placement import Flat, normalized, to_dbuffer

__all__ = ["DBuffer", "reversed_mesh"]


def reversed_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` with its axes in reverse order, on the same process groups (no collective, no new
    group); one per mesh object. A 1-D mesh is its own reverse; a named 2-D mesh shares fsdp's
    transposed mesh (HFSDP's groups live on it)."""
    if mesh.ndim == 1:
        return mesh
    cached = mesh.__dict__.get("_fsdp_megatron_reversed")
    if cached is not None:
        return cached
    if mesh.ndim == 2 and mesh.mesh_dim_names is not None:
        out = transposed_mesh(mesh)
    else:
        names = mesh.mesh_dim_names or tuple(f"axis{a}" for a in range(mesh.ndim))
        order = tuple(reversed(range(mesh.ndim)))
        out = DeviceMesh.from_group(
            [mesh.get_group(a) for a in order],
            mesh.device_type,
            mesh.mesh.permute(order).contiguous(),
            mesh_dim_names=tuple(names[a] for a in order),
        )
    mesh.__dict__["_fsdp_megatron_reversed"] = out
    return out


class DBuffer:
    """Tensors of shapes ``tensor_shapes`` in one flat buffer on ``mesh``, placed by
    ``placements`` (``Flat()``/``Shard(0)``, ``Replicate()``, ``Partial("sum" | "avg")``, one per
    axis, sharded axes last), in ``dtype``; this rank's part is ``local_buffer``, zero-filled, on
    ``device`` (default: the mesh's device). See the module docstring for what follows
    Megatron-FSDP.

    Raises, before any collective: ``ValueError`` / ``TypeError`` for placements that do not fit
    (:func:`fsdp.megatron.placement.normalized`) and for shapes Megatron-FSDP cannot lay out
    (0-D, empty rows). Construction runs dbuffer's one rank check (every rank passed the same
    arguments, else :class:`dbuffer.agreement.RankMismatchError` on every rank)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    layout: GlobalLayout
    allocation_stream: Optional[object]

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Iterable[Placement],
        tensor_shapes: Iterable[Sequence[int]],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        shapes = [torch.Size(s) for s in tensor_shapes]
        placements = normalized(placements, mesh.ndim)
        layout = GlobalLayout.build(shapes, mesh.size())
        if mesh.get_coordinate() is None:
            inner = OutsideMesh(mesh, placements, layout, dtype, device if device is not None else dbuffer.mesh_device(mesh))
        else:
            inner = dbuffer.DBuffer(reversed_mesh(mesh), to_dbuffer(placements), shapes, dtype, device, layout=layout)
        self._init(mesh, inner, None)

    def _init(self, mesh: DeviceMesh, inner: dbuffer.DBuffer, stream) -> None:
        self.mesh = mesh
        self._buffer = inner
        self._reversed = inner.mesh is not mesh  # Megatron axis a is the dbuffer's ndim - 1 - a
        self.placements = normalized(self._megatron_order(inner.placements), mesh.ndim)
        self.layout = GlobalLayout.of(inner.layout)
        if stream is None and inner.local_buffer.is_cuda:
            stream = torch.cuda.current_stream(inner.local_buffer.device)
        self.allocation_stream = stream

    def _megatron_order(self, placements: Sequence[Placement]) -> tuple[Placement, ...]:
        return tuple(reversed(placements)) if self._reversed else tuple(placements)

    def _dbuffer_order(self, placements: Sequence[Placement]) -> tuple[Placement, ...]:
        plain = tuple(Shard(0) if isinstance(p, Shard) else p for p in placements)
        return tuple(reversed(plain)) if self._reversed else plain

    @classmethod
    def wrap(cls, inner: dbuffer.DBuffer, mesh: DeviceMesh, allocation_stream=None) -> "DBuffer":
        """A view of an existing dbuffer (no copy) under Megatron-FSDP's names, for ``mesh`` (the
        user's mesh): ``inner`` lives on it, or on its reverse (:func:`reversed_mesh`). How
        :mod:`fsdp.megatron` shows fsdp's own buffers (a group's main weights, main grads).
        ``ValueError`` for a dbuffer on another mesh, or whose placements Megatron-FSDP cannot
        state (a sharded axis before an unsharded one)."""
        if inner.mesh is not mesh and inner.mesh is not reversed_mesh(mesh):
            raise ValueError(f"wrap: the dbuffer lives on {inner.mesh}, neither {mesh} nor its reverse")
        out = object.__new__(cls)
        out._init(mesh, inner, allocation_stream)
        return out

    def _view(self, inner: dbuffer.DBuffer) -> "DBuffer":
        """A buffer on this one's mesh over ``inner`` (a primitive's result)."""
        out = object.__new__(type(self))
        out._init(self.mesh, inner, None)
        return out

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_local(
        cls,
        local_buffer: torch.Tensor,
        mesh: DeviceMesh,
        placements: Iterable[Placement],
        tensor_shapes: Iterable[Sequence[int]],
        *,
        allocation_stream=None,
    ) -> "DBuffer":
        """A DBuffer around ``local_buffer`` (no copy): it must be 1-D, contiguous and exactly this
        rank's part under ``placements`` (``ValueError`` naming the size otherwise).
        ``allocation_stream``: the CUDA stream that allocated it (Megatron-LM main's; default
        the current one on CUDA, None elsewhere)."""
        if not isinstance(local_buffer, torch.Tensor):
            raise TypeError(f"local_buffer must be a torch.Tensor, got {type(local_buffer).__name__}")
        shapes = [torch.Size(s) for s in tensor_shapes]
        placements = normalized(placements, mesh.ndim)
        layout = GlobalLayout.build(shapes, mesh.size())
        if mesh.get_coordinate() is None:
            inner = OutsideMesh(mesh, placements, layout, local_buffer.dtype, local_buffer.device, local_buffer)
        else:
            inner = dbuffer.DBuffer.from_local(local_buffer, reversed_mesh(mesh), to_dbuffer(placements), shapes, layout=layout)
        out = object.__new__(cls)
        out._init(mesh, inner, allocation_stream)
        return out

    @classmethod
    def distribute_tensors(cls, tensors: Iterable[torch.Tensor], mesh: DeviceMesh, placements: Iterable[Placement]) -> "DBuffer":
        """A DBuffer of ``tensors`` (full values on this rank, on any device) on the mesh's
        device, each rank copying the part its placements give it. Under ``Partial`` every rank
        keeps its own values, its contribution to the reduction. Meta tensors give shape and
        dtype only (their range stays zero). Inputs are read detached. ``ValueError`` for no
        tensors or mixed dtypes."""
        tensors = [t.detach() for t in tensors]
        if not tensors:
            raise ValueError("DBuffer.distribute_tensors() needs at least one tensor")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(f"DBuffer.distribute_tensors(): tensors have mixed dtypes {sorted(map(str, dtypes))}; cast first")
        out = cls(mesh, placements, [t.shape for t in tensors], tensors[0].dtype, dbuffer.mesh_device(mesh))
        inner = out._buffer
        with torch.no_grad():
            for i, t in enumerate(tensors):
                if not t.is_meta:
                    inner.get_local_tensor(i).copy_(inner.local_piece(i, t.contiguous()))
        return out

    # ------------------------------------------------------------------ inspection

    @property
    def local_buffer(self) -> torch.Tensor:
        """This rank's part of the global buffer (1-D, contiguous)."""
        return self._buffer.local_buffer

    @property
    def dbuffer(self) -> dbuffer.DBuffer:
        """The :class:`dbuffer.DBuffer` underneath (on the reversed mesh where the mesh has
        several axes: see the module docstring)."""
        return self._buffer

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every tensor in the buffer."""
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        """Where ``local_buffer`` lives."""
        return self._buffer.device

    @property
    def offset(self) -> int:
        """Where ``local_buffer`` starts in the global buffer, in elements."""
        inner = self._buffer
        return inner.layout.shard_range(inner.shard_index, inner.num_shards)[0]

    @property
    def is_symmetric_memory(self) -> bool:
        """Whether the local buffer was allocated from torch's symmetric-memory pool."""
        import torch.distributed._symmetric_memory as symm_mem

        return hasattr(symm_mem, "is_symm_mem_tensor") and bool(symm_mem.is_symm_mem_tensor(self.local_buffer))

    def __repr__(self) -> str:
        return (
            f"fsdp.megatron.DBuffer({len(self.layout.items)} tensors, placements={list(self.placements)}, "
            f"dtype={self.dtype}, offset={self.offset}, local={self.local_buffer.numel()})"
        )

    def get_local_tensor(self, index: int) -> torch.Tensor:
        """A view of this rank's rows of tensor ``index`` (``(k, *shape[1:])``, ``k`` possibly 0)."""
        return self._buffer.get_local_tensor(index)

    def get_dtensor(self, index: int) -> DTensor:
        """Tensor ``index`` as an exact DTensor view of this buffer (see the module docstring)."""
        inner = self._buffer
        if self._reversed and sum(isinstance(p, Flat) for p in self.placements) <= 1:
            plain = tuple(Shard(0) if isinstance(p, Shard) else p for p in self.placements)
            inner = inner.sibling(placements=plain, mesh=self.mesh, local_buffer=inner.local_buffer)
        return inner.get_dtensor(index)

    # ------------------------------------------------------------------ storage

    def release_storage(self) -> None:
        """Free the local storage; views stay valid objects and see it again after
        :meth:`reallocate_storage` (dbuffer's: a collective in flight on it is waited for first).
        ``ValueError`` for a buffer that is a view into a larger one (from :meth:`scatter`)."""
        self._buffer.release_storage()

    def reallocate_storage(self) -> None:
        """Give the local storage back (its values undefined until written); the next primitive
        writing it refills it without bumping autograd's version counter."""
        self._buffer.reallocate_storage()

    # ------------------------------------------------------------------ primitives

    def _axis(self, op: str, mesh_axis: int, kind: type) -> int:
        """The dbuffer's axis for Megatron axis ``mesh_axis``, which must hold a ``kind`` placement."""
        ndim = self.mesh.ndim
        if not isinstance(mesh_axis, int) or not -ndim <= mesh_axis < ndim:
            raise ValueError(f"{op}(): mesh_axis must be an axis of the {ndim}-D mesh, got {mesh_axis!r}")
        mesh_axis %= ndim
        have = self.placements[mesh_axis]
        if not isinstance(have, kind):
            raise ValueError(f"{op}() requires a {kind.__name__} placement on axis {mesh_axis}; the buffer has {have}")
        return ndim - 1 - mesh_axis if self._reversed else mesh_axis

    def _out(self, out: Optional["DBuffer"], op: str) -> Optional[dbuffer.DBuffer]:
        if out is None:
            return None
        if not isinstance(out, DBuffer):
            raise TypeError(f"{op}(): out must be an fsdp.megatron.DBuffer, got {type(out).__name__}")
        if out.mesh != self.mesh:
            raise ValueError(f"{op}(): out lives on mesh {out.mesh}, not {self.mesh}")
        return out._buffer

    def _result(self, inner: dbuffer.DBuffer, out: Optional["DBuffer"]) -> "DBuffer":
        return out if out is not None else self._view(inner)

    @staticmethod
    def _check_flat(op: str, placement: Placement) -> None:
        if not (isinstance(placement, Shard) and placement.dim == 0 and type(placement) in (Shard, Flat)):
            raise NotImplementedError(f"{op}() produces Flat() (Shard(0)) only, got {placement!r}")

    def allgather(self, mesh_axis: int, *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """All-gather a ``Flat`` axis into ``Replicate()`` (into ``out`` if given)."""
        axis = self._axis("allgather", mesh_axis, Flat)
        return self._result(self._buffer.allgather(axis, out=self._out(out, "allgather")), out)

    def allreduce(self, mesh_axis: int, *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """All-reduce a ``Partial`` axis into ``Replicate()`` (sum or mean, as the placement says)."""
        axis = self._axis("allreduce", mesh_axis, Partial)
        return self._result(self._buffer.allreduce(axis, out=self._out(out, "allreduce")), out)

    def reduce_scatter(self, mesh_axis: int, new_placement: Placement = Flat(), *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """Reduce-scatter a ``Partial`` axis into ``Flat()``: each rank keeps the sum (or mean) of
        its piece."""
        axis = self._axis("reduce_scatter", mesh_axis, Partial)
        self._check_flat("reduce_scatter", new_placement)
        return self._result(self._buffer.reduce_scatter(axis, out=self._out(out, "reduce_scatter")), out)

    def scatter(self, mesh_axis: int, new_placement: Placement = Flat(), *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """Cut a ``Replicate`` axis into ``Flat()`` locally: no communication; without ``out`` the
        result is a view of this buffer's storage."""
        axis = self._axis("scatter", mesh_axis, Replicate)
        self._check_flat("scatter", new_placement)
        return self._result(self._buffer.scatter(axis, out=self._out(out, "scatter")), out)

    def redistribute(self, new_placements: Iterable[Placement], *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """Move to ``new_placements``: dbuffer plans the collectives (any number of axes may
        change). ``Replicate() -> Partial("avg")`` relabels without communication and only alone
        (``Partial("sum")`` would need a rescale: ``NotImplementedError``, as in Megatron-FSDP).
        Without a change and without ``out``, ``self``."""
        target = normalized(new_placements, self.mesh.ndim, "new_placements")
        made_partial = [a for a, (s, d) in enumerate(zip(self.placements, target)) if isinstance(d, Partial) and s != d]
        if made_partial:
            return self._relabel(target, made_partial, out)
        if out is None and target == self.placements:
            return self
        return self._result(self._buffer.redistribute(self._dbuffer_order(target), out=self._out(out, "redistribute")), out)

    def _relabel(self, target: tuple[Placement, ...], axes: list[int], out) -> "DBuffer":
        for a in axes:
            if not isinstance(self.placements[a], Replicate) or target[a].reduce_op != "avg":
                raise NotImplementedError(
                    f"redistribute: {self.placements[a]} -> {target[a]} on axis {a}: only Replicate() -> "
                    f"Partial('avg') is made without communication"
                )
        if out is not None:
            raise NotImplementedError("redistribute: Replicate() -> Partial('avg') relabels this buffer; out= is not supported")
        if any(s != d for a, (s, d) in enumerate(zip(self.placements, target)) if a not in axes):
            raise NotImplementedError("redistribute: relabel Replicate() -> Partial('avg') on its own, then redistribute")
        return self._view(self._buffer.sibling(placements=self._dbuffer_order(target), local_buffer=self.local_buffer))

    def cast(self, dtype: torch.dtype, *, out: Optional["DBuffer"] = None) -> "DBuffer":
        """The same placements in ``dtype``: ``self`` if already in it and no ``out``."""
        if out is None and dtype == self.dtype:
            return self
        return self._result(self._buffer.cast(dtype, out=self._out(out, "cast")), out)
