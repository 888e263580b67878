"""``plan()``: shard a model on a fake world as one rank would, measure its buffers, and check
them against the closed form (``tools/plan_memory.py``'s docstring says what each category is)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dbuffer.compat import meta_mesh_device_count
from dbuffer.teardown import shutdown
from fsdp import MixedPrecisionPolicy, fully_shard
from fsdp.group.layout_choice import layout_policy
from fsdp.group.policy import Strategy, as_policy, parse_strategy
from tools.memory_plan.closed_form import OPTIMIZER_STATES, closed_form, describe_policy
from tools.memory_plan.measure import measure_units, probe_schedule
from tools.memory_plan.presets import resolve_model
from tools.memory_plan.report import CATEGORIES, Bytes, Plan
from tools.tp_plan import MeshShape, local_shape, tp_dim, tp_plan


def plan(
    model: Union[str, Callable[[], nn.Module]],
    world: int,
    rank: int = 0,
    *,
    strategy: Union[str, Strategy] = "optim_grads_params",
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    optimizer: str = "adamw",
    blocks: Optional[Callable[[nn.Module], Iterable[nn.Module]]] = None,
    device: str = "meta",
    flat_optimizer: bool = False,
    tp: int = 1,
    dp_replicate: int = 1,
    outer_dp_sharding_strategy: str = "no_shard",
    layout: str = "chunk",
) -> Plan:
    """Shard ``model`` (a preset name or a builder) as rank ``rank`` of ``world`` and measure.

    ``blocks(module)`` picks the units sharded before the root (default: the children of the
    first ``nn.ModuleList``, e.g. ``model.layers``). ``device``: where the shards live, ``"meta"``
    (nothing allocated) or a real device type such as ``"cpu"`` (see the module docstring).
    ``flat_optimizer``: the step is fsdp.optim's (no FP32 ``.grad`` copies).

    ``tp`` > 1 or ``dp_replicate`` > 1: an N-D mesh ``(dp_replicate, dp_shard, tp)`` of ``world``
    ranks (size-1 axes left out; ``dp_shard = world / (tp * dp_replicate)``). With ``tp`` > 1 the
    model gets :mod:`tools.tp_plan`'s Llama plan from torch's ``parallelize_module`` on the tp
    sub-mesh (on meta), then ``fully_shard`` on the dp axes (HSDP with ``dp_replicate`` > 1), as in
    README "FSDP x TP / EP". The closed form divides the TP-split weights by ``tp`` (this TP rank's
    ``torch.chunk`` piece) and the replicated ones not, then shards both over ``dp_shard``.

    ``outer_dp_sharding_strategy="optim"`` (with ``dp_replicate`` > 1, ``tp`` 1): HFSDP, passed to
    ``fully_shard``; the optimizer's buffers are then sharded over ``dp_replicate * dp_shard``.
    ``layout``: :func:`fsdp.group.layout_choice.layout_policy`'s kind for the default groups:
    ``"chunk"`` (fully_shard's default, FSDP2's torch.chunk pieces), ``"auto"`` (row-atomic unless
    it pads more than 0.1%: ragged for Llama-3-70B at 1024 ranks), ``"row"`` or ``"ragged"``; the
    plan counts the groups of each kind (``layouts``).

    Uses the default process group if one exists (it must have this world size and rank, e.g.
    ``tests.harness.run_ranks(..., backend="fake")``); otherwise joins a fake one for the duration
    of the call.
    """
    name, build = resolve_model(model)
    strategy = parse_strategy(strategy)
    mp_policy = as_policy(mp_policy)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"need an int world >= 1 and 0 <= rank < world, got world={world!r}, rank={rank!r}")
    shape = MeshShape.of(world, tp, dp_replicate)
    outer = outer_dp_sharding_strategy == "optim"
    if outer and (shape.dp_replicate < 2 or shape.tp > 1):
        raise ValueError(
            f"outer_dp_sharding_strategy='optim' (HFSDP) needs dp_replicate > 1 and tp = 1, got dp_replicate="
            f"{shape.dp_replicate}, tp={shape.tp}; fsdp shards the optimizer over the replicate axis of an HSDP mesh"
        )
    seconds: dict[str, float] = {}
    with _timed(seconds, "process group"):
        created = _join(world, rank)
    try:
        with _timed(seconds, "build on meta"), torch.device("meta"):
            root = build()
        if not isinstance(root, nn.Module):
            raise TypeError(f"the model builder returned {type(root).__name__}, not an nn.Module")
        units = list(blocks(root) if blocks is not None else _default_blocks(root))
        with _timed(seconds, "schedule probe"):
            schedule = probe_schedule(strategy, world)
        local_numel = _tp_local_numel(root, shape, rank)
        closed = closed_form(
            root, units, shape.dp_shard, strategy, mp_policy, OPTIMIZER_STATES[optimizer], schedule, local_numel,
            optim_world=shape.dp_shard * shape.dp_replicate if outer else shape.dp_shard,
        )
        grad_copy_bytes = closed.bytes["grad_copies"]
        if flat_optimizer:
            closed.bytes["grad_copies"] = 0
        # meta_mesh_device_count: torch 2.15's DTensor ops need it on a meta mesh (dbuffer.compat)
        with _timed(seconds, "fully_shard"), layout_policy(layout), meta_mesh_device_count():
            mesh = _mesh(device, shape, root)
            kw = dict(mp_policy=mp_policy, sharding_strategy=strategy, outer_dp_sharding_strategy=outer_dp_sharding_strategy)
            for unit in units:
                fully_shard(unit, mesh=mesh, **kw)
            fully_shard(root, mesh=mesh, **kw)
        with _timed(seconds, "measure"), meta_mesh_device_count():
            states = [u._fsdp_state for u in units] + [root._fsdp_state]
            measured = measure_units(states, OPTIMIZER_STATES[optimizer], schedule, flat_optimizer)
    finally:
        if created:  # a fake group owns no threads: no need to collect garbage to see it freed
            shutdown(collect=False)
    cats = {key: Bytes(measured.bytes[key], closed.bytes[key], measured.allowance[key]) for key, _ in CATEGORIES}
    return Plan(
        model=name, world=world, rank=rank, strategy=strategy.name, dtypes=describe_policy(mp_policy),
        optimizer=optimizer + (" (flat)" if flat_optimizer else ""),
        params=closed.params, units=closed.units, layout_padding=measured.layout_padding, **cats,
        padding=measured.padding, padding_mean=measured.padding_mean, device=device,
        released_between_uses=measured.released, peak_moments=measured.peak_moments, seconds=seconds,
        grad_copy_bytes=grad_copy_bytes, mesh=shape.to_dict(), local_params=closed.local_params,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        layouts=measured.layouts, layout_policy=layout,
    )


def _mesh(device: str, shape: MeshShape, root: nn.Module):
    """The data-parallel mesh ``fully_shard`` gets; with ``tp`` > 1, after applying the TP plan to
    ``root`` on the tp sub-mesh of the same N-D mesh."""
    if shape.is_1d:
        return init_device_mesh(device, (shape.world,))
    mesh = init_device_mesh(device, shape.sizes(), mesh_dim_names=shape.names())
    if shape.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        styles = tp_plan(root)
        if not styles:
            raise ValueError(
                "tp > 1 but the model has no module the Llama TP plan splits (q_proj, o_proj, gate_proj, ... see "
                "tools/tp_plan.py); name its modules that way or plan with tp=1"
            )
        parallelize_module(root, mesh["tp"], styles)
    dp = shape.dp_names()
    return mesh[dp[0]] if len(dp) == 1 else mesh[dp]


def _tp_local_numel(root: nn.Module, shape: MeshShape, rank: int) -> dict[int, int]:
    """id(parameter) -> elements of this rank's TP piece, from the plan and the shapes alone."""
    out = {}
    for fqn, p in root.named_parameters():
        piece = local_shape(tuple(p.shape), tp_dim(fqn), shape.tp, shape.tp_rank(rank))
        out[id(p)] = math.prod(piece)
    return out


def _default_blocks(root: nn.Module) -> list[nn.Module]:
    for m in root.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    return []


def _join(world: int, rank: int) -> bool:
    """Use the default process group if it matches, else join a fake one; True if created."""
    if dist.is_initialized():
        have = (dist.get_world_size(), dist.get_rank())
        if have != (world, rank):
            raise ValueError(
                f"a process group of world {have[0]} (this rank {have[1]}) already exists; plan with "
                f"world={have[0]}, rank={have[1]} or destroy it first"
            )
        return False
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return True


@contextlib.contextmanager
def _timed(seconds: dict[str, float], what: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[what] = time.perf_counter() - start
