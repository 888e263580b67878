"""Placement rules and the redistribution planner. Pure: no communication happens here.

A DBuffer uses torch's own placement values, one per mesh axis:

* ``Shard(0)``: the flat buffer is split into equal contiguous shards along this axis;
* ``Replicate()``: every rank along the axis holds the same values;
* ``Partial("sum")`` / ``Partial("avg")``: the true value is the sum / mean over the axis.

On a 1-D mesh a DBuffer may also use :class:`Owned` (dbuffer's own placement, not torch's): each
tensor lies whole on one rank, its owner. It cuts the flat buffer into equal shards like
``Shard(0)``, over an :class:`~dbuffer.layout.OwnedLayout` instead of the packed layout, so every
rule below treats it as a shard placement; ``Shard(0)`` and ``Owned()`` never mix in one buffer.

Any combination is allowed. When several axes are sharded, the shard a rank holds is numbered
row-major over the sharded axes (axis 0 outermost), exactly like DTensor's nesting of
``[Shard(0), Shard(0)]``. Consequently a collective on one axis moves contiguous data only when
that axis is the *innermost* sharded axis (the last one) after a reduce-scatter or before an
all-gather; :func:`plan_redistribute` orders multi-axis changes so that this always holds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, Sequence, Union

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = [
    "AnyPlacement",
    "Owned",
    "Step",
    "check_layout_kind",
    "check_placements",
    "is_shard",
    "num_shards",
    "plan_redistribute",
    "shard_index",
    "sharded_axes",
]

REDUCE_OPS = ("sum", "avg")


@dataclass(frozen=True)
class Owned:
    """Each tensor lies whole on one rank of the mesh axis, its owner; the others hold 0 rows.

    Owners are balanced by size (:func:`dbuffer.layout.assign_owners`) and each rank's tensors
    sit in its shard of an :class:`~dbuffer.layout.OwnedLayout`. All shards have one size, so
    ``Owned() -> Replicate()`` is an all-gather, ``Partial -> Owned()`` a reduce-scatter (each
    tensor's reduction lands on its owner) and ``Replicate() -> Owned()`` a local slice, exactly
    as for ``Shard(0)``. An optimizer that needs whole matrices (Muon) steps each one on its owner.

    Not a subclass of torch's ``Placement``: DTensor's sharding propagation does not know it.
    DTensor views of an Owned buffer (:meth:`dbuffer.DBuffer.get_dtensor`) therefore say
    ``Shard(0)`` and carry their true rows (all on the owner), and ``Owned`` only ever appears
    in a DBuffer's placements. Supported on 1-D meshes: a DBuffer given ``Owned()`` on a mesh of
    more axes raises ``ValueError`` naming the fix (a 1-D sub-mesh, or ``Shard(0)``). Takes no
    arguments; all instances are equal in effect.
    """

    def __repr__(self) -> str:
        return "Owned()"


AnyPlacement = Union[Placement, Owned]


def is_shard(p: AnyPlacement) -> bool:
    """Whether ``p`` cuts the flat buffer into equal contiguous shards (``Shard(0)``, ``Owned()``)."""
    return isinstance(p, (Shard, Owned))


def check_placements(placements: Sequence[AnyPlacement], mesh_ndim: int, name: str = "placements") -> tuple[AnyPlacement, ...]:
    """Validate ``placements`` for a mesh of ``mesh_ndim`` axes and return them as a tuple."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{name} has {len(placements)} entries but the mesh has {mesh_ndim} axes; "
            f"give exactly one placement per mesh axis"
        )
    for axis, p in enumerate(placements):
        if type(p) is Owned:
            if mesh_ndim != 1:
                raise ValueError(
                    f"{name}[{axis}] is Owned() on a {mesh_ndim}-D mesh; Owned() is supported on 1-D "
                    f"meshes only: use a 1-D mesh (e.g. mesh[axis_name]) or Shard(0)"
                )
        elif type(p) is Shard:
            if p.dim != 0:
                raise ValueError(
                    f"{name}[{axis}] is {p}; a DBuffer is flat, so only Shard(0) is supported"
                )
        elif type(p) is Partial:
            if p.reduce_op not in REDUCE_OPS:
                raise ValueError(
                    f"{name}[{axis}] is {p}; only Partial('sum') and Partial('avg') are supported"
                )
        elif type(p) is not Replicate:
            raise ValueError(
                f"{name}[{axis}] is {p!r}; use Shard(0), Replicate(), Partial('sum') or Partial('avg') "
                f"(or dbuffer.Owned() on a 1-D mesh)"
            )
    return placements


