"""What :class:`~dbuffer.row_sharded.RowShardedDTensor` and
:class:`~dbuffer.element_sharded.ElementShardedDTensor` share.

Both are DTensors whose local pieces are given ranges, not ``torch.chunk``'s: rows of the tensor
(row-atomic layouts) or elements of the flattened tensor (ragged layouts). Each keeps DTensor's
spec (mesh, placements, global shape) and adds how many *units* (a row, or one element) every
shard holds. What depends only on that lives here, once: the exact full tensor (sum the
``Partial`` axes, gather every piece padded to the largest, cut the padding), ``redistribute``
through that full tensor, ``deepcopy`` and compile's tangent coercion. How an op is dispatched
differs (a view that keeps rows is not one that keeps elements) and stays in each module.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from dbuffer import collectives
from dbuffer.placements import sharded_axes

__all__ = ["PieceShardedDTensor"]


class PieceShardedDTensor(DTensor):
    """Base of the DTensors with true piece ranges. A subclass says how many units each shard
    holds (:meth:`_units_per_shard`, row-major over the sharded mesh axes) and the shape of one
    unit (:meth:`_unit_shape`); it also defines ``_with_local``, ``__torch_dispatch__`` and the
    compile/DCP hooks."""

    def _units_per_shard(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _unit_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _reduced_local(self) -> torch.Tensor:
        """This rank's piece with every ``Partial`` mesh axis summed (a copy if any)."""
        mesh, local = self.device_mesh, self._local_tensor
        for axis, p in enumerate(self.placements):
            if isinstance(p, Partial):
                local = local.clone() if local is self._local_tensor else local
                collectives.all_reduce(local, p.reduce_op, mesh.get_group(axis))
        return local

    def _gather_units(self, local: torch.Tensor) -> torch.Tensor:
        """Every shard's piece, in shard order, as ``(total units, *unit shape)``: each piece
        padded to the largest, all-gathered over the sharded axes (innermost first), unpadded."""
        counts, unit = self._units_per_shard(), self._unit_shape()
        most = max(counts)
        padded = local.new_zeros((most, *unit))
        padded[: local.shape[0]] = local  # (units, *unit shape) already: rows, or a 1-D run of elements
        gathered = padded.reshape(-1)
        for axis in reversed(sharded_axes(self.placements)):
            out = gathered.new_empty(gathered.numel() * self.device_mesh.shape[axis])
            collectives.all_gather(out, gathered, self.device_mesh.get_group(axis))
            gathered = out
        pieces = gathered.view(len(counts), most, *unit)
        return torch.cat([pieces[k, :n] for k, n in enumerate(counts)])

    def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False, **kwargs):  # type: ignore[override]
        """Any placements on this tensor's mesh, through the full tensor (exact; a gather)."""
        mesh = device_mesh or self.device_mesh
        if mesh != self.device_mesh or placements is None:
            raise NotImplementedError(
                f"a {type(self).__name__} (given ranges of a DBuffer) redistributes only on its own mesh "
                f"and needs explicit placements; redistribute the DBuffer to change meshes"
            )
        full = DTensor.from_local(self.full_tensor(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        return full.redistribute(mesh, list(placements))

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            out = self._with_local(self._local_tensor.detach().clone()).requires_grad_(self.requires_grad)
            if getattr(self, "_is_param", False):  # an nn.Parameter of this type stays one
                out._is_param = True
            memo[id(self)] = out
        return memo[id(self)]

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        return super().__coerce_same_metadata_as_tangent__(flatten_spec[0], expected_type)
