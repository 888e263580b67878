"""Where a group's parameters sit in its flat buffers: the two layouts a group can have.

A :class:`~fsdp.group.param_group.ParameterGroup`'s DBuffers share one layout, which decides the
part of each parameter a rank keeps, the DTensor views handed out, and the copies around the
collectives. :class:`FlatLayout` (Megatron-FSDP's) packs tensors one after another, so the gathered
buffer *is* the unsharded parameters and gradients land where the reduce-scatter reads: no copies.
:class:`ChunkedLayout` (FSDP2's, the default) splits each parameter like ``torch.chunk`` and hands
out plain ``Shard(dim)`` DTensors, at the price of a copy out of every all-gather and into every
reduce-scatter. The group's :class:`ParamKind` builds what a layout hands out.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from dbuffer import DBuffer, Owned, dtensor_view
from dbuffer.layout import ChunkLayout, OwnedLayout, compute_chunk_layout, compute_layout, compute_owned_layout
from fsdp.group.layout_choice import group_layout

__all__ = ["ChunkedLayout", "FlatLayout", "ParamKind", "describe_layout", "flat_layout"]


class ParamKind:
    """Plain parameters' wrapping (:mod:`fsdp.compose.tensor_parallel` has the DTensor kind)."""

    plain = True

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor fsdp shards for ``param`` (the parameter itself here)."""
        return param

    def sharded(self, k: int, local: torch.Tensor, mesh: DeviceMesh, placements: tuple, shape: torch.Size) -> DTensor:
        """Parameter ``k``'s sharded DTensor around this rank's piece ``local``."""
        return dtensor_view(local, mesh, placements, shape)

    def unsharded(self, k: int, full: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """What modules compute with for parameter ``k`` whose whole values are ``full``."""
        return nn.Parameter(full, requires_grad=requires_grad)

    def grad_local(self, k: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Parameter ``k``'s unsharded gradient as a plain tensor of ``local``'s shape."""
        return grad


PLAIN = ParamKind()


class FlatLayout:
    """Tensors packed by a DBuffer layout (row-atomic, ragged, owned, or replicated)."""

    copies = False  # gathers land in the unsharded parameters, gradients where the reduction reads

    def __init__(self, shapes: list[tuple[int, ...]], layout) -> None:
        self.shapes = shapes
        self.layout = layout

    def buffer_shapes(self):
        """(shapes, layout) of the group's DBuffers."""
        return self.shapes, self.layout

    def views(self, buf: DBuffer, kind: ParamKind, lead: tuple) -> list[DTensor]:
        """Exact DTensor views of every tensor of a sharded buffer (DBuffer's own)."""
        return [buf.get_dtensor(k) for k in range(len(self.shapes))]

    def fill(self, main: DBuffer, tensors: list[torch.Tensor]) -> None:
        """Copy this rank's part of every full tensor into ``main``."""
        for k, t in enumerate(tensors):
            main.get_local_tensor(k).copy_(main.local_piece(k, t.detach()))

    def unsharded_buffer(self, main: DBuffer, placements, dtype, device, zero_fill: bool) -> DBuffer:
        """A replicated buffer of the full tensors: a sibling of ``main`` (same layout)."""
        return main.sibling(placements, dtype, device, zero_fill=zero_fill)

    def write_grad(self, grad_in: DBuffer, k: int, grad: Optional[torch.Tensor], add: bool) -> None:
        """Copy (``add``: add) tensor ``k``'s unsharded gradient into ``grad_in``; None: zero it."""
        view = grad_in.get_local_tensor(k)
        if grad is None:
            view.zero_()
        elif add:
            view.add_(grad)
        else:
            view.copy_(grad)

    def write_grads(self, grad_in: DBuffer, grads: list[torch.Tensor]) -> None:
        """Copy every gradient into ``grad_in``: one foreach op, or :meth:`write_grad` each."""
        views = [grad_in.get_local_tensor(k) for k in range(len(grads))]
        if any(v.shape != g.shape for v, g in zip(views, grads)):
            for k, grad in enumerate(grads):
                self.write_grad(grad_in, k, grad, add=False)
            return
        torch._foreach_copy_(views, grads)

    def padding(self, grad_in: DBuffer) -> list[tuple[int, int]]:
        """Ranges of ``grad_in``'s (full) local buffer that belong to no tensor."""
        spans = sorted((it.offset, it.offset + it.numel) for it in grad_in.layout.items)
        gaps, pos = [], 0
        for start, end in spans:
            if start > pos:
                gaps.append((pos, start))
            pos = max(pos, end)
        total = grad_in.local_buffer.numel()
        if pos < total:
            gaps.append((pos, total))
        return gaps


