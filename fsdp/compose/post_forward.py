"""FSDP2's ``reshard_after_forward=n``: after forward keep 1/n of the gathered weights, gather in n ranks.

Between a unit's forward and its backward, ``reshard_after_forward=True`` frees the gathered
weights (backward gathers them again over the whole shard group) and ``False`` keeps them all.
An int ``n`` (a factor of the shard group's size ``W``, e.g. the GPUs of one node) is the middle
way: each rank keeps the ``1/n`` slice of the gathered weights that its position in its group of
``n`` consecutive ranks selects (a local copy, no communication), and backward all-gathers only
inside that group (intra-node on a GPU cluster) instead of over all ``W`` ranks.

The groups of ``n`` ranks are the inner axis of a 2-D view ``(W/n, n)`` of the shard mesh, built
once per (mesh, n) by :func:`post_forward_mesh` (creating process groups: every rank calls it,
from ``fully_shard``). The kept slice is shard ``j`` of the unit's own row-atomic layout cut into
``n`` shards (a layout made for ``W`` shards serves every ``n | W``), so it is a
:class:`~dbuffer.DBuffer` placed ``[Replicate(), Shard(0)]`` on that view, and the backward
gather is its ``redistribute`` to ``[Replicate(), Replicate()]`` into the unsharded buffer. A
chunked group (FSDP2's torch.chunk pieces, :class:`fsdp.group.layouts.ChunkedLayout`) keeps a slice of its shard-major
all-gather buffer instead: ``W/n`` whole rank shards, rebuilt from the unsharded parameters, and
the backward gather lands there and is copied out as after any gather. An ``Owned()`` group
(each tensor whole on one rank: no ``Shard(0)`` cut of it) keeps no slice and reshards fully.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from dbuffer import DBuffer, Pending
from fsdp.group.plan import can_keep_slice

__all__ = ["PostForwardShard", "enable_post_forward_slices", "post_forward_mesh"]

_VIEWS = "_fsdp_post_forward_views"  # the attribute of a shard mesh holding its views, by n


class _Views(dict):
    """A mesh's views by ``n``. Pickled (a DTensor saved or deep-copied takes its mesh along) as
    empty: process groups do not travel, and a copy builds its views again when first used."""

    def __reduce__(self):
        return (_Views, ())


def post_forward_mesh(mesh: DeviceMesh, n: int) -> DeviceMesh:
    """The ``(W/n, n)`` view of a 1-D shard mesh whose inner axis groups ``n`` consecutive ranks.
    Collective the first time for a given (mesh, n): call it on every rank of the mesh.

    The view is kept on ``mesh`` itself, so it lives exactly as long as the mesh and its process
    groups, and whether a call builds one (a collective) or reuses it depends only on which mesh
    object the program passes, the same on every rank of an SPMD program. A cache that dropped
    views when the garbage collector freed their last unit would decide that per rank: one rank
    still holding an old model would reuse its view while another built a new one, alone, and
    hang in the process groups' creation."""
    views = mesh.__dict__.setdefault(_VIEWS, _Views())
    view = views.get(n)
    if view is None:
        view = views[n] = DeviceMesh(
            mesh.device_type, mesh.mesh.reshape(-1, n), mesh_dim_names=("post_forward_outer", "post_forward_inner")
        )
    return view


def enable_post_forward_slices(groups: list, mesh: DeviceMesh, n: int) -> None:
    """Give every group on ``mesh`` that can keep a slice
    (:func:`~fsdp.group.plan.can_keep_slice`) its
    :class:`PostForwardShard` on the ``(W/n, n)`` view; the others reshard fully after forward,
    like ``True``. Collective the first time for (mesh, n): every rank calls it, from ``fully_shard``."""
    view = post_forward_mesh(mesh, n)
    for group in groups:
        if group.mesh is mesh and can_keep_slice(group.plan.config):
            group.unsharder.post_forward = PostForwardShard(group.weights.gathered_buffer(), view)
            group.replan()


class PostForwardShard:
    """One group's ``1/n`` slice of its gathered weights between forward and backward."""

    def __init__(self, unsharded: DBuffer, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.unsharded = unsharded
        self.buffer = unsharded.sibling([Replicate(), Shard(0)], zero_fill=False, mesh=mesh)
        self.buffer.release_storage()

    @property
    def ranks(self) -> int:
        """The ``n`` of ``reshard_after_forward=n``: the ranks a backward's gather spans."""
        return self.mesh.size(1)

    def rebuilt(self, unsharded: DBuffer) -> "PostForwardShard":
        """The same slice for a group whose gathered buffer was rebuilt (``module.to``, ``to_empty``)."""
        return PostForwardShard(unsharded, self.mesh)

    def keep(self, fill: Optional[Callable[[torch.Tensor, int, int], None]] = None) -> None:
        """Copy this rank's slice ``[start, end)`` out of the gathered weights (which the caller
        then frees), or let ``fill(slice, start, end)`` write it where the gathered buffer is gone
        already (a chunked group rebuilds it from the unsharded parameters)."""
        start, end = self.buffer.layout.shard_range(self.buffer.shard_index, self.buffer.num_shards)
        self.buffer.reallocate_storage()
        if fill is None:
            self.buffer.local_buffer.copy_(self.unsharded.local_buffer[start:end])
        else:
            fill(self.buffer.local_buffer, start, end)

    def gather(self) -> Pending:
        """All-gather the slices of the ``n`` ranks into the unsharded buffer (with storage)."""
        target = self.unsharded.sibling(
            [Replicate(), Replicate()], local_buffer=self.unsharded.local_buffer, mesh=self.mesh
        )
        return self.buffer.redistribute([Replicate(), Replicate()], out=target, async_op=True)

    def drop(self) -> None:
        if not self.buffer.is_storage_released():
            self.buffer.release_storage()
