"""Placements as fsdp's arguments: which ZeRO stage a ``Placements`` is, on which mesh shape,
and what a micro-batch that is not the last one defers.

Megatron-FSDP states a strategy as placements (:class:`~fsdp.megatron.placement.Placements`);
fsdp as a ``sharding_strategy`` name, an ``outer_dp_sharding_strategy`` on a 2-D mesh, and the
FSDP2 setters that defer a reduction. :func:`plan` is the one translation, checked before any
buffer exists (``NotImplementedError`` naming the supported rows for any other combination).
Pure values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from fsdp.megatron.placement import MeshAxis, Placements

__all__ = ["Deferral", "Plan", "plan"]

# (parameter, gradient, optimizer) of the shard (innermost) axis -> fsdp's sharding_strategy.
_INNER = {
    ("R", "P", "R"): "no_shard",
    ("R", "P", "S"): "optim",
    ("R", "S", "S"): "optim_grads",
    ("S", "S", "S"): "optim_grads_params",
}
# (parameter, gradient, optimizer) of the outer axis of a 2-D mesh -> outer_dp_sharding_strategy.
_OUTER = {("R", "P", "R"): "no_shard", ("R", "P", "S"): "optim"}


class Deferral(enum.Enum):
    """What ``microbatch(..., is_last=False)`` holds back until the last micro-batch: a
    ``Partial`` gradient placement rests unreduced."""

    NOTHING = "every axis reduces each backward"  # gradients Shard(0) on every axis
    OUTER = "the reduction across the outer axis"  # HSDP / HFSDP: set_requires_all_reduce
    ALL = "every reduction"  # gradients Partial on the shard axis: set_requires_gradient_sync


@dataclass(frozen=True)
class Plan:
    """fsdp's arguments for one ``Placements`` on one mesh."""

    sharding_strategy: str
    outer_dp_sharding_strategy: str
    deferral: Deferral


def _letter(p, what: str, axis: int) -> str:
    if isinstance(p, Shard):
        if p.dim != 0:
            raise NotImplementedError(f"placements.{what}[{axis}] is {p}; only dim-0 Shard (Flat()) is supported")
        return "S"
    if isinstance(p, Partial):
        if what != "gradient" or p.reduce_op != "avg":
            raise ValueError(
                f"placements.{what}[{axis}] is {p}; only gradients may be Partial, and as Partial('avg') "
                f"(each backward averages over the data-parallel ranks; grad_divisor= divides further)"
            )
        return "P"
    if isinstance(p, Replicate):
        return "R"
    raise TypeError(f"placements.{what}[{axis}] is {p!r}; use Shard(0) (Flat()), Replicate() or Partial('avg')")


def _rows(placements: Placements, axis: int) -> tuple[str, str, str]:
    return tuple(_letter(getattr(placements, w)[axis], w, axis) for w in ("parameter", "gradient", "optimizer"))


def _axis_index(mesh: DeviceMesh, axis: MeshAxis) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, str)):
        raise TypeError(f"placements.dp_axes entries are mesh axis indices or names, got {axis!r}")
    if isinstance(axis, int):
        if not -mesh.ndim <= axis < mesh.ndim:
            raise ValueError(f"mesh axis {axis} is out of range for a {mesh.ndim}-D mesh")
        return axis % mesh.ndim
    names = mesh.mesh_dim_names or ()
    if axis not in names:
        raise ValueError(f"mesh axis {axis!r} is not one of the mesh's dim names {names}")
    return names.index(axis)


def check_dp_axes(mesh: DeviceMesh, dp_axes: Sequence[MeshAxis]) -> None:
    """Megatron-FSDP's rule: the data-parallel axes are every axis of the mesh, in order
    (``ValueError`` for repeated or unordered axes, ``NotImplementedError`` for a subset)."""
    axes = tuple(_axis_index(mesh, a) for a in dp_axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"placements.dp_axes must be distinct, got {tuple(dp_axes)!r}")
    if axes != tuple(sorted(axes)):
        raise ValueError(f"placements.dp_axes must be in mesh-axis order, got {tuple(dp_axes)!r}")
    if axes != tuple(range(mesh.ndim)):
        raise NotImplementedError(
            f"placements.dp_axes {tuple(dp_axes)!r} must name every axis of the {mesh.ndim}-D mesh, in order; "
            f"pass the data-parallel sub-mesh (e.g. mesh['dp_outer', 'dp_inner'])"
        )


def plan(placements: Placements, mesh: DeviceMesh) -> Plan:
    """The fsdp arguments of ``placements`` on ``mesh`` (1-D, or 2-D ``(outer, inner)``).
    Raises ``TypeError`` / ``ValueError`` for a malformed placement and ``NotImplementedError``
    for a combination fsdp does not train, naming the supported ones."""
    if not isinstance(placements, Placements):
        raise TypeError(f"placements must be an fsdp.megatron.Placements, got {type(placements).__name__}")
    check_dp_axes(mesh, placements.dp_axes)
    if mesh.ndim not in (1, 2):
        raise NotImplementedError(f"fsdp.megatron shards over a 1-D or 2-D (outer, inner) mesh, got {mesh.ndim}-D")
    inner = _rows(placements, mesh.ndim - 1)
    if inner not in _INNER:
        raise NotImplementedError(
            f"placements (parameter, gradient, optimizer) = {inner} on the shard axis: supported are "
            + ", ".join(f"{k} ({v})" for k, v in _INNER.items())
            + " (R: Replicate, P: Partial('avg'), S: Shard(0))"
        )
    strategy, outer, deferral = _INNER[inner], "no_shard", Deferral.ALL if inner[1] == "P" else Deferral.NOTHING
    if mesh.ndim == 2:
        row = _rows(placements, 0)
        if row not in _OUTER:
            raise NotImplementedError(
                f"placements (parameter, gradient, optimizer) = {row} on the outer axis: supported are "
                f"('R', 'P', 'R') (HSDP) and ('R', 'P', 'S') (HFSDP)"
            )
        outer = _OUTER[row]
        if outer == "optim" and strategy == "no_shard":
            raise NotImplementedError("HFSDP (optimizer Shard(0) on the outer axis) needs the optimizer sharded on the inner axis too")
        if deferral is Deferral.NOTHING:
            deferral = Deferral.OUTER
    return Plan(strategy, outer, deferral)