class ChunkedLayout:
    """FSDP2's layout: parameter ``k`` split along ``dims[k]`` like ``torch.chunk``, shard-major."""

    copies = True  # a gathered buffer copied out into the parameters; gradients copied into pieces

    def __init__(self, shapes: list[tuple[int, ...]], dims: list[int], world: int, rank: int) -> None:
        self.shapes = shapes
        self.dims = list(dims)
        self.rank = rank
        self.chunks: ChunkLayout = compute_chunk_layout(shapes, self.dims, world)
        self._flat = [(world * self.chunks.shard_numel,)]
        # whole dim-0 pieces everywhere (usual): a parameter viewed as [world, chunk * inner] is its
        # columns of the gathered rows, so one split_with_sizes_copy (FSDP2's copy-out) moves all
        items = self.chunks.items
        self._split = None
        if items and all(it.dim == 0 and self.chunks.whole_pieces(k) == world for k, it in enumerate(items)):
            self._split = [it.chunk * it.inner for it in items]  # sums to shard_numel: no padding
        self._param_views = _ViewsOf()  # per parameter, [world, piece numel] views of the unsharded weights
        self._grad_columns = _ViewsOf()  # per parameter, its [world, piece numel] columns of the gradient rows
        self._gathered_rows, self._grad_rows = _ViewsOf(), _ViewsOf()  # rows(): one view each, made once

    def buffer_shapes(self):
        return self._flat, compute_layout(self._flat, self.chunks.num_shards)

    def piece(self, buf: DBuffer, k: int) -> torch.Tensor:
        """This rank's piece of parameter ``k`` in a sharded buffer: a contiguous view."""
        start, end = self.chunks.local_range(k, self.rank)
        return buf.local_buffer[start:end].view(self.chunks.piece_shape(k, self.rank))

    def views(self, buf: DBuffer, kind: ParamKind, lead: tuple) -> list[DTensor]:
        """Plain DTensor views (``lead + (Shard(dim),)``, torch.chunk pieces) of a sharded buffer."""
        return [
            kind.sharded(k, self.piece(buf, k), buf.mesh, lead + (Shard(self.dims[k]),), torch.Size(shape))
            for k, shape in enumerate(self.shapes)
        ]

    def fill(self, main: DBuffer, tensors: list[torch.Tensor]) -> None:
        for k, t in enumerate(tensors):
            start, length = self.chunks.piece(k, self.rank)
            self.piece(main, k).copy_(t.detach().narrow(self.dims[k], start, length))

    def unsharded_buffer(self, main: DBuffer, placements, dtype, device, zero_fill: bool) -> DBuffer:
        """A replicated buffer holding the parameters in their own shapes (packed, no padding)."""
        return DBuffer(
            main.mesh, placements, self.shapes, dtype, device, layout=compute_layout(self.shapes, 1),
            zero_fill=zero_fill, check_ranks=False,
        )

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """A shard-major flat buffer (all shards or a run of them) as ``[shards, shard_numel]``."""
        return flat.view(-1, self.chunks.shard_numel)

    def gathered_rows(self, gathered: DBuffer) -> torch.Tensor:
        """:meth:`rows` of a gather's whole target, one view made once (like the other views here)."""
        return self._gathered_rows.of(gathered.local_buffer, lambda: (self.rows(gathered.local_buffer),))[0]

    def _grad_rows_of(self, grad_in: DBuffer) -> torch.Tensor:
        return self._grad_rows.of(grad_in.local_buffer, lambda: (self.rows(grad_in.local_buffer),))[0]

    def copy_out(self, rows: torch.Tensor, unsharded: DBuffer) -> None:
        """Every parameter's pieces from the gathered ``rows`` into ``unsharded``."""
        if self._split is not None:
            world = rows.shape[0]
            outs = self._param_views.of(unsharded.local_buffer, lambda: [
                unsharded.get_local_tensor(k).view(world, n) for k, n in enumerate(self._split)
            ])
            torch.split_with_sizes_copy(rows, self._split, dim=1, out=outs)
            return
        for k in range(len(self.shapes)):
            self.exchange(k, rows, unsharded.get_local_tensor(k), to_full=True)

    def fill_slice(self, unsharded: DBuffer, out: torch.Tensor, start: int, end: int) -> None:
        """Write ``[start, end)`` (whole shards) of the gathered buffer from ``unsharded``."""
        size = self.chunks.shard_numel
        first, last = start // size, end // size
        assert first * size == start and last * size == end, "a post-forward slice is whole rank shards"
        out.zero_()
        for k in range(len(self.shapes)):
            self.exchange(k, self.rows(out), unsharded.get_local_tensor(k), to_full=False, ranks=(first, last))

    def _columns(self, grad_in: DBuffer) -> list[torch.Tensor]:
        """Per parameter (``_split``), its ``[world, piece numel]`` columns of the gradient rows."""
        rows = self._grad_rows_of(grad_in)
        return self._grad_columns.of(grad_in.local_buffer, lambda: torch.split(rows, self._split, dim=1))

    def write_grads(self, grad_in: DBuffer, grads: list[torch.Tensor]) -> None:
        """Copy every gradient into its columns: FSDP2's one ``_chunk_cat`` (each gradient's
        dim-0 chunks, one per row, cast to the rows' dtype), or :meth:`write_grad` each."""
        if self._split is None or not all(g.is_contiguous() for g in grads):
            for k, grad in enumerate(grads):
                self.write_grad(grad_in, k, grad, add=False)
            return
        rows = self._grad_rows_of(grad_in)
        torch._chunk_cat(grads, dim=0, num_chunks=rows.shape[0], out=rows)

    def write_grad(self, grad_in: DBuffer, k: int, grad: Optional[torch.Tensor], add: bool) -> None:
        if self._split is not None and grad is not None and grad.is_contiguous():
            columns = self._columns(grad_in)[k]
            if add:
                columns.add_(grad.view(columns.shape))
            else:
                columns.copy_(grad.view(columns.shape))
            return
        rows = self._grad_rows_of(grad_in)
        if grad is None:
            it = self.chunks.items[k]
            rows[:, it.offset : it.offset + it.chunk * it.inner].zero_()
        else:
            self.exchange(k, rows, grad, to_full=False, add=add)

    def padding(self, grad_in: DBuffer) -> list[tuple[int, int]]:
        size = self.chunks.shard_numel
        return [(r * size + a, r * size + b) for r in range(self.chunks.num_shards) for a, b in self.chunks.padding(r)]

    def exchange(
        self, k: int, rows: torch.Tensor, full: torch.Tensor, to_full: bool, add: bool = False,
        ranks: Optional[tuple[int, int]] = None,
    ) -> None:
        """Copy parameter ``k``'s pieces in shard-major ``rows`` (all, or shards ``ranks = (lo,
        hi)``) to ``full`` or from it (``add``: added), in at most two strided copies."""
        it = self.chunks.items[k]
        lo, hi = ranks if ranks is not None else (0, self.chunks.num_shards)
        whole = self.chunks.whole_pieces(k)
        pre, post = it.shape[: it.dim], it.shape[it.dim + 1 :]
        pairs = []
        n = min(hi, whole) - lo
        if n > 0:
            pieces = rows[:n, it.offset : it.offset + it.chunk * it.inner].unflatten(1, (*pre, it.chunk, *post))
            part = full.narrow(it.dim, lo * it.chunk, n * it.chunk).unflatten(it.dim, (n, it.chunk))
            pairs.append((pieces.movedim(0, it.dim), part))
        rest = it.length - whole * it.chunk
        if rest and lo <= whole < hi:  # the one short piece
            piece = rows[whole - lo, it.offset : it.offset + rest * it.inner].view(*pre, rest, *post)
            pairs.append((piece, full.narrow(it.dim, whole * it.chunk, rest)))
        for piece, part in pairs:
            if to_full:
                part.copy_(piece)
            elif add:
                piece.add_(part)
            else:
                piece.copy_(part)


