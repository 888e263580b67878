"""Placement rules and the redistribution planner. Pure: no communication happens here.

A DBuffer uses torch's own placement values, one per mesh axis:

* ``Shard(0)``: the flat buffer is split into equal contiguous shards along this axis;
* ``Replicate()``: every rank along the axis holds the same values;
* ``Partial("sum")`` / ``Partial("avg")``: the true value is the sum / mean over the axis.

Any combination is allowed. When several axes are sharded, the shard a rank holds is numbered
row-major over the sharded axes (axis 0 outermost), exactly like DTensor's nesting of
``[Shard(0), Shard(0)]``. Consequently a collective on one axis moves contiguous data only when
that axis is the *innermost* sharded axis (the last one) after a reduce-scatter or before an
all-gather; :func:`plan_redistribute` orders multi-axis changes so that this always holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = [
    "Step",
    "check_placements",
    "is_shard",
    "num_shards",
    "plan_redistribute",
    "shard_index",
    "sharded_axes",
]

REDUCE_OPS = ("sum", "avg")


def is_shard(p: Placement) -> bool:
    return isinstance(p, Shard)


def check_placements(placements: Sequence[Placement], mesh_ndim: int, name: str = "placements") -> tuple[Placement, ...]:
    """Validate ``placements`` for a mesh of ``mesh_ndim`` axes and return them as a tuple."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{name} has {len(placements)} entries but the mesh has {mesh_ndim} axes; "
            f"give exactly one placement per mesh axis"
        )
    for axis, p in enumerate(placements):
        if type(p) is Shard:
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
                f"{name}[{axis}] is {p!r}; use Shard(0), Replicate(), Partial('sum') or Partial('avg')"
            )
    return placements


def sharded_axes(placements: Sequence[Placement]) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(placements) if is_shard(p))


def num_shards(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> int:
    """How many equal shards the flat buffer is cut into under ``placements``."""
    return math.prod(mesh_shape[a] for a in sharded_axes(placements))


def shard_index(mesh_shape: Sequence[int], placements: Sequence[Placement], coordinate: Sequence[int]) -> int:
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
    after: tuple[Placement, ...]


def plan_redistribute(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Step]:
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
    """
    src, dst = tuple(src), tuple(dst)
    if len(src) != len(dst):
        raise ValueError(f"placements must have {len(src)} entries (one per mesh axis), got {len(dst)}")
    for axis, (s, d) in enumerate(zip(src, dst)):
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
    return steps
