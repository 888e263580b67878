"""Megatron-FSDP's placements: torch's ``Replicate`` and ``Partial``, and ``Flat`` (a dim-0
``Shard`` whose local piece is part of one flat buffer), with the rules a Megatron-FSDP
:class:`~fsdp.megatron.buffer.DBuffer` follows, and :class:`Placements`, the ZeRO stage of a
``fully_shard`` call written as where each buffer lives.

Megatron-LM main spells these with torch's own classes (``Flat`` subclasses ``Shard``, so
``Flat() == Shard(0)``); megatron-fsdp 0.6.1 had classes of its own, with
``Partial(reduce_op=dist.ReduceOp.AVG)``. Both spellings are accepted: :class:`Partial` here is
torch's ``Partial`` that also takes a ``torch.distributed.ReduceOp``. Pure: no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch.distributed as dist
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Flat", "MeshAxis", "Partial", "Placement", "Placements", "Replicate", "normalized", "to_dbuffer"]

MeshAxis = Union[int, str]

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}


class Flat(Shard):
    """Megatron-FSDP's sharded placement: dim-0 rows cut out of one flat buffer, so each rank's
    piece of each tensor is whole rows and its local buffer one contiguous range. It *is* a
    ``Shard(0)`` (equal to it both ways, the same hash), so torch's ``Shard(0)`` is accepted
    wherever it is, and a DTensor view of a Flat buffer says ``Shard(0)``. Takes no arguments,
    raises nothing; a ``Shard`` of another dim is refused where placements are checked
    (:func:`normalized`: ``ValueError``)."""

    def __init__(self) -> None:
        super().__init__(0)

    def __repr__(self) -> str:
        return "Flat()"


class Partial(TorchPartial):
    """torch's ``Partial`` (``"sum"`` by default, or ``"avg"``) that also accepts megatron-fsdp
    0.6.1's ``reduce_op=torch.distributed.ReduceOp.SUM / AVG``. Equal to torch's of the same op.
    Any other op raises ``ValueError`` naming the two a DBuffer reduces with."""

    def __init__(self, reduce_op: Union[str, "dist.ReduceOp.RedOpType"] = "sum") -> None:
        if isinstance(reduce_op, dist.ReduceOp.RedOpType):
            if reduce_op not in _OPS:
                raise ValueError(f"Partial(reduce_op={reduce_op}): a DBuffer reduces by SUM or AVG only")
            reduce_op = _OPS[reduce_op]
        super().__init__(reduce_op)


def normalized(placements, ndim: int, name: str = "placements") -> tuple[Placement, ...]:
    """``placements`` (any iterable) as Megatron-FSDP states them: ``Flat()`` for a sharded axis,
    torch's ``Replicate()`` and ``Partial("sum" | "avg")``, checked against a mesh of ``ndim``
    axes. Raises ``ValueError`` for a wrong count, a placement a DBuffer cannot hold (``Shard`` of
    another dim, a reduce op other than sum / avg), and for ``Flat`` before an unsharded axis:
    Megatron-FSDP keeps sharded axes a suffix, so every local buffer is one contiguous range
    (``TypeError`` for something that is not a placement)."""
    out: list[Placement] = []
    for axis, p in enumerate(tuple(placements)):
        if isinstance(p, Shard):
            if p.dim != 0 or type(p) not in (Shard, Flat):
                raise ValueError(f"{name}[{axis}] is {p!r}; a DBuffer shards flat rows only: use Flat() (Shard(0))")
            out.append(Flat())
        elif isinstance(p, TorchPartial):
            op = _OPS.get(p.reduce_op, p.reduce_op)
            if op not in ("sum", "avg"):
                raise ValueError(f"{name}[{axis}] is {p!r}; a DBuffer reduces by Partial('sum') or Partial('avg')")
            out.append(TorchPartial(op))
        elif isinstance(p, Replicate):
            out.append(Replicate())
        else:
            raise TypeError(f"{name}[{axis}] is {p!r}; use Flat() (or Shard(0)), Replicate() or Partial('sum' | 'avg')")
    if len(out) != ndim:
        raise ValueError(f"{name} has {len(out)} entries but the mesh has {ndim} axes; give one per mesh axis")
    first_flat = next((a for a, p in enumerate(out) if isinstance(p, Flat)), len(out))
    if any(not isinstance(p, Flat) for p in out[first_flat:]):
        raise ValueError(
            f"{name} {out}: Flat placements must be a suffix of the placement list (sharded axes last), "
            f"so each local buffer is one contiguous range of the global buffer"
        )
    return tuple(out)


def to_dbuffer(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Normalized Megatron-FSDP placements as a :class:`dbuffer.DBuffer` on the *reversed* mesh
    holds them (see :mod:`fsdp.megatron.buffer`): torch's plain types, last axis first."""
    return tuple(Shard(0) if isinstance(p, Shard) else p for p in reversed(placements))


@dataclass(frozen=True)
class Placements:
    """Where a ``fully_shard`` unit keeps each buffer, one placement per data-parallel axis:
    ``parameter`` (the compute weights between uses), ``gradient`` (the main grads while a step's
    micro-batches accumulate) and ``optimizer`` (the main weights and optimizer state). The ZeRO
    stage is these placements (``Shard(0)`` and ``Flat()`` alike):

    ============================  =============  ===============  =============
    strategy                      parameter      gradient         optimizer
    ============================  =============  ===============  =============
    no_shard (DDP)                Replicate      Partial("avg")   Replicate
    ZeRO-1 (``optim``)            Replicate      Partial("avg")   Shard(0)
    ZeRO-2 (``optim_grads``)      Replicate      Shard(0)         Shard(0)
    ZeRO-3 (``optim_grads_params``) Shard(0)     Shard(0)         Shard(0)
    ============================  =============  ===============  =============

    On a 2-D ``(outer, inner)`` mesh the inner axis takes one of these rows and the outer one
    ``(Replicate, Partial("avg"), Replicate)`` (HSDP) or ``(Replicate, Partial("avg"),
    Shard(0))`` (HFSDP: the optimizer sharded across the outer axis too). A ``Partial`` gradient
    rests unreduced between micro-batches and is reduced on the last one
    (:func:`fsdp.megatron.microbatch`). ``dp_axes``: the mesh axes (indices or names) these
    lists follow, every axis of the mesh in order. Raises ``ValueError`` for lists of another
    length than ``dp_axes``."""

    dp_axes: Sequence[MeshAxis]
    parameter: Sequence[Placement]
    gradient: Sequence[Placement]
    optimizer: Sequence[Placement]

    def __post_init__(self) -> None:
        for name in ("parameter", "gradient", "optimizer"):
            if len(getattr(self, name)) != len(self.dp_axes):
                raise ValueError(
                    f"Placements: expected {len(self.dp_axes)} {name} placements (one per dp axis), "
                    f"got {len(getattr(self, name))}"
                )
