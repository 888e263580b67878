"""What :class:`~dbuffer.row_sharded.RowShardedDTensor` and
:class:`~dbuffer.element_sharded.ElementShardedDTensor` share.

Both are DTensors whose local pieces are given ranges, not ``torch.chunk``'s: rows of the tensor
(row-atomic layouts) or elements of the flattened tensor (ragged layouts). Each keeps DTensor's
spec (mesh, placements, global shape) and adds how many *units* (a row, or one element) every
shard holds. What depends only on that lives here, once: the exact full tensor (sum the
``Partial`` axes, gather every piece padded to the largest, cut the padding), ``redistribute``
through that full tensor, ``deepcopy``, compile's tangent coercion, and the fallback every op
without a local rule takes (:func:`run_on_full`: compute on exact full tensors, keep this rank's
piece). Which ops run locally differs (a view that keeps rows is not one that keeps elements) and
stays in each module.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils._pytree import tree_unflatten

from dbuffer import collectives, compat
from dbuffer.placements import sharded_axes

__all__ = ["PieceShardedDTensor", "exact_full", "exact_piece", "run_on_full"]


class PieceShardedDTensor(DTensor):
    """Base of the DTensors with true piece ranges. A subclass says how many units each shard
    holds (:meth:`_units_per_shard`, row-major over the sharded mesh axes) and the shape of one
    unit (:meth:`_unit_shape`); it also defines ``_with_local``, ``__torch_dispatch__`` and the
    compile/DCP hooks."""

    def _units_per_shard(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _unit_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece cut out of ``full`` (a whole tensor shaped like this one; a view)."""
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


# torch 2.11 runs DTensor subclasses' ops in its C++ fast path, never calling their
# __torch_dispatch__: route them to it there (dbuffer.compat says how).
compat.route_subclass_dispatch(PieceShardedDTensor, compat.dtensor_subclass_dispatch_bypassed())


# ----------------------------------------------------------------------------- ops on full tensors


def exact_full(t: DTensor) -> torch.Tensor:
    """The full tensor of any DTensor this package hands out (with given pieces, or plain)."""
    if isinstance(t, PieceShardedDTensor):
        return t.full_tensor()
    return DTensor(t._local_tensor, t._spec, requires_grad=False).full_tensor()


def exact_piece(full: torch.Tensor, t: DTensor) -> torch.Tensor:
    """``t``'s local piece cut out of ``full`` (a whole tensor shaped like ``t``)."""
    if isinstance(t, PieceShardedDTensor):
        return t.piece_of(full)
    whole = DTensor.from_local(full, t.device_mesh, [Replicate()] * t.device_mesh.ndim, run_check=False)
    return whole.redistribute(t.device_mesh, t.placements)._local_tensor


def mixed_error(func) -> RuntimeError:
    """DTensor's own error for an op mixing plain tensors with DTensors."""
    return RuntimeError(
        f"{func}: got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor "
        f"before calling distributed operators!"
    )


def written(func, args: tuple, kwargs: dict) -> set[int]:
    """ids of the tensors the op writes (schema arguments marked ``(a!)``, lists included)."""
    out: set[int] = set()
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor):
                out.add(id(t))
    return out


def map_tensors(out: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(out, (list, tuple)):
        return type(out)(map_tensors(o, fn) for o in out)
    return fn(out) if isinstance(out, torch.Tensor) else out


def run_on_full(func, args: tuple, kwargs: dict, flat: list, tree) -> Any:
    """Compute on whole tensors (each DTensor operand gathered exactly), then keep this rank's
    piece: written back into operands the op modifies, and of results shaped like the first
    operand with given pieces; results of another shape come back replicated. Exact for any op,
    at the price of a gather; the path of everything without a local rule."""
    if any(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() > 0 for t in flat):
        raise mixed_error(func)
    if func is torch.ops.aten.copy_.default and isinstance(args[0], DTensor):
        return _copy_into(args[0], args[1])
    originals: dict[int, DTensor] = {}
    fulls = []
    for t in flat:
        if isinstance(t, DTensor):
            whole = exact_full(t)
            originals[id(whole)] = t
            fulls.append(whole)
        else:
            fulls.append(t)
    full_args, full_kwargs = tree_unflatten(fulls, tree)
    out = func(*full_args, **full_kwargs)
    writes = written(func, args, kwargs)
    with torch.no_grad():
        for whole, t in zip(fulls, flat):
            if isinstance(t, DTensor) and id(t) in writes:
                t._local_tensor.copy_(exact_piece(whole, t).reshape(t._local_tensor.shape))
    ref = next(t for t in flat if isinstance(t, PieceShardedDTensor))

    def result(o: torch.Tensor) -> Any:
        if id(o) in originals:
            return originals[id(o)]
        if o.shape == ref.shape:
            return ref._with_local(ref.piece_of(o).clone())
        mesh = ref.device_mesh
        return DTensor.from_local(o, mesh, [Replicate()] * mesh.ndim, run_check=False)

    return map_tensors(out, result)


def _copy_into(dst: DTensor, src: Any) -> DTensor:
    """``dst.copy_(src)`` where the pieces differ (e.g. a plain DTensor's ``torch.chunk`` rows into
    a DBuffer's rows, what torch's full-state-dict loaders do): only the source is gathered (the
    destination's old values are not needed), and ``dst`` keeps its piece of it, cast to its dtype
    (broadcast to its shape first, as ``copy_`` does)."""
    whole = exact_full(src) if isinstance(src, DTensor) else src
    whole = whole.expand(dst.shape)
    with torch.no_grad():
        dst._local_tensor.copy_(exact_piece(whole, dst).reshape(dst._local_tensor.shape))
    return dst
