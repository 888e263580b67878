"""The closed form: bytes per rank from the parameter shapes, the strategy and the policy alone,
computed without asking fsdp (what the measurement is checked against)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn as nn

from fsdp import MixedPrecisionPolicy
from fsdp.group.policy import FLOAT32_OR_WIDER, Strategy, reduces_in_grad_dtype
from tools.memory_plan.report import Moment

# Tensors of optimizer state per parameter, each like the parameter (torch's defaults).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # sgd: with momentum


@dataclass
class _Closed:
    params: int
    units: int
    bytes: dict[str, int]
    local_params: int = 0  # elements of this rank's TP pieces


def _dtypes(p: MixedPrecisionPolicy, built: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]:
    """(main, model, main grads, reduce) of a parameter built as ``built``, from the policy's
    documented defaults (written out here so the closed form does not ask fsdp)."""
    if not built.is_floating_point:
        return built, built, built, built
    main = p.main_params_dtype
    if main is FLOAT32_OR_WIDER:  # the presets' parameters are all trained
        main = built if built.itemsize > 4 else torch.float32
    elif main is None:
        main = built
    model = p.param_dtype or built
    reduce = p.reduce_dtype
    if reduce is None:  # as the installed torch's FSDP2 reads it: from 2.15 the gradient dtype
        reduce = torch.promote_types(model, built) if reduces_in_grad_dtype() else model
    return main, model, p.main_grads_dtype or main, reduce


def closed_form(
    root: nn.Module,
    blocks: list[nn.Module],
    world: int,
    s: Strategy,
    policy: MixedPrecisionPolicy,
    states: int,
    schedule: dict[str, frozenset[Moment]],
    local_numel: dict[int, int],
    optim_world: Optional[int] = None,
) -> _Closed:
    """Bytes per rank from the parameter shapes alone: a parameter counts its TP piece's
    elements (``local_numel``: all of them without TP); sharded totals are ``ceil(bytes / world)``
    (``world``: the dp shard axis's size). ``optim_world``: the ranks the main weights, main
    grads and optimizer state are sharded over (HFSDP: replicate x shard; default ``world``);
    when it differs from ``world`` the model weights are the separate ``world``-sharded copy
    plus the cast piece of the optimizer's shard."""
    optim_world = world if optim_world is None else optim_world
    outer = optim_world != world
    groups = [_unique(b.parameters()) for b in blocks]
    in_blocks = {id(p) for g in groups for p in g}
    root_params = [p for p in _unique(root.parameters()) if id(p) not in in_blocks]

    def total(params: list[nn.Parameter], which: int, trainable_only: bool = False) -> int:
        return sum(
            local_numel[id(p)] * _dtypes(policy, p.dtype)[which].itemsize
            for p in params
            if p.requires_grad or not trainable_only
        )

    def per_rank(nbytes: int, sharded: bool, over: int = optim_world) -> int:
        return -(-nbytes // over) if sharded else nbytes

    every = root_params + [p for g in groups for p in g]
    trainable = [p for p in every if p.requires_grad]
    cast = [p for p in every if _dtypes(policy, p.dtype)[1] != _dtypes(policy, p.dtype)[0]]
    regrad = [p for p in trainable if _dtypes(policy, p.dtype)[2] != _dtypes(policy, p.dtype)[0]]
    main_trainable = per_rank(total(trainable, 0), s.shard_optim)
    param_shard = per_rank(total(cast, 1), s.shard_optim)
    # Sharded strategies keep no model shard: each gather casts the main shard into its own row
    # of the gathered buffer (the planner's groups are packed, on the device). no_shard's model
    # weights are its full ones; HFSDP's model shard is always kept.
    model_weights = 0 if s.shard_optim and not outer else param_shard
    if outer:  # the shard-axis copy every gather reads, and the cast piece gathered into it
        model_weights = per_rank(total(every, 1), True, world) + param_shard
    out = {
        "main_weights": per_rank(total(every, 0), s.shard_optim),
        "model_weights": model_weights,
        "unsharded_weights": total(every, 1) if s.shard_optim and not s.shard_params else 0,
        "main_grads": per_rank(total(trainable, 2), s.shard_grads),
        "grad_copies": per_rank(total(regrad, 0), s.shard_optim),
        "optimizer_state": states * main_trainable,
    }
    for key, which, trainable_only in (("unsharded_working_set", 1, False), ("reduce_working_set", 3, True)):
        sizes = [(total(g, which, trainable_only), 0) for g in groups] + [(total(root_params, which, trainable_only), 0)]
        out[key] = peak_of(sizes, schedule[key])[0][0]
    return _Closed(
        sum(p.numel() for p in every), len(groups) + 1, out, sum(local_numel[id(p)] for p in every),
    )


def peak_of(units: list[tuple[int, int]], moments: frozenset[Moment]) -> tuple[tuple[int, int], Moment]:
    """((bytes, padding), moment) of the costliest moment: ``units`` are (bytes, padding) per
    unit, the root last; a moment holds the root's buffer (or not) and the k largest others'."""
    others = sorted(units[:-1], reverse=True)
    priced = []
    for root, k in moments:
        held = [units[-1]] * root + others[:k]
        priced.append(((sum(b for b, _ in held), sum(p for _, p in held)), (root, k)))
    return max(priced, default=((0, 0), (False, 0)))


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def describe_policy(p: MixedPrecisionPolicy) -> str:
    d = _dtypes(p, torch.float32)
    return f"main {_short(d[0])}, model {_short(d[1])}, main grads {_short(d[2])}, reduce {_short(d[3])}"


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )
