"""HFSDP: HSDP whose optimizer (main weights, main grads, optimizer state) is also sharded across
the replicate axis — Megatron-FSDP's ``outer_dp_sharding_strategy="optim"``.

On a ``(replicate R, shard S)`` mesh HSDP shards the optimizer ``S`` ways; HFSDP cuts it ``R * S``
ways, while forward and backward still gather on the shard axis only. Pieces are numbered row-major
over the sharded axes, so for rank ``(r, s)``'s optimizer piece to lie *inside* its HSDP shard
(pieces ``s*R .. s*R+R-1``) it must be ``s*R + r``: the group lives on the *transposed* mesh
``(shard, replicate)`` (same process groups), where every move is a collective on one axis:

============  ======================  =========================================
buffer        placements on (S, R)    size per rank
============  ======================  =========================================
main          Shard, Shard            1/(R*S) (optimizer state follows it)
main_grad     Shard, Shard            1/(R*S)
model         Shard, Replicate        1/S, the gather source (HSDP's shard)
unsharded     Replicate, Replicate    full, during forward/backward (ZeRO-3)
grad_in       Partial, Partial        full, while gradients accumulate
============  ======================  =========================================

Gradients reduce-scatter on both axes; the replicate-axis one (HSDP's all-reduce) is what
``set_requires_all_reduce(False)`` defers. After the optimizer step the main piece is cast and
all-gathered over the replicate axis into ``model``, always persistent here (larger than the main
piece). Parameters are exact DTensors ``(Shard(0), Shard(0))`` on the transposed mesh, so DCP
checkpoints load into HSDP, FSDP or another HFSDP shape.

Not supported (a ``ValueError`` at ``fully_shard``, before any collective): a 1-D mesh,
``sharding_strategy="no_shard"``, ``shard_placement_fn`` placements, tensor-parallel or
tensor-subclass parameters, buckets on another mesh, and ``offload_policy``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp.group.members import GroupPlacements

__all__ = ["OUTER_STRATEGIES", "check_outer_sharding", "outer_sharded", "transposed_mesh"]

# Megatron-FSDP's names for the sharding of the outer (replicate) data-parallel axis.
OUTER_STRATEGIES = ("no_shard", "optim")


def check_outer_sharding(value: str, mesh: DeviceMesh, specs: Sequence, params: Sequence[torch.Tensor], offload) -> bool:
    """Whether the unit's groups are HFSDP; raises ``ValueError`` before any collective if unfit."""
    if value not in OUTER_STRATEGIES:
        raise ValueError(
            f"unknown outer_dp_sharding_strategy {value!r}; use 'no_shard' (HSDP: optimizer replicated across "
            f"the replicate axis) or 'optim' (HFSDP: optimizer state and main weights also sharded across it)"
        )
    if value == "no_shard":
        return False
    fix = "or leave outer_dp_sharding_strategy='no_shard'"
    if mesh.ndim != 2:
        raise ValueError(
            f"outer_dp_sharding_strategy='optim' shards the optimizer across the replicate axis of a 2-D "
            f"(replicate, shard) mesh, but mesh {mesh} is {mesh.ndim}-D; pass an HSDP mesh, {fix}"
        )
    if offload is not None:
        raise ValueError(f"outer_dp_sharding_strategy='optim' does not support offload_policy yet; drop one, {fix}")
    for spec in specs:
        if not spec.strategy.shard_optim:
            raise ValueError(
                f"outer_dp_sharding_strategy='optim' needs a sharding_strategy that shards the optimizer, got "
                f"{spec.strategy.name!r}; use 'optim', 'optim_grads' or 'optim_grads_params', {fix}"
            )
        if spec.mesh.ndim != 2:
            raise ValueError(
                f"outer_dp_sharding_strategy='optim': a bucket uses the {spec.mesh.ndim}-D mesh {spec.mesh}; "
                f"HFSDP groups need the unit's 2-D mesh. Give such parameters their own fully_shard call, {fix}"
            )
        if spec.dims is not None or not isinstance(spec.placement, Shard):
            raise ValueError(
                f"outer_dp_sharding_strategy='optim' builds flat (row-atomic or ragged) Shard(0) groups only; "
                f"parameters placed by shard_placement_fn, Owned() buckets or tensor-parallel DTensors are "
                f"not supported. Shard them in their own fully_shard call, {fix}"
            )
        for k in spec.members:
            if type(params[k].detach()) is not torch.Tensor:
                raise ValueError(
                    f"outer_dp_sharding_strategy='optim' does not support {type(params[k].detach()).__name__} "
                    f"parameters (tensor subclasses, DTensors); shard them in their own fully_shard call, {fix}"
                )
    return True


def transposed_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` with its axes swapped, on the same process groups (no collective); cached per mesh
    object, so a unit's groups share it, as DTensor ops between them need."""
    cached = mesh.__dict__.get("_fsdp_transposed")
    if cached is not None:
        return cached
    names = tuple(reversed(mesh.mesh_dim_names))
    groups = [mesh.get_group(1), mesh.get_group(0)]
    swapped = DeviceMesh.from_group(groups, mesh.device_type, mesh.mesh.t().contiguous(), mesh_dim_names=names)
    mesh.__dict__["_fsdp_transposed"] = swapped
    return swapped


def outer_sharded(mesh: DeviceMesh, shard: Placement) -> tuple[DeviceMesh, GroupPlacements]:
    """An HFSDP group's transposed mesh and :meth:`~fsdp.group.members.GroupPlacements.outer`
    placements, whose model shard differs from ``main``'s: the group's
    :meth:`~fsdp.group.weights.BufferWeights.refresh` all-gathers over the replicate axis."""
    return transposed_mesh(mesh), GroupPlacements.outer(shard, "avg")
