"""What a group is made of, as plain values: its parameters (:class:`ParamInfo`) and where its
buffers sit on the mesh (:class:`GroupPlacements`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

__all__ = ["GroupPlacements", "ParamInfo", "meta_error"]


@dataclass(frozen=True)
class GroupPlacements:
    """Where each buffer of a group lives on its mesh; gradients arrive ``Partial`` on every axis.
    ``model``: the all-gather source's, when not the main weights' (HFSDP's). ``deferred``: where
    reduce-scattered sums wait while HSDP's all-reduce is deferred."""

    sharded: tuple[Placement, ...]
    replicated: tuple[Placement, ...]
    partial: tuple[Placement, ...]
    deferred: tuple[Placement, ...] = ()
    model: Optional[tuple[Placement, ...]] = None

    @classmethod
    def for_mesh(cls, ndim: int, shard: Placement, reduce_op: str) -> "GroupPlacements":
        """A 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` one (HSDP)."""
        lead = (Replicate(),) * (ndim - 1)
        partial = (Partial(reduce_op),) * ndim
        return cls(lead + (shard,), lead + (Replicate(),), partial, deferred=partial[:-1] + (shard,))

    @classmethod
    def outer(cls, shard: Placement, reduce_op: str) -> "GroupPlacements":
        """HFSDP on a ``(shard, replicate)`` mesh: main weights and grads sharded over both axes,
        the model shard over the first (:mod:`fsdp.compose.outer_shard`)."""
        partial = (Partial(reduce_op),) * 2
        return cls(
            (shard, shard), (Replicate(), Replicate()), partial, deferred=(shard, partial[1]), model=(shard, Replicate())
        )

    def with_reduce_op(self, reduce_op: str) -> "GroupPlacements":
        """The same placements with gradients reduced by ``reduce_op``."""

        def swap(pls: tuple[Placement, ...]) -> tuple[Placement, ...]:
            return tuple(Partial(reduce_op) if p.is_partial() else p for p in pls)

        return replace(self, partial=swap(self.partial), deferred=swap(self.deferred))


@dataclass
class ParamInfo:
    """One parameter and its (module, attribute) registrations; ``param`` is dropped once built."""

    fqn: str
    param: Optional[nn.Parameter]
    registrations: list[tuple[nn.Module, str]] = field(default_factory=list)


def meta_error(fqns: list[str]) -> str:
    """FSDP2's message (tests match it) for running on parameters still on the meta device."""
    return (
        f"FSDP parameters should be materialized from meta device before training, but the following "
        f"were still on meta device: {fqns}. Call model.to_empty(device=...) and then initialise "
        f"(reset_parameters() on the sharded modules, fsdp.init_weights(model)) or load a checkpoint."
    )
