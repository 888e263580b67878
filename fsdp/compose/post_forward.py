"""FSDP2's ``reshard_after_forward=n``: keep 1/n of the gathered weights, regather within n ranks.

Between forward and backward ``True`` frees the gathered weights, ``False`` keeps them. An int
``n`` dividing the shard group's size ``W`` (e.g. a node's GPUs) is the middle way: each rank keeps
a ``1/n`` slice, and backward all-gathers only within its ``n`` consecutive ranks, the inner axis
of a ``(W/n, n)`` view of the shard mesh (:func:`post_forward_mesh`). The slice is a
:class:`~dbuffer.DBuffer` placed ``[Replicate(), Shard(0)]`` on the view (the unit's layout cut
into ``n`` shards), regathered by a ``redistribute`` to ``[Replicate(), Replicate()]``. A
:class:`~fsdp.group.layouts.ChunkedLayout` group keeps ``W/n`` whole rank shards of its gather
buffer instead; an ``Owned()`` group has no ``Shard(0)`` cut and reshards fully.
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
    """A mesh's views by ``n``, pickled empty: process groups do not travel with a DTensor copy."""

    def __reduce__(self):
        return (_Views, ())


def post_forward_mesh(mesh: DeviceMesh, n: int) -> DeviceMesh:
    """The ``(W/n, n)`` view of a 1-D shard mesh whose inner axis groups ``n`` consecutive ranks.
    Collective the first time for (mesh, n): call it on every rank. The view is kept on ``mesh``, so
    whether a call builds one is alike on every rank (a garbage-collected cache could hang)."""
    views = mesh.__dict__.setdefault(_VIEWS, _Views())
    view = views.get(n)
    if view is None:
        view = views[n] = DeviceMesh(
            mesh.device_type, mesh.mesh.reshape(-1, n), mesh_dim_names=("post_forward_outer", "post_forward_inner")
        )
    return view


def enable_post_forward_slices(groups: list, mesh: DeviceMesh, n: int) -> None:
    """Give every group on ``mesh`` that can keep a slice (:func:`~fsdp.group.plan.can_keep_slice`)
    its :class:`PostForwardShard` for ``n``; the others reshard fully. Collective the first time."""
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
        """The same slice for a group whose gathered buffer was rebuilt."""
        return PostForwardShard(unsharded, self.mesh)

    def keep(self, fill: Optional[Callable[[torch.Tensor, int, int], None]] = None) -> None:
        """Copy this rank's slice out of the gathered weights (freed next by the caller), or let
        ``fill(slice, start, end)`` write it where they are gone already (a chunked group)."""
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
        """Free the kept slice."""
        if not self.buffer.is_storage_released():
            self.buffer.release_storage()
