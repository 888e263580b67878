"""fsdp/custom_comm.py: FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``. Comm
objects written here with torch.distributed (counting their calls and allocations) train bitwise
like dbuffer's collectives, and both match single-process training on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import Shard

import fsdp
from dbuffer import compat
from fsdp.compose import custom_comm
from tests.fsdp.models import make_batches, make_model, max_diff, reference, full_state, train
from tests.harness import run_ranks


class CountingAllGather:
    """FSDP2's AllGather protocol with its own allocator: fsdp stages through what it allocates."""

    def __init__(self) -> None:
        self.calls = self.allocs = 0

    def allocate(self, size, *, dtype, device):
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        assert output_tensor.numel() == input_tensor.numel() * dist.get_world_size(group)
        return getattr(dist, compat.all_gather_name())(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter:
    def __init__(self) -> None:
        self.calls = self.allocs = 0
        self.ops: set = set()

    def allocate(self, size, *, dtype, device):
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        self.ops.add(str(op))
        return getattr(dist, compat.reduce_scatter_name())(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class DirectAllGather(DefaultAllGather):  # FSDP2's default allocator: handed fsdp's own buffers
    calls = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        DirectAllGather.calls += 1
        return super().__call__(output_tensor, input_tensor, group, async_op)


class DirectReduceScatter(DefaultReduceScatter):
    calls = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        DirectReduceScatter.calls += 1
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _shard(model, mesh, **kw):
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh, **kw)
    return fsdp.fully_shard(model, mesh=mesh, **kw)


def _units(model):
    return [model, *model.blocks]


def _custom_vs_default(model, batches, ref, mesh_shape) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("r", "s")[-len(mesh_shape):])
    out = {}
    variants = {"row-atomic": {}, "Shard(0) pieces": {"shard_placement_fn": lambda p: Shard(0)}}
    for name, kw in variants.items():
        default = _shard(copy.deepcopy(model), mesh, **kw)
        train(default, batches, rank=rank, world=world)
        expected = full_state(default)
        custom = _shard(copy.deepcopy(model), mesh, **kw)
        gathers, reductions = CountingAllGather(), CountingReduceScatter()
        for unit in _units(custom):
            unit.set_custom_all_gather(gathers)
            unit.set_custom_reduce_scatter(reductions)
        train(custom, batches, rank=rank, world=world)
        got = full_state(custom)
        out[(name, "bitwise default")] = all(torch.equal(got[k], expected[k]) for k in expected)
        out[(name, "vs one process")] = max_diff(got, ref)
        out[(name, "gathers")] = gathers.calls
        out[(name, "reductions")] = reductions.calls
        out[(name, "allocations")] = (gathers.allocs == gathers.calls, reductions.allocs == 2 * reductions.calls)
        out[(name, "ops")] = sorted(reductions.ops)
    direct = _shard(copy.deepcopy(model), mesh)
    DirectAllGather.calls = DirectReduceScatter.calls = 0
    for unit in _units(direct):
        unit.set_custom_all_gather(DirectAllGather())
        unit.set_custom_reduce_scatter(DirectReduceScatter())
    train(direct, batches, rank=rank, world=world)
    out["direct bitwise default"] = all(torch.equal(a, b) for a, b in zip(full_state(direct).values(), expected.values()))
    out["direct calls"] = (DirectAllGather.calls, DirectReduceScatter.calls)
    return out