def flat_layout(shapes: list[tuple[int, ...]], mesh: DeviceMesh, shard_optim: bool, shard: Placement) -> FlatLayout:
    """Unpadded for ``no_shard``, whole tensors on balanced owners for ``Owned()``, else row-atomic
    unless that pads too much (:func:`fsdp.group.layout_choice.group_layout`)."""
    if not shard_optim:
        return FlatLayout(shapes, compute_layout(shapes, 1))
    if isinstance(shard, Owned):
        return FlatLayout(shapes, _owned_layout(shapes, mesh))
    return FlatLayout(shapes, group_layout(shapes, mesh.size()))


def describe_layout(layout) -> str:
    """A short name for logs: ``torch.chunk`` or the flat DBuffer layout's kind."""
    if isinstance(layout, ChunkedLayout):
        return "torch.chunk"
    inner = layout.layout
    if isinstance(inner, OwnedLayout):
        return "owned"
    return "ragged" if type(inner).__name__ == "RaggedLayout" else "row-atomic"


class _ViewsOf:
    """Views of one tensor, remade only for another tensor: a DBuffer's views survive
    ``release_storage`` / ``reallocate_storage`` (same storage object), so they cost Python once."""

    def __init__(self) -> None:
        self._base: Optional[torch.Tensor] = None  # the views keep it alive anyway (their ``_base``)
        self._views: Sequence[torch.Tensor] = ()

    def of(self, base: torch.Tensor, make: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        """The views ``make()`` builds of ``base``, rebuilt if they were built for another."""
        if self._base is not base:
            self._views, self._base = make(), base
        return self._views


# Elements per rank owned through earlier Owned groups on these ranks, so owners balance over the
# model (keyed by rank too: threaded test worlds). Units are built in one order, so ranks agree.
_OWNED_LOADS: dict[tuple, list[int]] = {}


def _owned_layout(shapes: list[tuple[int, ...]], mesh: DeviceMesh) -> OwnedLayout:
    n = mesh.size()
    key = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), dist.get_rank())
    loads = _OWNED_LOADS.setdefault(key, [0] * n)
    layout = compute_owned_layout(shapes, n, initial_loads=loads)
    for k, added in enumerate(layout.loads(n)):
        loads[k] += added
    return layout
