"""What a built group is, as the plain :class:`~fsdp.group.plan.GroupConfig` its plan is compiled from,
read at ``fully_shard`` and after a setter (``ParameterGroup.replan``) so the planner never sees
the group's parts.
"""

from __future__ import annotations

from typing import Optional, Protocol, Union

from torch.distributed.device_mesh import DeviceMesh

from dbuffer.layout import OwnedLayout, RaggedLayout
from fsdp.group.comms import DBUFFER_COMMS
from fsdp.group.forward_only import reads_only_in_forward
from fsdp.group.layouts import ChunkedLayout, FlatLayout, ParamKind
from fsdp.group.members import GroupPlacements, ParamInfo
from fsdp.group.parts import Comms, Weights
from fsdp.group.plan import (
    CommsKind, ForwardOnly, GatherScope, GradsTo, GroupConfig, LayoutKind, MeshKind, ModelShard, ParamsKind,
    ReplicaReduce, ResidenceKind, UnshardedStorage,
)
from fsdp.group.policy import Dtypes, MixedPrecisionPolicy, Strategy
from fsdp.group.reduction import ReduceSettings
from fsdp.group.residence import Residence
from fsdp.group.weights import BufferWeights

__all__ = ["ConfiguredGroup", "config_of"]


class ConfiguredGroup(Protocol):
    """What :func:`config_of` reads of a group."""

    infos: list[ParamInfo]
    mesh: DeviceMesh
    strategy: Strategy
    dtypes: Dtypes
    placements: GroupPlacements
    layout: Union[FlatLayout, ChunkedLayout]
    kind: ParamKind
    offload: Residence
    policy: Optional[MixedPrecisionPolicy]
    requires_grad: bool
    weights: Weights
    reduction: ReduceSettings
    comms: Comms
    own_gather: bool


def config_of(group: ConfiguredGroup, slice_ranks: Optional[int] = None) -> GroupConfig:
    """The configuration of ``group`` (weights part made, maybe not built: the plan comes first).
    ``slice_ranks``: the ``n`` of ``reshard_after_forward=n``; the plan decides if it applies."""
    layout, s, offload, policy, weights = group.layout, group.strategy, group.offload, group.policy, group.weights
    if isinstance(layout, ChunkedLayout):
        kind = LayoutKind.CHUNK
    elif isinstance(layout.layout, OwnedLayout):
        kind = LayoutKind.OWNED
    elif not s.shard_optim:
        kind = LayoutKind.WHOLE
    else:
        kind = LayoutKind.RAGGED if isinstance(layout.layout, RaggedLayout) else LayoutKind.ROW
    if not isinstance(weights, BufferWeights):
        params = ParamsKind.SUBCLASS
    else:
        params = ParamsKind.PLAIN if group.kind.plain else ParamsKind.TENSOR_PARALLEL
    if group.placements.model is not None:
        mesh = MeshKind.HFSDP
    else:
        mesh = MeshKind.HSDP if group.mesh.ndim == 2 else MeshKind.FSDP
    residence = ResidenceKind.HOST if offload.on_host else (
        ResidenceKind.OPTIM_STATE if offload.optim_state is not None else ResidenceKind.DEVICE
    )
    lean = policy is not None and not policy.persistent_param_shard
    tail = bool(group.infos) and reads_only_in_forward(group.infos[-1])
    defer = group.requires_grad and not group.reduction.all_reduce
    every = group.requires_grad and group.reduction.unused_params
    return GroupConfig(
        strategy=s, dtypes=group.dtypes, requires_grad=group.requires_grad, mesh=mesh, residence=residence,
        layout=kind, params=params, comms=CommsKind.DBUFFER if group.comms is DBUFFER_COMMS else CommsKind.CUSTOM,
        model_shard=ModelShard.LEAN if lean else ModelShard.PERSISTENT,
        gather_scope=GatherScope.OWN if group.own_gather else GatherScope.UNIT, slice_ranks=slice_ranks,
        forward_only=ForwardOnly.TAIL if tail else ForwardOnly.NONE,
        replica_reduce=ReplicaReduce.DEFERRED if defer else ReplicaReduce.NOW,
        unsharded_storage=UnshardedStorage.KEEP if weights.keep_unsharded_storage else UnshardedStorage.FREE,
        grads_to=GradsTo.EVERY if every else GradsTo.REACHED,
    )
