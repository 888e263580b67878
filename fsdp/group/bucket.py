"""Buckets: which parameters of a unit communicate together, where, and how.

Default groups: (dtype, requires_grad) in registration order, one reduce-scatter each, sharing one
all-gather where they can (:mod:`fsdp.group.shared_gather`) as in FSDP2; ``bucket_size`` splits
them. A :class:`Bucket` gives the parameters it matches, across modules, their own mesh, placement,
strategy and precision policy. Groups keep registration order (forward-only ones last:
:mod:`fsdp.group.forward_only`), so all ranks pack the same bytes in any gradient order.
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp.group.policy import MixedPrecisionPolicy, Strategy, as_policy, parse_strategy

__all__ = ["Bucket", "GroupSpec", "mesh_key", "plan_buckets"]


@dataclass(frozen=True)
class Bucket:
    """Parameters whose name (relative to the module given to ``fully_shard``) matches one of the
    ``fnmatch`` patterns ``names`` (e.g. ``"*.experts.*"``), with settings of their own.
    ``placement``: ``Shard(0)`` (row-atomic packing) or ``dbuffer.Owned()`` (each tensor whole on
    one rank, owners balanced by size, for optimizers needing whole matrices such as Muon).
    ``mesh``: 1-D or 2-D (HSDP), default the unit's. ``per_tensor``: one collective per tensor,
    split evenly along dim 0 into plain ``Shard(0)`` DTensors (stacked MoE experts, unpadded).
    ``gradient_divide_factor``: divide the summed gradients by this, not the mesh size (expert
    parallelism: by the data-parallel world, as an expert's gradient sums its EP group's).
    ``sharding_strategy``, ``mp_policy``, ``offload_policy``: ``fully_shard``'s, for this bucket
    (None: the unit's; ``OffloadPolicy()``: none). Bitwise results as without buckets.
    ``fully_shard`` checks it before any buffer or collective exists, raising ``ValueError`` naming
    the bucket for a pattern matching nothing, a parameter in two buckets, a placement other than
    ``Shard(0)`` / ``Owned()``, ``Owned()`` on a 2-D mesh, a ``per_tensor`` dim 0 the shard count
    does not divide, a non-positive ``gradient_divide_factor``, a ``shard_placement_fn`` dim for its
    parameters or a bad ``OptimizerStateOffloadPolicy.step``; ``TypeError`` for a mistyped ``mesh``,
    ``mp_policy`` or ``offload_policy``."""

    names: Union[str, Sequence[str]]
    placement: Placement = Shard(0)
    mesh: Optional[DeviceMesh] = None
    sharding_strategy: Optional[Union[str, Strategy]] = None
    mp_policy: Optional[MixedPrecisionPolicy] = None
    per_tensor: bool = False
    gradient_divide_factor: Optional[float] = None
    offload_policy: Optional[OffloadPolicy] = None

    @property
    def patterns(self) -> tuple[str, ...]:
        """``names`` as a tuple of patterns."""
        return (self.names,) if isinstance(self.names, str) else tuple(self.names)

    def matches(self, fqn: str) -> bool:
        """Whether the parameter name ``fqn`` matches one of the patterns (``fnmatchcase``)."""
        return any(fnmatch.fnmatchcase(fqn, pattern) for pattern in self.patterns)


@dataclass
class GroupSpec:
    """One ParameterGroup to build: indices into the unit's parameters and how to place them."""

    members: list[int]
    mesh: DeviceMesh
    placement: Placement
    strategy: Strategy
    policy: MixedPrecisionPolicy
    gradient_divide_factor: Optional[float] = None
    dims: Optional[list[int]] = None  # shard_placement_fn's Shard(dim) per member: torch.chunk pieces
    # An explicit Bucket or bucket_size split: never shares the unit's all-gather (shared_gather).
    own_collectives: bool = False
    offload_policy: Optional[OffloadPolicy] = None  # an explicit bucket's (None: the unit's)


def plan_buckets(
    names: list[str],
    params: list[torch.Tensor],
    buckets: Sequence[Bucket],
    mesh: DeviceMesh,
    strategy: Strategy,
    policy: MixedPrecisionPolicy,
    bucket_size: Optional[int],
    shard_dims: Optional[Sequence[Optional[int]]] = None,
    default_dim: Optional[int] = None,
    param_meshes: Optional[Sequence[Optional[DeviceMesh]]] = None,
    forward_only: Optional[Sequence[bool]] = None,
) -> list[GroupSpec]:
    """Assign the unit's parameters (registration order) to groups: explicit buckets first, in
    order; the rest by (dtype, requires_grad, compute dtype, policy), split at ``bucket_size``
    bytes of main weights. ``shard_dims``, ``param_meshes``: per parameter, the dim and mesh
    ``shard_placement_fn`` gave it (None: ``default_dim``, 0 for FSDP2's layout or None for flat;
    ``mesh``); these get groups of their own (by dim only if the strategy shards main weights).
    ``forward_only[k]``: parameter ``k`` goes last in its default group, where a unit keeping its
    weights after forward can free it (:func:`~fsdp.group.forward_only.reads_only_in_forward`)."""
    if bucket_size is not None and (not isinstance(bucket_size, int) or bucket_size <= 0):
        raise ValueError(f"bucket_size must be a positive number of bytes or None, got {bucket_size!r}")
    owner: dict[int, int] = {}
    for b, bucket in enumerate(buckets):
        if not isinstance(bucket, Bucket):
            raise TypeError(f"buckets[{b}] must be an fsdp.Bucket, got {type(bucket).__name__}")
        hits = [k for k, name in enumerate(names) if bucket.matches(name)]
        if not hits:
            shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
            raise ValueError(
                f"buckets[{b}] (names={bucket.patterns}) matches no parameter of this unit; "
                f"its parameters are {shown}"
            )
        for k in hits:
            if k in owner:
                raise ValueError(
                    f"parameter {names[k]!r} matches buckets[{owner[k]}] (names={buckets[owner[k]].patterns}) "
                    f"and buckets[{b}] (names={bucket.patterns}); every parameter must be in exactly one bucket"
                )
            owner[k] = b
    specs: list[GroupSpec] = []
    for b, bucket in enumerate(buckets):
        members = [k for k in range(len(names)) if owner.get(k) == b]
        specs.extend(_explicit(b, bucket, members, names, params, mesh, strategy, policy))
    meshes = dict(enumerate(param_meshes)) if param_meshes is not None else {}
    dims = list(shard_dims) if shard_dims is not None else [None] * len(names)
    for k, b in owner.items():
        if dims[k] is not None or meshes.get(k) is not None:
            raise ValueError(
                f"parameter {names[k]!r} is in buckets[{b}] (names={buckets[b].patterns}) and shard_placement_fn "
                f"returned a placement for it (Shard({dims[k]}) or a mesh of its own); a bucket sets its own "
                f"placement and mesh: return None for it"
            )
    rest = [k for k in range(len(names)) if k not in owner]
    policies = {k: policy.for_param(params[k], names[k]) for k in rest}
    for k in rest:  # dim-0 torch.chunk pieces: DTensor (TP) parameters always, others by default
        if dims[k] is None and params[k].dim() and (mesh_key(params[k]) is not None or default_dim is not None):
            dims[k] = 0 if default_dim is None else default_dim
    chunked = [k for k in rest if dims[k] is not None] if strategy.shard_optim else []
    last = (lambda k: bool(forward_only[k])) if forward_only is not None else (lambda k: False)
    flat = [k for k in rest if k not in chunked]
    specs.extend(_default(flat, params, mesh, meshes, strategy, policies, bucket_size, last))
    for spec in _default(chunked, params, mesh, meshes, strategy, policies, bucket_size, last):
        specs.append(replace(spec, dims=[dims[k] for k in spec.members]))
    return specs


def _explicit(b, bucket, members, names, params, mesh, strategy, policy) -> list[GroupSpec]:
    mesh = bucket.mesh if bucket.mesh is not None else mesh
    strategy = parse_strategy(bucket.sharding_strategy) if bucket.sharding_strategy is not None else strategy
    policy = bucket.mp_policy if bucket.mp_policy is not None else policy
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"buckets[{b}].mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    policy = as_policy(policy, f"buckets[{b}].mp_policy")
    factor = bucket.gradient_divide_factor
    if factor is not None and (not isinstance(factor, (int, float)) or factor <= 0):
        raise ValueError(f"buckets[{b}].gradient_divide_factor must be a positive number, got {factor!r}")
    _check_placement(b, bucket.placement)
    if type(bucket.placement).__name__ == "Owned" and mesh.ndim != 1:
        raise ValueError(
            f"buckets[{b}] places tensors Owned() on a {mesh.ndim}-D mesh; Owned works on a 1-D mesh: "
            f"pass mesh=<the shard axis>, e.g. mesh['shard'] (replicas then hold their own owners)"
        )
    if bucket.per_tensor:
        shards = mesh.shape[-1] if strategy.shard_optim else 1
        for k in members:
            rows = params[k].shape[0] if params[k].dim() else 0
            if params[k].dim() == 0 or rows % shards:
                raise ValueError(
                    f"buckets[{b}] is per_tensor, so {names[k]!r} (shape {tuple(params[k].shape)}) is split "
                    f"along dim 0 over {shards} ranks, which needs dim 0 divisible by {shards}: choose a "
                    f"number of experts (or mesh) that divides, or leave per_tensor off"
                )
        groups = [[k] for k in members]
    resolved = {k: policy.for_param(params[k], names[k]) for k in members}
    if not bucket.per_tensor:
        groups = [g for g, _ in _by_dtype(members, params, resolved, {})]
    return [
        GroupSpec(g, mesh, bucket.placement, strategy, resolved[g[0]], factor, own_collectives=True,
                  offload_policy=bucket.offload_policy)
        for g in groups
    ]


def _default(members, params, mesh, meshes, strategy, policies, bucket_size, last) -> list[GroupSpec]:
    """The default groups, split at ``bucket_size``; members ``last`` names go last (stable)."""
    specs = []
    for group, (policy, on) in _by_dtype(members, params, policies, meshes):
        on = mesh if on is None else on
        main_bytes = [_main_bytes(params[k], policy) for k in group]
        current: list[int] = []
        size = 0
        for k, nbytes in zip(group, main_bytes):
            if current and bucket_size is not None and size + nbytes > bucket_size:
                specs.append(GroupSpec(sorted(current, key=last), on, Shard(0), strategy, policy, own_collectives=True))
                current, size = [], 0
            current.append(k)
            size += nbytes
        specs.append(GroupSpec(sorted(current, key=last), on, Shard(0), strategy, policy,
                               own_collectives=bucket_size is not None))
    return specs


def _by_dtype(members: list[int], params: list[torch.Tensor], policies: dict, meshes: dict) -> list[tuple[list[int], tuple]]:
    """``members`` by (dtype, requires_grad, TP mesh, policy, mesh), stably, with (policy, mesh)."""
    groups: dict[tuple, list[int]] = {}
    for k in members:
        key = (params[k].dtype, params[k].requires_grad, mesh_key(params[k]), policies[k], meshes.get(k))
        groups.setdefault(key, []).append(k)
    return [(ks, (key[3], key[4])) for key, ks in groups.items()]


def _main_bytes(p: torch.Tensor, policy: MixedPrecisionPolicy) -> int:
    return p.numel() * torch.empty((), dtype=policy.dtypes_for(p.dtype, requires_grad=p.requires_grad).main).element_size()


def _check_placement(b: int, placement: Placement) -> None:
    try:
        from dbuffer import Owned  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - older dbuffer
        Owned = None
    if placement == Shard(0) or (Owned is not None and isinstance(placement, Owned)):
        return
    raise ValueError(
        f"buckets[{b}].placement must be Shard(0) or dbuffer.Owned(), got {placement!r} "
        f"(replicated parameters: use sharding_strategy='no_shard')"
    )


def mesh_key(param: torch.Tensor) -> Optional[tuple]:
    """What identifies a DTensor's mesh across ranks (None for plain tensors): one per group."""
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    key = _MESH_KEYS.get(mesh)
    if key is None:
        key = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names)
        _MESH_KEYS[mesh] = key
    return key


# A cache (flattening a mesh per parameter is slow), weak: no mesh or its groups outlive teardown.
_MESH_KEYS: "weakref.WeakKeyDictionary[DeviceMesh, tuple]" = weakref.WeakKeyDictionary()