def check_layout_kind(placements: Sequence[AnyPlacement], owned_layout: bool, name: str = "placements") -> None:
    """``Owned()`` needs an owned layout and ``Shard(0)`` a packed one (``owned_layout`` says which
    the buffer has); raise naming the axis and the fix otherwise. Unsharded placements fit both."""
    for axis, p in enumerate(placements):
        if isinstance(p, Owned) and not owned_layout:
            raise ValueError(
                f"{name}[{axis}] is Owned() but the layout is packed (tensors split across ranks); "
                f"build the buffer with layout=compute_owned_layout(shapes, mesh.size()), or leave "
                f"layout=None with Owned() in its placements, which computes it"
            )
        if isinstance(p, Shard) and owned_layout:
            raise ValueError(
                f"{name}[{axis}] is Shard(0) but the layout is owned (each tensor whole on one rank); "
                f"use Owned() on this buffer, or a buffer with a packed layout for Shard(0)"
            )


def sharded_axes(placements: Sequence[AnyPlacement]) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(placements) if is_shard(p))


def num_shards(mesh_shape: Sequence[int], placements: Sequence[AnyPlacement]) -> int:
    """How many equal shards the flat buffer is cut into under ``placements``."""
    return math.prod(mesh_shape[a] for a in sharded_axes(placements))


def shard_index(mesh_shape: Sequence[int], placements: Sequence[AnyPlacement], coordinate: Sequence[int]) -> int:
    """The shard held by the rank at ``coordinate``: row-major over the sharded axes."""
    index = 0
    for a in sharded_axes(placements):
        index = index * mesh_shape[a] + coordinate[a]
    return index


StepKind = Literal["allgather", "reduce_scatter", "scatter", "allreduce"]


@dataclass(frozen=True)
class Step:
    """One primitive on one mesh axis; ``after`` is the placements once it has run."""

    kind: StepKind
    axis: int
    after: tuple[AnyPlacement, ...]


def plan_redistribute(src: Sequence[AnyPlacement], dst: Sequence[AnyPlacement]) -> tuple[Step, ...]:
    """Order the primitives that turn placements ``src`` into ``dst``.

    1. Let ``k`` be the outermost axis whose sharded-ness changes. Every axis from ``k`` inward
       that is sharded is all-gathered, innermost first, so each gather is on the innermost
       sharded axis. (An unchanged ``Shard`` inside ``k`` is gathered and re-scattered: its
       shards would otherwise not be contiguous. ``[S, S] -> [R, S]`` therefore costs a full
       gather; every other common move costs exactly its own collective.)
    2. Axes from ``k`` outward to inward that must end sharded are reduce-scattered (from
       ``Partial``) or scattered locally (from ``Replicate``), outermost first, so each one is the
       innermost sharded axis when it is cut.
    3. Remaining ``Partial -> Replicate`` axes are all-reduced last, on the smallest data.

    A pure function of hashable placements, planned once per pair: every gather and reduction
    of a training step asks again.
    """
    return _plan(tuple(src), tuple(dst))


@functools.lru_cache(maxsize=1024)
def _plan(src: tuple[AnyPlacement, ...], dst: tuple[AnyPlacement, ...]) -> tuple[Step, ...]:
    if len(src) != len(dst):
        raise ValueError(f"placements must have {len(src)} entries (one per mesh axis), got {len(dst)}")
    for axis, (s, d) in enumerate(zip(src, dst)):
        if is_shard(s) and is_shard(d) and type(s) is not type(d):
            raise ValueError(
                f"cannot redistribute axis {axis} from {s} to {d}: Shard(0) uses a packed layout "
                f"and Owned() an owned one, so no buffer holds both; rebuild from full tensors "
                f"(distribute_tensors) with the placement you need"
            )
        if isinstance(d, Partial) and s != d:
            raise ValueError(
                f"cannot redistribute axis {axis} from {s} to {d}: nothing turns data into "
                f"Partial; reduce first, or keep the axis {s}"
            )
    changes = [a for a, (s, d) in enumerate(zip(src, dst)) if is_shard(s) != is_shard(d)]
    steps: list[Step] = []
    cur = list(src)
    if changes:
        k = changes[0]
        for axis in reversed(range(k, len(cur))):
            if is_shard(cur[axis]):
                cur[axis] = Replicate()
                steps.append(Step("allgather", axis, tuple(cur)))
        for axis in range(k, len(cur)):
            if is_shard(dst[axis]):
                kind: StepKind = "reduce_scatter" if isinstance(cur[axis], Partial) else "scatter"
                cur[axis] = dst[axis]
                steps.append(Step(kind, axis, tuple(cur)))
    for axis, (c, d) in enumerate(zip(cur, dst)):
        if isinstance(c, Partial) and isinstance(d, Replicate):
            cur[axis] = d
            steps.append(Step("allreduce", axis, tuple(cur)))
    assert tuple(cur) == dst, (cur, dst)
    return tuple(steps)
