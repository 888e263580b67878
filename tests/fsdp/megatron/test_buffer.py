"""fsdp.megatron.DBuffer follows Megatron-FSDP's conventions on top of dbuffer: every rank's values
are its partial contribution, sharded axes nest last-axis-first (a reduce-scatter of the outer
axis of an [Partial, Flat] buffer lands inside the inner shard), Replicate -> Partial('avg')
relabels, ranks outside the mesh hold the layout; every value is checked against sums computed
locally from the known per-rank inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp.megatron import DBuffer, Flat, Partial
from tests.harness import run_ranks

SHAPES = [(5, 3), (4,), (2, 6)]


def _values(scale: float) -> list[torch.Tensor]:
    return [torch.arange(float(torch.Size(s).numel())).reshape(s) * scale + k for k, s in enumerate(SHAPES)]


def _partial_1d(op: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    mine = _values(rank + 1.0)
    buf = DBuffer.distribute_tensors(mine, mesh, [Partial(op)])
    summed = [sum(v) for v in zip(*[_values(r + 1.0) for r in range(world)])]
    expected = summed if op == "sum" else [t / world for t in summed]
    reduced = buf.allreduce(0)
    shards = buf.reduce_scatter(0, Flat())
    full = shards.allgather(0)
    return {
        "allreduce": all(torch.allclose(reduced.get_local_tensor(i), e) for i, e in enumerate(expected)),
        "reduce_scatter": all(torch.allclose(full.get_local_tensor(i), e) for i, e in enumerate(expected)),
        "placements": (reduced.placements, shards.placements),
        "offset": shards.offset == rank * shards.local_buffer.numel(),
        "dtensor": all(torch.allclose(shards.get_dtensor(i).full_tensor(), e) for i, e in enumerate(expected)),
    }


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_every_rank_contributes_its_own_values(op) -> None:
    for r in run_ranks(_partial_1d, 2, op):
        assert r["allreduce"] and r["reduce_scatter"] and r["offset"] and r["dtensor"]
        assert r["placements"] == ((Replicate(),), (Shard(0),))


def _nested_2d() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    o, i = mesh.get_coordinate()
    partial = DBuffer.distribute_tensors(_values(o + 1.0), mesh, [Partial("sum"), Flat()])
    both = partial.reduce_scatter(0, Flat())
    size = both.layout.size
    expected = [a + b for a, b in zip(_values(1.0), _values(2.0))]
    full = both.allgather(0).allgather(1)
    replicated = DBuffer.distribute_tensors(_values(1.0), mesh, [Replicate(), Flat()])
    dt = replicated.get_dtensor(0)
    return {
        "offset": both.offset == i * size // 2 + o * size // 4,  # the inner axis cuts first
        "inside": both.offset - partial.offset in (0, size // 4),  # within the inner shard held before
        "values": all(torch.equal(full.get_local_tensor(k), e) for k, e in enumerate(expected)),
        "dtensor_mesh": dt.device_mesh is mesh and torch.equal(dt.full_tensor(), _values(1.0)[0]),
    }


def test_sharded_axes_nest_last_axis_first() -> None:
    for r in run_ranks(_nested_2d, 4, backend="threaded"):
        assert r == {"offset": True, "inside": True, "values": True, "dtensor_mesh": True}


def _relabel_and_refusals() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rep = DBuffer.distribute_tensors(_values(1.0), mesh, [Replicate()])
    avg = rep.redistribute([Partial("avg")])
    out = {"shares": avg.local_buffer.data_ptr() == rep.local_buffer.data_ptr(), "mean": torch.equal(
        avg.allreduce(0).get_local_tensor(0), _values(1.0)[0])}
    for name, call in {
        "sum": lambda: rep.redistribute([Partial("sum")]),
        "suffix": lambda: DBuffer(init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b")), [Flat(), Replicate()], SHAPES, torch.float32),
        "axis": lambda: rep.allgather(0),
    }.items():
        try:
            call()
            out[name] = None
        except (ValueError, NotImplementedError) as e:
            out[name] = type(e).__name__
    return out


def test_replicate_relabels_as_partial_avg_and_bad_moves_raise() -> None:
    for r in run_ranks(_relabel_and_refusals, 2):
        assert r == {"shares": True, "mean": True, "sum": "NotImplementedError", "suffix": "ValueError", "axis": "ValueError"}


def _outside() -> dict:
    mesh = init_device_mesh("cpu", (2,))  # ranks 2 and 3 are not on it
    buf = DBuffer(mesh, [Partial("sum")], SHAPES, torch.float32)
    out = {"offsets": buf.layout.tensor_to_offset, "whole": buf.local_buffer.numel() == buf.layout.size}
    if mesh.get_coordinate() is None:
        with pytest.raises(ValueError, match="not part of the mesh"):
            buf.allreduce(0)
    return out


def test_a_rank_outside_the_mesh_holds_the_layout() -> None:
    results = run_ranks(_outside, 4, backend="threaded")
    assert all(r == results[0] for r in results) and results[0]["whole"]


def test_megatron_fsdp_0_6_1_partial_spelling() -> None:
    assert Partial(reduce_op=dist.ReduceOp.AVG) == Partial("avg") and Partial() == Partial("sum")
    assert Flat() == Shard(0) and repr(Flat()) == "Flat()"
    with pytest.raises(ValueError, match="SUM or AVG"):
        Partial(reduce_op=dist.ReduceOp.MAX)


def _release_and_reallocate() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard = DBuffer.distribute_tensors(_values(1.0), mesh, [Flat()])
    full = DBuffer(mesh, [Replicate()], SHAPES, torch.float32)
    shard.allgather(0, out=full)
    w = full.get_local_tensor(0).requires_grad_()
    storage = full.local_buffer.untyped_storage()
    y = (w * w).sum()  # autograd saves w, a view of the buffer
    full.release_storage()
    released = full.local_buffer.untyped_storage().nbytes() == 0
    full.reallocate_storage()
    shard.allgather(0, out=full)  # the refill: the saved view is valid again, its version unchanged
    y.backward()
    return {
        "released": released,
        "same_storage": full.local_buffer.untyped_storage()._cdata == storage._cdata,
        "view_sees": w.untyped_storage()._cdata == storage._cdata and torch.equal(w.detach(), _values(1.0)[0]),
        "grad": torch.equal(w.grad, 2 * _values(1.0)[0]),
    }


def test_views_saved_for_backward_survive_release_and_reallocate() -> None:
    """The storage object, and every view of it (autograd's saved tensors included), is kept
    across release and reallocation; the refilled values are what backward reads. (Whether the
    allocator hands back the same address is the allocator's: CUDA's caching one does.)"""
    for r in run_ranks(_release_and_reallocate, 2):
        assert r == {"released": True, "same_storage": True, "view_sees": True, "grad": True}