@pytest.mark.parametrize("backend, mesh_shape", [("gloo", (2,)), ("threaded", (2, 2))])
def test_custom_comms_train_bitwise_like_dbuffer(backend, mesh_shape) -> None:
    model, batches = make_model(), make_batches(2)
    ref = reference(model, batches)
    world = 1
    for n in mesh_shape:
        world *= n
    r = run_ranks(_custom_vs_default, world, model, batches, ref, mesh_shape, backend=backend, timeout=180)[0]
    for name in ("row-atomic", "Shard(0) pieces"):
        assert r[(name, "bitwise default")], (name, r)
        assert r[(name, "vs one process")] < 1e-5, (name, r)
        # 3 units x 2 steps: every unit gathers in forward; the two blocks again in backward
        # (the root keeps its weights); every unit reduce-scatters once per step
        assert r[(name, "gathers")] >= 3 * 2 and r[(name, "reductions")] >= 3 * 2, (name, r)
        assert r[(name, "allocations")] == (True, True), (name, r)
        assert r[(name, "ops")] in (["ReduceOp.SUM"], ["RedOpType.SUM"], ["ReduceOp.AVG"], ["RedOpType.AVG"]), r
    assert r["direct bitwise default"], r
    assert min(r["direct calls"]) >= 6, r


def _bad_comm() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    m = fsdp.fully_shard(make_model(), mesh=mesh)
    out = {}
    for setter in (m.set_custom_all_gather, m.set_custom_reduce_scatter):
        try:
            setter(object())
        except TypeError as e:
            out[setter.__name__] = "allocate" in str(e) and setter.__name__ in str(e)
    return out


def test_a_comm_without_the_protocol_raises_type_error() -> None:
    r = run_ranks(_bad_comm, 2, backend="threaded", timeout=60)[0]
    assert r == {"set_custom_all_gather": True, "set_custom_reduce_scatter": True}, r


def _comm_memory_on_cpu() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    m = fsdp.fully_shard(make_model(), mesh=mesh)
    groups = m._fsdp_state.groups
    out = {}
    m.set_allocate_memory_from_process_group_for_comm(True)  # gloo has no allocator: as FSDP2, nothing changes
    out["pg alloc on cpu"] = all(g.comms.all_gather_comm is None and g.comms.reduce_scatter_comm is None for g in groups)
    try:
        m.set_symm_mem_for_comm()
    except RuntimeError as e:
        out["symm mem on cpu"] = "symmetric memory needs CUDA" in str(e)
    try:
        m.set_allocate_memory_from_process_group_for_comm("yes")
    except TypeError as e:
        out["bool"] = "enable must be a bool" in str(e)
    m.set_custom_all_gather(CountingAllGather())
    try:
        m.set_allocate_memory_from_process_group_for_comm(True)
    except AssertionError as e:  # FSDP2's type; also a ValueError
        out["conflict"] = isinstance(e, ValueError) and "all gather comm is custom: CountingAllGather" in str(e)
    out["custom kept"] = all(isinstance(g.comms.all_gather_comm, CountingAllGather) for g in groups)
    return out


def test_comm_memory_setters_on_cpu_follow_fsdp2() -> None:
    r = run_ranks(_comm_memory_on_cpu, 2, backend="threaded", timeout=60)[0]
    assert r == {k: True for k in ("pg alloc on cpu", "symm mem on cpu", "bool", "conflict", "custom kept")}, r


def _memory_comm_objects(model, batches) -> dict:
    """fsdp's own comm objects (what the setters install on CUDA), with an allocator that counts:
    the staging path trains bitwise like the default one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    default = _shard(copy.deepcopy(model), mesh)
    train(default, batches, rank=rank, world=world)
    allocated = []

    def allocate(numel, dtype):
        allocated.append(numel)
        return torch.empty(numel, dtype=dtype)

    m = _shard(copy.deepcopy(model), mesh)
    for unit in _units(m):
        unit.set_custom_all_gather(custom_comm.MemoryAllGather(allocate, symmetric=False))
        unit.set_custom_reduce_scatter(custom_comm.MemoryReduceScatter(allocate, symmetric=False))
    train(m, batches, rank=rank, world=world)
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(full_state(m).values(), full_state(default).values())),
            "allocations": len(allocated)}


def test_memory_comm_objects_stage_through_their_allocator_exactly() -> None:
    model, batches = make_model(), make_batches(2)
    r = run_ranks(_memory_comm_objects, 2, model, batches, backend="gloo", timeout=120)[0]
    assert r["bitwise"] and r["allocations"] >= 3 * 2 * 3, r  # >= 6 gathers (1 each) + 6 reductions (2 each)
