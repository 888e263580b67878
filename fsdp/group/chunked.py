"""ChunkedParameterGroup: fully_shard's default groups, each parameter split exactly like torch.chunk.

By default (``fsdp.layout_policy("chunk")``) every parameter is split along dim 0; with
``fully_shard(..., shard_placement_fn=fn)``, where ``fn(param)`` returns ``Shard(dim)``, along
that dim. The parameter's local shard on shard rank ``r`` of ``W`` is ``torch.chunk(full, W, dim)[r]``
(empty where torch.chunk gives fewer pieces), and the registered parameter is a plain DTensor
with placement ``Shard(dim)`` (``(Replicate(), Shard(dim))`` on an HSDP mesh): torch FSDP2's
layout. Such parameters get groups of their own (by dtype and ``requires_grad``, split at
``bucket_size`` like the flat groups), laid out by :func:`dbuffer.layout.compute_chunk_layout`:
each rank's shard is the concatenation of its padded piece of every parameter, held by the
group's DBuffers as one flat tensor of ``W * shard_numel`` elements.

The price, compared with Megatron's flat row-atomic layout (``layout_policy("auto")``, whose gathered
buffer *is* the unsharded parameters and whose gradients are written straight into the
reduce-scatter input):

* after every all-gather, a copy of the gathered (shard-major) buffer into the unsharded
  parameters (FSDP2's ``split_with_sizes_copy``), and the memory of both while it runs;
* before every reduce-scatter, each gradient is copied into its pieces of ``grad_in`` (it is
  copied there in the flat layout too, as one contiguous block instead of one per piece).

Each copy is at most two strided copies per parameter: the shards holding a whole piece at
once, then the one short piece, if any. Shard(0) costs as much as Shard(1): the shard-major
order of several parameters needs the copy either way.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from dbuffer import DBuffer
from dbuffer.layout import ChunkLayout, compute_chunk_layout, compute_layout
from fsdp.group.param_group import ParameterGroup

__all__ = ["ChunkedParameterGroup"]


class ChunkedParameterGroup(ParameterGroup):
    """A :class:`~fsdp.group.param_group.ParameterGroup` whose parameter ``k`` is split along
    ``dims[k]`` like ``torch.chunk`` over the shard axis (the mesh's last). Needs a strategy
    that shards the main weights (``optim``, ``optim_grads``, ``optim_grads_params``)."""

    def __init__(self, infos, mesh, strategy, dtypes, requires_grad, dims: list[int], **kw) -> None:
        if not strategy.shard_optim:
            raise ValueError("ChunkedParameterGroup needs a strategy that shards the main weights")
        self.dims = list(dims)
        self._shapes = [tuple(i.param.shape) for i in infos]
        super().__init__(infos, mesh, strategy, dtypes, requires_grad, **kw)

    # ------------------------------------------------------------------ layout

    def _main_layout(self, shapes, shard: Placement):
        world = self.mesh.shape[-1]
        self.chunks: ChunkLayout = compute_chunk_layout(shapes, self.dims, world)
        flat = [(world * self.chunks.shard_numel,)]  # the buffers hold one flat tensor, shard-major
        return flat, compute_layout(flat, world)

    def _rank(self) -> int:
        return self.mesh.get_coordinate()[-1]

    def _piece(self, buf: DBuffer, k: int) -> torch.Tensor:
        """This rank's piece of parameter ``k`` in a sharded buffer: a contiguous view."""
        start, end = self.chunks.local_range(k, self._rank())
        return buf.local_buffer[start:end].view(self.chunks.piece_shape(k, self._rank()))

    def _dtensors(self, buf: DBuffer) -> list[DTensor]:
        """Plain DTensor views (``Shard(dim)``, torch.chunk pieces) of a sharded buffer."""
        lead = tuple(self.placements.sharded[:-1])
        out = []
        for k, shape in enumerate(self._shapes):
            local = self._piece(buf, k)
            shape = torch.Size(shape)
            out.append(
                DTensor.from_local(
                    local, self.mesh, lead + (Shard(self.dims[k]),), run_check=False, shape=shape, stride=_stride(shape)
                )
            )
        return out

    def _exchange(
        self, k: int, flat: torch.Tensor, full: torch.Tensor, to_full: bool, add: bool = False,
        ranks: Optional[tuple[int, int]] = None,
    ) -> None:
        """Copy between parameter ``k``'s pieces in a shard-major ``flat`` buffer (all shards, or
        the shards ``ranks = (lo, hi)`` only) and the ``full`` tensor: to ``full`` (gather), or
        from it into ``flat`` (``add``: added)."""
        it = self.chunks.items[k]
        lo, hi = ranks if ranks is not None else (0, self.chunks.num_shards)
        rows = flat.view(hi - lo, self.chunks.shard_numel)
        whole = self.chunks.whole_pieces(k)
        pre, post = it.shape[: it.dim], it.shape[it.dim + 1 :]
        pairs = []
        n = min(hi, whole) - lo  # shards in range holding a whole piece: one strided copy
        if n > 0:
            pieces = rows[:n, it.offset : it.offset + it.chunk * it.inner].view(n, *pre, it.chunk, *post)
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

    # ------------------------------------------------------------------ buffers and parameters

    def _build_compute_buffers(self) -> None:
        """``model`` as in the base class; ``gathered``: the shard-major all-gather target, with
        storage only while a gather lands; ``unsharded``: the full parameters, in their shapes."""
        d = self.dtypes
        self.model = self.main if d.model == d.main else self._host(self.main.placements, d.model)
        self._release_lean_model()
        self.gathered = self._new(self.placements.replicated, d.model, zero_fill=False)
        self.gathered.release_storage()
        self.unsharded = self._full_buffer(d.model, zero_fill=not self.strategy.shard_params)
        self.unsharded_params = [self._module_param(k, self.unsharded.get_local_tensor(k)) for k in range(len(self.infos))]
        if self.strategy.shard_params:
            self.unsharded.release_storage()

    def _full_buffer(self, dtype: torch.dtype, zero_fill: bool = True, device=None) -> DBuffer:
        """A replicated buffer holding the parameters in their own shapes (packed, no padding), on
        the compute device (or ``device``)."""
        return DBuffer(
            self.mesh,
            self.placements.replicated,
            self._shapes,
            dtype,
            self.compute_device if device is None else device,
            layout=compute_layout(self._shapes, 1),
            zero_fill=zero_fill,
            check_ranks=False,
        )

    def _new_sharded_params(self) -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(t, requires_grad=self.requires_grad) for t in self._dtensors(self.main)]
        for p in params:
            p._fsdp_group = weakref.ref(self)  # found by the optimizer-step hook
        return params

    def _main_grad_views(self) -> list[DTensor]:
        s, pl = self.strategy, self.placements
        view = self.main_grad.redistribute(pl.sharded) if not s.shard_grads else self.main_grad
        return self._dtensors(view)

    @torch.no_grad()
    def _fill_main(self, params: list[torch.Tensor]) -> None:
        for k, p in enumerate(params):
            start, length = self.chunks.piece(k, self._rank())
            self._piece(self.main, k).copy_(p.detach().narrow(self.dims[k], start, length))

    # ------------------------------------------------------------------ gathers

    def _gather_target(self) -> DBuffer:
        self.gathered.reallocate_storage()
        return self.gathered

    # ------------------------------------------------------------------ reshard_after_forward=n

    def _keeps_post_forward_slice(self) -> bool:
        return type(self) is ChunkedParameterGroup  # TP and extension groups reshard fully

    def _gathered_buffer(self) -> DBuffer:
        return self.gathered

    def _keep_post_forward(self, post) -> None:
        post.keep(self._gathered, fill=self._fill_rank_shards)

    @torch.no_grad()
    def _fill_rank_shards(self, out: torch.Tensor, start: int, end: int) -> None:
        """Write ``[start, end)`` of the shard-major gathered buffer (whole rank shards, as a
        ``1/n`` slice always is) from the unsharded parameters; padding is zero."""
        size = self.chunks.shard_numel
        first, last = start // size, end // size
        assert first * size == start and last * size == end, "a post-forward slice is whole rank shards"
        out.zero_()
        for k in range(len(self.infos)):
            self._exchange(k, out, self.unsharded.get_local_tensor(k), to_full=False, ranks=(first, last))

    @torch.no_grad()
    def _end_gather(self) -> None:
        # The unsharded parameters get their storage only now, as FSDP2's copy-out allocates
        # them: a gather in flight (a prefetch) holds the gathered buffer alone, not both.
        self.unsharded.reallocate_storage()
        flat = self.gathered.local_buffer
        for k in range(len(self.infos)):
            self._exchange(k, flat, self.unsharded.get_local_tensor(k), to_full=True)
        self.gathered.release_storage()

    # ------------------------------------------------------------------ init_weights

    def _init_target(self) -> DBuffer:
        return self._full_buffer(self.dtypes.main, device=self.main.device)

    def _commit_init(self, buf: DBuffer) -> None:
        self._fill_main([buf.get_local_tensor(k) for k in range(len(self.infos))])

    # ------------------------------------------------------------------ gradients

    def _write_grad(self, k: int, grad: Optional[torch.Tensor], add: bool = False) -> None:
        flat = self.grad_in.local_buffer
        if grad is None:
            it = self.chunks.items[k]
            flat.view(self.chunks.num_shards, -1)[:, it.offset : it.offset + it.chunk * it.inner].zero_()
        else:
            self._exchange(k, flat, grad, to_full=False, add=add)

    def _padding(self) -> list[tuple[int, int]]:
        if self._gaps is None:
            size = self.chunks.shard_numel
            self._gaps = [
                (r * size + a, r * size + b) for r in range(self.chunks.num_shards) for a, b in self.chunks.padding(r)
            ]
        return self._gaps


def _stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
