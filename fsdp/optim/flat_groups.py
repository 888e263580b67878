"""Which fsdp groups a :class:`fsdp.FlatOptimizer` steps, and where each parameter lies in them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from fsdp.group.comms import full_on_mesh_device
from fsdp.group.param_group import ParameterGroup
from fsdp.group.weights import BufferWeights

__all__ = ["Span", "param_specs", "reduce_over_mesh", "spans"]


@dataclass(frozen=True)
class Span:
    """Parameter ``k``'s elements: ``start`` in main (and model), ``grad_start`` in main_grad."""

    k: int
    start: int
    numel: int
    grad_start: int


def param_specs(params) -> list[tuple[dict, list[ParameterGroup]]]:
    """(options, fsdp groups) per param-group dict; every group whole, in one dict only."""
    if isinstance(params, nn.Module):
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        raise TypeError("FlatOptimizer: params must be a module or an iterable of parameters, got a single tensor")
    items = list(params)
    if not items:
        raise ValueError("FlatOptimizer: got no parameters; pass a module sharded by fsdp.fully_shard or its parameters")
    dicts = items if isinstance(items[0], dict) else [{"params": items}]
    specs, seen = [], {}
    for i, spec in enumerate(dicts):
        if not isinstance(spec, dict) or "params" not in spec:
            raise TypeError(f"FlatOptimizer: param group {i} must be a dict with 'params' (or pass parameters only)")
        given = spec["params"]
        given = [given] if isinstance(given, torch.Tensor) else list(given)
        groups: list[ParameterGroup] = []
        chosen: set[int] = set()
        for p in given:
            group = _group_of(p)
            if group is None:  # frozen or plain: nothing for this optimizer to do, unless it trains
                if getattr(p, "_fsdp_unsharded", False):
                    raise TypeError(
                        "FlatOptimizer: got an unsharded (gathered) parameter, registered between a unit's forward "
                        "and the end of its backward; build the optimizer while the model is resharded "
                        "(model.reshard() first, or right after fully_shard)"
                    )
                if p.requires_grad:
                    raise TypeError(
                        f"FlatOptimizer: a parameter of shape {tuple(p.shape)} was not sharded by fsdp.fully_shard; "
                        f"the flat optimizer steps fsdp groups only (use torch.optim for other parameters)"
                    )
                continue
            if not group.requires_grad:
                continue
            if id(group) in seen and seen[id(group)] != i:
                raise ValueError(
                    f"FlatOptimizer: parameters {group.names()} form one fsdp group but are split across param "
                    f"groups {seen[id(group)]} and {i}; give each param group whole fsdp groups (put them in their "
                    f"own fsdp.Bucket)"
                )
            seen[id(group)] = i
            chosen.add(id(p))
            if group not in groups:
                groups.append(group)
        specs.append(({k: v for k, v in spec.items() if k != "params"}, groups, chosen))
    for i, (_, groups, chosen) in enumerate(specs):
        for group in groups:
            missing = [info.fqn for info, p in zip(group.infos, group.sharded_params) if id(p) not in chosen]
            if missing:
                raise ValueError(
                    f"FlatOptimizer: param group {i} holds part of an fsdp group; missing {missing[:3]}. The flat "
                    f"step updates whole groups: pass all their parameters (or separate them with fsdp.Bucket)"
                )
    if not any(groups for _, groups, _ in specs):
        raise ValueError(
            "FlatOptimizer: none of the parameters is trainable and sharded by fsdp.fully_shard; shard the module "
            "first and pass model.parameters()"
        )
    return [(opts, groups) for opts, groups, _ in specs if groups]


def reduce_over_mesh(local: torch.Tensor, group: ParameterGroup, op: str) -> torch.Tensor:
    """``local`` combined over the axes where ``group``'s main weights are sharded."""
    from torch.distributed.tensor import Partial, Replicate

    placements = [Replicate() if isinstance(p, Replicate) else Partial(op) for p in group.main.placements]
    if all(isinstance(p, Replicate) for p in placements):
        return local
    return full_on_mesh_device(local, group.mesh, placements)


def _group_of(p: torch.Tensor) -> Optional[ParameterGroup]:
    ref = getattr(p, "_fsdp_group", None)
    return ref() if ref is not None else None


def spans(group: ParameterGroup) -> list[Span]:
    """Each parameter's range in the main and main-grad buffers, read from its DTensor views."""
    if not isinstance(group.weights, BufferWeights):
        raise ValueError(
            f"FlatOptimizer: parameters {group.names()} are tensor subclasses (all-gather extensions), "
            f"whose shards are not views of a flat buffer; step them with a torch.optim optimizer"
        )
    main_base = group.main.local_buffer
    grad_base = group.grads.main_grad.local_buffer
    spans = []
    for k, (p, g) in enumerate(zip(group.sharded_params, group.grads.main_grad_views)):
        local, glocal = p._local_tensor, g._local_tensor
        if not (local.is_contiguous() and glocal.is_contiguous()):
            raise ValueError(f"FlatOptimizer: parameter {group.infos[k].fqn!r} is not contiguous in its buffers")
        if local.untyped_storage().data_ptr() != main_base.untyped_storage().data_ptr():
            raise ValueError(f"FlatOptimizer: parameter {group.infos[k].fqn!r} is not a view of its group's buffer")
        start = local.storage_offset() - main_base.storage_offset()
        gstart = glocal.storage_offset() - grad_base.storage_offset()
        spans.append(Span(k, start, local.numel(), gstart))
    return spans
