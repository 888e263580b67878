"""What a :class:`~fsdp.group.grads.GradReducer` is built from, handed down once so the reducer
never sees its group; what changes between steps comes with the call that changes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import CallLabel, DBuffer
from fsdp.group.layouts import ChunkedLayout, FlatLayout, ParamKind
from fsdp.group.members import GroupPlacements, ParamInfo
from fsdp.group.parts import Weights
from fsdp.group.policy import Strategy
from fsdp.group.residence import Residence
from fsdp.group.siblings import Siblings
from fsdp.group.streams import CommStreams

__all__ = ["GradParts", "GroupWithGrads", "grad_parts"]


@dataclass(frozen=True)
class GradParts:
    """A group's parts the reducer uses, fixed for its life. ``outer_placements``: the views'
    leading placements (axes above the shard axis); ``weights``: whose unsharded parameters
    autograd accumulates into; ``sharded_params``: swapped in place, never replaced."""

    count: int
    mesh: DeviceMesh
    layout: Union[FlatLayout, ChunkedLayout]
    kind: ParamKind
    buffers: Siblings
    main_grad_placements: tuple
    param_placements: tuple
    outer_placements: tuple
    streams: CommStreams
    offload: Residence
    weights: Weights
    sharded_params: list[nn.Parameter]
    call_label: CallLabel
    names: str


class GroupWithGrads(Protocol):
    """What :func:`grad_parts` reads of a group."""

    infos: list[ParamInfo]
    mesh: DeviceMesh
    strategy: Strategy
    placements: GroupPlacements
    layout: Union[FlatLayout, ChunkedLayout]
    kind: ParamKind
    offload: Residence
    main: DBuffer
    compute_device: torch.device
    sharded_params: list[nn.Parameter]
    weights: Weights
    streams: CommStreams
    call_label: CallLabel

    def names(self) -> str:
        """The group's first parameter names, for messages."""


def grad_parts(group: GroupWithGrads) -> GradParts:
    """What ``group``'s reducer is built from; its strategy decides here, once, whether
    ``main_grad`` is sharded."""
    pl, strategy = group.placements, group.strategy
    return GradParts(
        len(group.infos), group.mesh, group.layout, group.kind, Siblings.of(group.main, group.compute_device, group.offload),
        main_grad_placements=pl.sharded if strategy.shard_grads else pl.replicated,
        param_placements=pl.sharded if strategy.shard_optim else pl.replicated,
        outer_placements=tuple(pl.sharded[:-1]), streams=group.streams, offload=group.offload,
        weights=group.weights, sharded_params=group.sharded_params, call_label=group.call_label, names=group.names(),
    )
