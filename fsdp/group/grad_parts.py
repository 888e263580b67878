"""What a :class:`~fsdp.group.grads.GradReducer` is built from: its group's parts and shapes,
handed down once (again when the group's buffers are rebuilt by ``to_empty``), so the reducer
never sees its group. What changes between steps comes with the call that changes it:
the route, comms and reduction settings (``replanned``), the dtypes (``convert``) and the
gradient buffer's placements (``reduce_op_changed``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import CallLabel, DBuffer
from fsdp.group.layouts import ChunkedLayout, FlatLayout, ParamKind
from fsdp.group.parts import Weights, WeightsGroup
from fsdp.group.residence import HostResidence, Residence
from fsdp.group.streams import CommStreams

__all__ = ["GradBuffers", "GradParts", "GroupWithGrads", "grad_parts"]


@dataclass(frozen=True)
class GradBuffers:
    """How the reducer makes its buffers: siblings of its group's main weights (the same
    tensors and layout on ``mesh``), on the compute ``device``; ``main_grad`` where the main
    weights live (``host``: the offload part that allocates host buffers; None: the device).
    Shapes only, not the main weights themselves, whose old storage must not outlive a
    ``module.to(dtype)``."""

    mesh: DeviceMesh
    shapes: tuple
    layout: object  # the main weights' dbuffer layout
    device: torch.device
    host: Optional[HostResidence]

    def on_device(self, placements: Sequence, dtype: torch.dtype) -> DBuffer:
        """An empty buffer on the compute device (its storage is the caller's to fill)."""
        return DBuffer(self.mesh, placements, self.shapes, dtype, self.device, layout=self.layout,
                       zero_fill=False, check_ranks=False)

    def where_main_lives(self, placements: Sequence, dtype: torch.dtype) -> DBuffer:
        """An empty buffer where the main weights live: on the host (pinned) under offload."""
        if self.host is None:
            return self.on_device(placements, dtype)
        return self.host.buffer(self.mesh, placements, self.shapes, dtype, self.layout, zero_fill=False)


@dataclass(frozen=True)
class GradParts:
    """A group's parts the reducer uses, fixed for its life: the parameter ``count``, the
    ``layout`` and ``kind`` that pack and view them, its ``buffers``, the placements of
    ``main_grad`` and of the sharded parameters (``outer``: the mesh axes above the shard axis,
    the views' leading placements), the device's ``streams``, the ``offload`` part, the
    ``weights`` part (whose unsharded parameters autograd accumulates into), the registered
    ``sharded_params`` (swapped in place, never replaced), the collectives' label and the
    group's ``names`` for messages."""

    count: int
    mesh: DeviceMesh
    layout: Union[FlatLayout, ChunkedLayout]
    kind: ParamKind
    buffers: GradBuffers
    main_grad_placements: tuple
    param_placements: tuple
    outer_placements: tuple
    streams: CommStreams
    offload: Residence
    weights: Weights
    sharded_params: list[nn.Parameter]
    call_label: CallLabel
    names: str


class GroupWithGrads(WeightsGroup, Protocol):
    """What :func:`grad_parts` reads of a group, beyond what its weights part reads."""

    weights: Weights
    streams: CommStreams
    call_label: CallLabel

    @property
    def is_meta(self) -> bool:
        """Built on the meta device and not yet given storage."""


def grad_parts(group: GroupWithGrads) -> GradParts:
    """What ``group``'s reducer is built from (again after ``to_empty`` gave it storage): its
    strategy decides here, once, whether ``main_grad`` is sharded."""
    pl, main, strategy = group.placements, group.main, group.strategy
    host = cast(HostResidence, group.offload) if group.offload.on_host and not group.is_meta else None
    return GradParts(
        len(group.infos), group.mesh, group.layout, group.kind,
        GradBuffers(group.mesh, tuple(main.shapes), main.layout, group.compute_device, host),
        main_grad_placements=pl.sharded if strategy.shard_grads else pl.replicated,
        param_placements=pl.sharded if strategy.shard_optim else pl.replicated,
        outer_placements=tuple(pl.sharded[:-1]), streams=group.streams, offload=group.offload,
        weights=group.weights, sharded_params=group.sharded_params, call_label=group.call_label, names=group.names(),
    )
