"""HFSDP: HSDP whose optimizer (main weights, main grads, optimizer state) is also sharded across
the replicate axis — Megatron-FSDP's ``outer_dp_sharding_strategy="optim"``.

On a ``(replicate R, shard S)`` mesh plain HSDP keeps the main weights, main grads and optimizer
state sharded ``S`` ways and replicated ``R`` times. ``fully_shard(...,
outer_dp_sharding_strategy="optim")`` cuts them ``R * S`` ways, so optimizer memory per rank
falls by ``R``, while forward and backward still gather the weights on the shard axis only:

* **Layout.** A DBuffer's layout is cut once into ``R * S`` finest pieces, and a rank's piece
  under several sharded axes is numbered row-major over them. The shard-axis piece of rank
  ``(r, s)`` (what HSDP holds) is pieces ``s*R .. s*R + R - 1``; for the optimizer piece to lie
  *inside* it, it must be piece ``s*R + r``: shard axis outer, replicate axis inner (torch's
  ``_StridedShard``). The group therefore lives on the *transposed* mesh ``(shard, replicate)``
  (the same process groups, no new ones), where that nesting is DBuffer's ordinary row-major
  one and every move below is a collective on the innermost sharded axis:

  ============  ======================  =========================================
  buffer        placements on (S, R)    size per rank
  ============  ======================  =========================================
  main          Shard, Shard            1/(R*S) (optimizer state follows it)
  main_grad     Shard, Shard            1/(R*S)
  model         Shard, Replicate        1/S, the gather source (HSDP's shard)
  unsharded     Replicate, Replicate    full, during forward/backward (ZeRO-3)
  grad_in       Partial, Partial        full, while gradients accumulate
  ============  ======================  =========================================

* **Gradients:** one ``redistribute`` Partial x Partial -> Shard x Shard: a reduce-scatter on
  the shard axis, then a reduce-scatter (instead of HSDP's all-reduce) on the replicate axis,
  straight into ``main_grad``. With ``set_requires_all_reduce(False)`` the second step is the
  one deferred.
* **After the optimizer step** (the refresh :mod:`fsdp.optim.step_hooks` triggers, as for every
  group): cast the ``1/(R*S)`` main piece to the compute dtype and all-gather it over the
  replicate axis into ``model``; forward gathers ``model`` over the shard axis, as HSDP does.
  ``model`` is always a persistent buffer here (it is larger than ``main``'s piece), so
  ``persistent_param_shard=False`` does not apply and :mod:`fsdp.optim` does not write it.
* **Parameters** handed to users are exact DTensors on the transposed mesh with placements
  ``(Shard(0), Shard(0))`` (row-exact :class:`dbuffer.RowShardedDTensor` where the row-atomic
  layout differs from ``torch.chunk``), whose local pieces are the ``1/(R*S)`` pieces: a
  ``torch.optim`` optimizer on ``model.parameters()`` holds ``1/(R*S)`` of its state. DCP
  checkpoints describe global rows, so they load into HSDP, FSDP (1-D) or another HFSDP shape.

Not supported (a ``ValueError`` at ``fully_shard``, before any collective): a 1-D mesh (nothing
to shard across), ``sharding_strategy="no_shard"`` (the optimizer is not sharded at all),
parameters sharded with ``shard_placement_fn``, tensor-parallel or tensor-subclass parameters,
buckets on another mesh, and ``offload_policy``.
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
    """Validate ``outer_dp_sharding_strategy`` against the unit (locally, before any collective);
    return whether the unit's groups are HFSDP groups."""
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
    """``mesh`` with its two axes swapped, ``(shard, replicate)``, built on the same process
    groups (no collective, no new group); one per mesh object, so groups of one unit share it
    (and equal meshes compare equal, which is what DTensor ops between them need)."""
    cached = mesh.__dict__.get("_fsdp_transposed")
    if cached is not None:
        return cached
    names = tuple(reversed(mesh.mesh_dim_names))
    groups = [mesh.get_group(1), mesh.get_group(0)]
    swapped = DeviceMesh.from_group(groups, mesh.device_type, mesh.mesh.t().contiguous(), mesh_dim_names=names)
    mesh.__dict__["_fsdp_transposed"] = swapped
    return swapped


def outer_sharded(mesh: DeviceMesh, shard: Placement) -> tuple[DeviceMesh, GroupPlacements]:
    """The mesh and placements an HFSDP group is built with on the user's ``(replicate, shard)``
    ``mesh``: the transposed mesh and :meth:`GroupPlacements.outer
    <fsdp.group.members.GroupPlacements.outer>`, whose model shard (the gather source) differs
    from the main weights' placements, so the group's refresh casts and all-gathers over the
    replicate axis (:meth:`fsdp.group.weights.BufferWeights.refresh`)."""
    return transposed_mesh(mesh), GroupPlacements.outer(shard, "avg")
