"""Megatron-FSDP's ``fully_shard(module, mesh, placements, mixed_precision_policy)`` on
:func:`fsdp.fully_shard`.

The placements become fsdp's strategy (:mod:`fsdp.megatron.strategy`), the precision policy
fsdp's per dtype (:mod:`fsdp.megatron.policy`), and fsdp builds and runs the unit. Where
Megatron-FSDP's conventions differ from FSDP2's, the unit follows Megatron-FSDP's:

* **Flat, row-atomic buffers** (``fsdp.layout_policy("row")``): a gather lands in the
  parameters, as Megatron-FSDP's does, and each group's buffers are Megatron-FSDP DBuffers'
  views (:mod:`fsdp.megatron.parameter_group`);
* **every unit reshards after forward**, the root too (FSDP2 keeps the root's weights for the
  backward that follows);
* **parameters move to the mesh's device**: CPU-built ones are copied there, meta-built ones get
  (zeroed, meaningless) storage there at once (buffers stay where they are), so the sharded
  parameters can be initialised in place
  and then :meth:`~fsdp.megatron.parameter_group.FsdpParameterGroup.sync_model_weight_from_main_weight`
  makes the next forward use them (FSDP2 keeps meta shards until ``to_empty``);
* **gradients average over every data-parallel axis**, then divide by ``grad_divisor``;
  a ``Partial`` gradient placement rests unreduced until the last micro-batch
  (:func:`fsdp.megatron.microbatch`).

Every check runs before any collective, on every rank alike; then fsdp's one agreement
collective checks that every rank shards the same unit.
"""

from __future__ import annotations

import glob
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import dbuffer
import fsdp
from fsdp.group.meta_init import materialize
from fsdp.megatron.context import FsdpContext, current_context
from fsdp.megatron.module import FsdpModule, megatron_class
from fsdp.megatron.parameter_group import FsdpParameterGroup, ParameterGroups
from fsdp.megatron.placement import Placements
from fsdp.megatron.policy import MixedPrecisionPolicy, as_policy
from fsdp.megatron.strategy import plan

