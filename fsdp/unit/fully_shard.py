"""fully_shard: turn modules into one unit of sharded parameters, shaped like torch FSDP2's.

The module's parameters (those no nested unit owns) go into
:class:`~fsdp.group.param_group.ParameterGroup` s, sharded DTensors take their place and the class
becomes ``FSDP<Orig>``. Every argument check runs before any buffer or collective, so a misuse
raises the same error on every rank; then one collective checks that every rank shards the same
parameters with the same values (:mod:`dbuffer.agreement`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence, Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dbuffer import mesh_device
from fsdp.compose.extension_protocol import check_extension_params, split_extension_members
from fsdp.compose.extensions import SUBCLASS, SubclassWeights
from fsdp.compose.offload import AnyOffload, CPUOffloadPolicy, HostOffload, OffloadPolicy, check_offload_policy
from fsdp.compose.optim_state import OptimStateOffload
from fsdp.compose.outer_shard import check_outer_sharding, outer_sharded
from fsdp.compose.post_forward import enable_post_forward_slices
from fsdp.compose.tensor_parallel import DataParallelDims, TensorParallelKind, check_params as _check_tensor_parallel
from fsdp.group.bucket import Bucket, GroupSpec, plan_buckets
from fsdp.group.forward_only import ForwardOnlyTail, reads_only_in_forward
from fsdp.group.layout_choice import chunk_by_default
from fsdp.group.layouts import PLAIN, ChunkedLayout, ParamKind, describe_layout
from fsdp.group.members import ParamInfo
from fsdp.group.param_group import ParameterGroup
from fsdp.group.policy import MixedPrecisionPolicy, Strategy, as_policy, parse_strategy
from fsdp.group.weights import BufferWeights
from fsdp.unit import surface
from fsdp.unit.checks import (
    check_devices,
    check_mesh,
    check_offloadable,
    check_params,
    check_ranks_agree,
    check_reshard_after_forward,
    post_forward_ranks,
)
from fsdp.unit.module import FSDPModule, fsdp_class, state_of_module
from fsdp.unit.shard_placement import ShardPlacementResult
from fsdp.unit.shard_placement import resolve as resolve_shard_placements
from fsdp.unit.state import FSDPState
from fsdp.unit.surface import ArgumentTypeError, DataParallelMeshDims

__all__ = ["fully_shard"]

log = logging.getLogger("fsdp")

_OWNER = "_fsdp_owner"  # the owning unit, on the original and the sharded parameter
_IS_SHARD = "_fsdp_is_shard"  # on the sharded parameters fsdp registers, not the originals


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    sharding_strategy: Union[str, Strategy] = "optim_grads_params",
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    buckets: Sequence[Bucket] = (),
    bucket_size: Optional[int] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Union[Shard, ShardPlacementResult, None]]] = None,
    offload_policy: OffloadPolicy = OffloadPolicy(),
    dp_mesh_dims: Optional[DataParallelMeshDims] = None,
    outer_dp_sharding_strategy: str = "no_shard",
):
    """Shard ``module`` (or a list of modules forming one unit) over ``mesh``; returns it, its class
    swapped to ``FSDP<Orig>``. Nested units must be sharded first.

    ``sharding_strategy`` (Megatron-FSDP's, or an ``fsdp.Strategy``): ``"optim_grads_params"``
    (ZeRO-3, default), ``"optim_grads"`` (ZeRO-2), ``"optim"`` (ZeRO-1) or ``"no_shard"`` (DDP).
    ``mp_policy``: an :class:`fsdp.MixedPrecisionPolicy` or torch's (converted), else ``TypeError``;
    by default a parameter computes in its own dtype from FP32-or-wider main weights.
    ``ignored_params``: left alone, as in FSDP2. ``mesh``: 1-D, or 2-D ``(replicate, shard)`` for
    HSDP (gathered and reduce-scattered within the inner axis, all-reduced across the outer).
    ``buckets``: explicit groups of parameters by name with their own mesh, placement, strategy and
    policy (:class:`fsdp.Bucket`); ``bucket_size``: split the other groups at this many bytes of
    main weights.

    ``reshard_after_forward`` (FSDP2's): free the gathered weights after forward, else keep the
    unsharded parameters registered until the end of backward or :meth:`FSDPModule.reshard`;
    ``None`` (default): all units but the root, whose backward starts right after. An ``int`` ``n``
    dividing the shard group's size ``W`` (1: False, ``W``: True) keeps ``1/n`` of the weights per
    rank for backward to gather within groups of ``n`` ranks (:mod:`fsdp.compose.post_forward`, for
    ZeRO-3 plain groups on a 1-D mesh without offload; other groups reshard fully).

    Layout: by default FSDP2's ``torch.chunk(full, W, 0)[rank]`` shards as ``Shard(0)`` DTensors
    (:class:`fsdp.group.layouts.ChunkedLayout`); ``fsdp.layout_policy("auto" | "row" | "ragged")``
    around the call opts into Megatron-FSDP's flat layouts, whose gathered buffer *is* the unsharded
    parameters (:mod:`fsdp.group.layout_choice`), which ``no_shard``, HFSDP and explicit buckets
    always use. ``shard_placement_fn`` (FSDP2's), per parameter: ``Shard(dim)`` chunks on ``dim``,
    ``None`` keeps the default, ``ShardPlacementResult(placement, mesh_info)`` gives it a group on
    ``mesh_info.mesh``; another return value raises ``TypeError``, a dim the parameter lacks
    ``ValueError``. DTensor (TP, EP) parameters are sharded as in FSDP2
    (:mod:`fsdp.compose.tensor_parallel`).

    ``offload_policy``: FSDP2's ``CPUOffloadPolicy`` keeps main weights, gradients and optimizer
    state on the host and steps there (:mod:`fsdp.compose.offload`), an
    :class:`fsdp.OptimizerStateOffloadPolicy` only the optimizer state; a :class:`fsdp.Bucket` may
    set its own; anything else raises ``TypeError``. ``dp_mesh_dims`` (FSDP2's
    :class:`DataParallelMeshDims`): ``mesh`` is the full named mesh and these its data-parallel dims
    (:func:`fsdp.unit.surface.data_parallel_mesh`). ``outer_dp_sharding_strategy``: on a 2-D mesh
    ``"no_shard"`` (default) is HSDP, ``"optim"`` (HFSDP) also shards the main state across replicas
    (:mod:`fsdp.compose.outer_shard`). ``fully_shard.state(module)``: the unit's state, or None.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    plan = _plan_unit(
        modules, mesh, reshard_after_forward, mp_policy, sharding_strategy, ignored_params, buckets, bucket_size,
        shard_placement_fn, offload_policy, dp_mesh_dims, outer_dp_sharding_strategy,
    )
    return _build_unit(module, modules, plan)


fully_shard.state = state_of_module  # type: ignore[attr-defined]  # as FSDP2's contract function


@dataclass(frozen=True)
class UnitPlan:
    """What ``fully_shard`` decided for one unit, all arguments checked and agreed; the ties another
    unit owns are raised at lazy init, as FSDP2 does."""

    infos: list[ParamInfo]
    shared_with_other_units: list[str]
    mesh: DeviceMesh
    specs: list[GroupSpec]
    offloads: list[Optional[AnyOffload]]
    outer: bool
    slice_ranks: Optional[int]
    reshard_after_forward: Optional[bool]
    mp_policy: MixedPrecisionPolicy
    spmd: Optional[DataParallelDims]


def _plan_unit(
    modules: list[nn.Module], mesh, reshard_after_forward, mp_policy, sharding_strategy, ignored_params, buckets,
    bucket_size, shard_placement_fn, offload_policy, dp_mesh_dims, outer_dp_sharding_strategy,
) -> UnitPlan:
    """Check ``fully_shard``'s arguments (raising identically on every rank, before any
    collective), plan the unit's groups, then check with one collective that all ranks agree."""
    strategy = parse_strategy(sharding_strategy)
    offload = check_offload_policy(offload_policy)
    mesh, spmd = surface.data_parallel_mesh(mesh, dp_mesh_dims)
    mp_policy = as_policy(mp_policy)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise ArgumentTypeError(f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(f"{type(m).__name__} is already sharded; fully_shard each module once")
    if isinstance(buckets, Bucket):
        buckets = [buckets]
    for b, bucket in enumerate(buckets):
        if isinstance(bucket, Bucket) and bucket.offload_policy is not None:
            check_offload_policy(bucket.offload_policy, f"buckets[{b}].offload_policy")
    ignored = set(map(id, ignored_params or ()))
    infos, shared_with_other_units = _collect_params(modules, ignored)
    check_devices(infos)
    host_ok = isinstance(offload, CPUOffloadPolicy)  # parameters on the CPU stay there
    mesh = check_mesh(mesh, infos, host_ok=host_ok)
    config = (strategy, reshard_after_forward, mp_policy, buckets, bucket_size, offload, outer_dp_sharding_strategy)
    slice_ranks = post_forward_ranks(reshard_after_forward, mesh)
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, mesh)
    dims, param_meshes = resolve_shard_placements(infos, shard_placement_fn)
    specs = plan_buckets(
        [i.fqn for i in infos],
        [i.param for i in infos],
        list(buckets),
        mesh,
        strategy,
        mp_policy,
        bucket_size,
        dims,
        default_dim=0 if chunk_by_default() and outer_dp_sharding_strategy == "no_shard" else None,
        param_meshes=param_meshes,
        forward_only=[reads_only_in_forward(i) for i in infos],
    )
    for spec in specs:
        if spec.mesh is not mesh:
            check_mesh(spec.mesh, infos, what="a bucket's mesh", host_ok=host_ok)
        check_params([infos[k] for k in spec.members], spec.strategy, spec.policy)
        _check_tensor_parallel([infos[k] for k in spec.members], spec.mesh, spec.dims, spec.strategy, spmd)
    check_extension_params([i.fqn for i in infos], [i.param for i in infos], specs)
    offloads = [_offload_of(spec, offload) for spec in specs]
    for spec, policy in zip(specs, offloads):
        if policy is not None:
            check_offloadable([infos[k] for k in spec.members], type(policy).__name__)
    outer = check_outer_sharding(
        outer_dp_sharding_strategy, mesh, specs, [i.param for i in infos], next((p for p in offloads if p), None)
    )
    check_ranks_agree(mesh, infos, specs, config)
    return UnitPlan(
        infos, shared_with_other_units, mesh, specs, offloads, outer, slice_ranks, reshard_after_forward, mp_policy, spmd
    )


def _build_unit(module, modules: list[nn.Module], plan: UnitPlan):
    """Build the unit ``plan`` describes (classes swapped first, back if anything raises)."""
    classes = [type(m) for m in modules]
    try:
        for m in modules:
            m.__class__ = fsdp_class(type(m))
        groups = _build_groups(plan)
        if plan.slice_ranks is not None:  # every rank gets here: the view's groups are made together
            enable_post_forward_slices(groups, plan.mesh, plan.slice_ranks)
        state = FSDPState(modules, groups, plan.mp_policy, plan.reshard_after_forward)
        state.shared_with_other_units = plan.shared_with_other_units
        for group in groups:
            group.unsharder.register_sharded_params()
    except BaseException:
        for m, cls in zip(modules, classes):
            m.__class__ = cls
        raise
    owner = f"the unit of {classes[0].__name__}"
    for info, group_param in _sharded_of(groups):
        setattr(info.param, _OWNER, owner)  # a tied registration elsewhere still refers to it
        setattr(group_param, _OWNER, owner)
        setattr(group_param, _IS_SHARD, True)
        info.param = None
    state.install_hooks()
    for m in modules:
        m._fsdp_state = state
    return module


def _collect_params(modules: list[nn.Module], ignored: set[int]) -> tuple[list[ParamInfo], list[str]]:
    """Parameters below ``modules`` outside nested units, in registration order, ties once; and
    the errors for ties another unit owns, raised at lazy init (as FSDP2), before any collective."""
    infos: dict[int, ParamInfo] = {}
    shared: list[str] = []
    seen_modules: set[int] = set()
    for top in modules:
        stack: list[tuple[str, nn.Module]] = [("", top)]
        while stack:
            prefix, m = stack.pop()
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            for name, p in m._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                fqn = prefix + name
                if getattr(p, _IS_SHARD, False):  # a module another unit already sharded
                    raise ValueError(
                        f"parameter {fqn!r} is already owned by {getattr(p, _OWNER)} (already managed by another "
                        f"FSDP unit): its module belongs to that unit; a parameter (tied ones included) must "
                        f"belong to one unit: shard a module that holds all its uses, or fully_shard([module_a, "
                        f"module_b]) as one unit"
                    )
                if hasattr(p, _OWNER) and id(p) not in infos:  # a tie: this registration kept the original
                    shared.append(
                        f"parameter {fqn!r} is shared with a parameter already managed by another FSDP unit "
                        f"({getattr(p, _OWNER)}), and the unit of {type(modules[0]).__name__} registers it too (on its "
                        f"{type(m).__name__}); a parameter (tied ones included) must belong to one unit: register it "
                        f"on one module only and hand it to the other in forward (fsdp keeps it gathered for that "
                        f"reader, as for megatron-core's tied output layer), shard a module that holds all its uses, "
                        f"or fully_shard([module_a, module_b]) as one unit"
                    )
                info = infos.setdefault(id(p), ParamInfo(fqn, p))
                info.registrations.append((m, name))
            children = [(f"{prefix}{n}.", c) for n, c in m.named_children() if not isinstance(c, FSDPModule)]
            stack.extend(reversed(children))
    return list(infos.values()), shared


def _build_groups(plan: UnitPlan) -> list[ParameterGroup]:
    """One group per spec (tensor-subclass members in a group of their own)."""
    groups = []
    for whole, policy in zip(plan.specs, plan.offloads):
        subclass, rest = split_extension_members(whole, [i.param for i in plan.infos])
        for members_k, is_subclass in ((subclass, True), (rest, False)):
            if members_k:
                spec = replace(whole, members=members_k, dims=_dims_of(whole, members_k))
                groups.append(_build_group([plan.infos[k] for k in spec.members], spec, policy, is_subclass, plan))
    if log.isEnabledFor(logging.DEBUG):
        for group in groups:
            log.debug(
                "fully_shard: group of %d parameters (%s): %s layout, %s, %s, strategy %s, dtypes %s, mesh %s",
                len(group.infos), group.names(), describe_layout(group.layout), type(group.kind).__name__,
                type(group.weights).__name__, group.strategy.name, group.dtypes, group.mesh,
            )
    return groups


def _build_group(
    members: list[ParamInfo], spec: GroupSpec, policy: Optional[AnyOffload], is_subclass: bool, plan: UnitPlan
) -> ParameterGroup:
    """One group, every part chosen here: kind and weights (:mod:`fsdp.compose.extensions` for
    subclasses), layout, mesh and placements (HFSDP: :mod:`fsdp.compose.outer_shard`), offload and
    forward-only tail."""
    first, mesh = members[0].param, spec.mesh
    kind, weights, placements = PLAIN, BufferWeights, None
    if is_subclass:  # validated by check_extension_params: dim 0, a sharded strategy
        kind, weights = SUBCLASS, SubclassWeights
        spec.dims = [0] * len(members)  # FSDP2's pieces, whatever the layout policy
    elif isinstance(first, DTensor):
        kind = TensorParallelKind([i.param for i in members], mesh, spec.dims, plan.spmd)
    layout, shard = None, Shard(0)
    if spec.dims is not None:
        shapes = [tuple(kind.local(i.param).shape) for i in members]
        layout = ChunkedLayout(shapes, spec.dims, mesh.shape[-1], mesh.get_coordinate()[-1])
    else:  # a flat layout, cut at the spec's placement (Shard(0) or Owned())
        shard = spec.placement
        if plan.outer:  # HFSDP, validated by check_outer_sharding
            mesh, placements = outer_sharded(mesh, spec.placement)
    if isinstance(policy, CPUOffloadPolicy):
        offload = HostOffload(policy, mesh_device(mesh))
    elif policy is not None:
        offload = OptimStateOffload(policy, mesh_device(mesh))
    else:
        offload = None
    grad_dtype = first.grad_dtype if getattr(first, "_has_grad_dtype_override", False) else None
    dtypes = spec.policy.dtypes_for(first.dtype, grad_dtype, first.requires_grad)
    return ParameterGroup(
        members, mesh, spec.strategy, dtypes, first.requires_grad, shard=shard,
        gradient_divide_factor=spec.gradient_divide_factor, policy=spec.policy, offload=offload, layout=layout,
        kind=kind, placements=placements, weights=weights, own_gather=spec.own_collectives,
        forward_only=_forward_only_tail(members, spec, kind),
    )


def _forward_only_tail(members: list[ParamInfo], spec: GroupSpec, kind: ParamKind) -> Optional[ForwardOnlyTail]:
    """What frees a ZeRO-3 plain group's forward-only tail after forward; None without one."""
    if not spec.strategy.shard_params or kind is not PLAIN:
        return None
    start = len(members)
    while start and reads_only_in_forward(members[start - 1]):
        start -= 1
    return ForwardOnlyTail(start) if start < len(members) else None


def _offload_of(spec: GroupSpec, offload: Optional[AnyOffload]) -> Optional[AnyOffload]:
    """A spec's offload policy: its bucket's, else the unit's."""
    return offload if spec.offload_policy is None else check_offload_policy(spec.offload_policy)


def _dims_of(spec: GroupSpec, members: list[int]) -> Optional[list[int]]:
    if spec.dims is None:
        return None
    return [d for k, d in zip(spec.members, spec.dims) if k in set(members)]


def _sharded_of(groups: list[ParameterGroup]):
    for group in groups:
        yield from zip(group.infos, group.sharded_params)