__all__ = ["fully_shard"]


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
    grad_divisor: int = 1,
    use_symm_mem: bool = False,
) -> None:
    """Shard the parameters ``module`` owns (those of no unit inside it) over ``mesh`` as
    ``placements`` say, in place (Megatron-FSDP: returns None; the module's class becomes
    ``MegatronFsdp<Orig>``, an :class:`~fsdp.megatron.FsdpModule` and an :class:`fsdp.FSDPModule`).
    Shard inner modules first, the outer ones after, inside one
    :func:`~fsdp.megatron.fully_shard_context` (outside one the unit gets a context of its own).

    ``mesh``: 1-D, or 2-D ``(outer, inner)`` with named axes (HSDP / HFSDP);
    ``placements.dp_axes`` names every axis in order. ``mixed_precision_policy``:
    :class:`~fsdp.megatron.MixedPrecisionPolicy` (default: FP32 main weights, main grads and
    their reduction in the parameter's dtype). ``grad_divisor``: a further division of the
    averaged gradients (expert parallelism: the expert-parallel size). ``use_symm_mem``
    (megatron-fsdp 0.6.1), like the context's ``use_symmetric_memory``: collectives on torch's
    symmetric-memory buffers (CUDA and NCCL only).

    Raises before any collective: ``ValueError`` for a module already sharded, a parameter
    another unit owns, a unit inside it from another context, a mesh for another device type
    than the context's, a ``grad_divisor`` that is not a positive int; ``TypeError`` /
    ``ValueError`` / ``NotImplementedError`` for placements (see :func:`fsdp.megatron.strategy.plan`).
    See the module docstring for what follows Megatron-FSDP's conventions."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, FsdpModule):
        raise ValueError("This module is already managed by FSDP (fsdp.megatron.fully_shard each module once)")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if isinstance(grad_divisor, bool) or not isinstance(grad_divisor, int) or grad_divisor <= 0:
        raise ValueError(f"grad_divisor must be a positive int, got {grad_divisor!r}")
    unit_plan = plan(placements, mesh)
    policy = as_policy(mixed_precision_policy)
    context = current_context()
    implicit = context is None
    if implicit:
        context = FsdpContext.for_one_unit()
    _check_context(module, context, implicit, mesh)
    owned = _owned_params(module)
    for name, p in owned:
        if not p.is_floating_point():
            raise NotImplementedError(f"parameter {name!r} has dtype {p.dtype}; fsdp.megatron shards floating parameters only")
    device = dbuffer.mesh_device(mesh)
    meta = _to_mesh_device(owned, device)
    dtypes = list(dict.fromkeys(p.dtype for _, p in owned))
    kw: dict = {}
    if len(dtypes) == 1:
        kw["mp_policy"] = policy.for_dtype(dtypes[0])
    elif len(dtypes) > 1:  # Megatron-FSDP's defaults follow each dtype: one bucket per dtype
        kw["buckets"] = [
            fsdp.Bucket([glob.escape(n) for n, p in owned if p.dtype == dt], mp_policy=policy.for_dtype(dt)) for dt in dtypes
        ]
    with fsdp.layout_policy("row"):
        fsdp.fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=True,
            sharding_strategy=unit_plan.sharding_strategy,
            outer_dp_sharding_strategy=unit_plan.outer_dp_sharding_strategy,
            **kw,
        )
    if grad_divisor != 1:
        module.set_gradient_divide_factor(float(mesh.size() * grad_divisor))
    if use_symm_mem or context.use_symmetric_memory:
        module.set_symm_mem_for_comm()
    if meta:  # the unit's groups only: buffers stay as they are (Megatron-FSDP's)
        for group in fsdp.fully_shard.state(module).groups:
            materialize(group, device)
    _make_megatron_unit(module, mesh, context, unit_plan, grad_divisor)
    if implicit:
        context.finalize()


def _check_context(module: nn.Module, context: FsdpContext, implicit: bool, mesh: DeviceMesh) -> None:
    if not implicit:
        for m in module.modules():
            if isinstance(m, FsdpModule) and m.context is not context:
                raise ValueError(
                    "Cannot fully_shard a module containing an FSDP child from another fully_shard_context: "
                    "shard them in one context"
                )
    if context.device is not None and context.device.type != mesh.device_type:
        raise ValueError(
            f"fully_shard_context(device={context.device}) but the mesh is for {mesh.device_type!r}: "
            f"build the mesh for the context's device type"
        )


def _owned_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``module`` owns (registered below it outside units), first name each."""
    out: dict[int, tuple[str, nn.Parameter]] = {}
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        for name, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), (prefix + name, p))
        stack.extend(reversed([(f"{prefix}{n}.", c) for n, c in m.named_children() if not isinstance(c, fsdp.FSDPModule)]))
    return list(out.values())


def _to_mesh_device(owned: list[tuple[str, nn.Parameter]], device: torch.device) -> bool:
    """Copy plain parameters built on another device to ``device`` (in place: the same
    parameter objects); whether any parameter is on the meta device."""
    meta = False
    with torch.no_grad():
        for _, p in owned:
            if p.is_meta:
                meta = True
            elif not isinstance(p, DTensor) and p.device != device:
                p.data = p.data.to(device)
    return meta


def _fqns_of(module: nn.Module, group: fsdp.ParameterGroup) -> list[tuple[str, ...]]:
    prefixes: dict[int, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(m), f"{name}." if name else "")
    return [tuple(prefixes[id(m)] + attr for m, attr in info.registrations) for info in group.infos]


def _make_megatron_unit(module: nn.Module, mesh: DeviceMesh, context: FsdpContext, unit_plan, grad_divisor: int) -> None:
    """Give the fsdp unit ``module`` Megatron-FSDP's attributes and register it in ``context``."""
    module.__class__ = megatron_class(type(module))
    state = fsdp.fully_shard.state(module)
    module._mfsdp_context = context
    module._mfsdp_plan = unit_plan
    module._name = None
    module._is_root = False
    module._parameter_groups = ParameterGroups(
        FsdpParameterGroup(g, module, mesh, _fqns_of(module, g), grad_divisor) for g in state.groups
    )
    module.register_forward_pre_hook(_ensure_finalized, prepend=True)
    context.register_module(module)


def _ensure_finalized(module: nn.Module, args) -> None:
    module.context.ensure_finalized()
