"""DBuffer on real ranks: gloo processes and torch's threaded group, 1-D and 2x2 meshes.

References are computed independently from the full tensors every rank can rebuild from a seed.
"""

from __future__ import annotations

import gc
import math
import tempfile
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer import DBuffer, RowShardedDTensor, distribute_tensors
from dbuffer import compat
from tests.harness import run_ranks
from tests.hypothesis_profiles import examples

SHAPES = [(7, 3), (), (0, 4), (5,), (2, 3, 2), (1,), (11, 2), (3, 0)]
S, R = Shard(0), Replicate()
SUM, AVG = Partial("sum"), Partial("avg")


def _full_tensors(dtype=torch.float32, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _mesh(shape):
    return init_device_mesh("cpu", shape)


def _rows(t: torch.Tensor, buf: DBuffer, i: int) -> torch.Tensor:
    """Reference for buf.get_local_tensor(i): the rows this rank should hold, from the full tensor."""
    r0, r1 = buf.local_rows(i)
    if buf.num_shards == 1:
        return t
    return t.reshape(-1)[r0:r1] if t.dim() == 0 else t[r0:r1]


def _check_holds(buf: DBuffer, fulls: list[torch.Tensor], **tol) -> None:
    for i, t in enumerate(fulls):
        torch.testing.assert_close(buf.get_local_tensor(i), _rows(t, buf, i), **tol)


# --------------------------------------------------------------------- round trips


def _shard_replicate_shard(mesh_shape, placements) -> bool:
    mesh = _mesh(mesh_shape)
    fulls = _full_tensors()
    buf = distribute_tensors(fulls, mesh, placements)
    _check_holds(buf, fulls)
    full = buf.redistribute([R] * mesh.ndim)
    _check_holds(full, fulls)
    back = full.redistribute(placements)
    assert torch.equal(back.local_buffer, buf.local_buffer)
    return True


@pytest.mark.parametrize(
    "backend,mesh_shape,placements",
    [
        ("gloo", (2,), [S]),
        ("threaded", (4,), [S]),
        ("threaded", (2, 2), [S, S]),
        ("threaded", (2, 2), [R, S]),
        ("threaded", (2, 2), [S, R]),
    ],
)
def test_shard_replicate_shard_is_identity(backend, mesh_shape, placements) -> None:
    world = 1
    for d in mesh_shape:
        world *= d
    assert all(run_ranks(_shard_replicate_shard, world, mesh_shape, placements, backend=backend))


def _multi_axis_moves() -> bool:
    mesh = _mesh((2, 2))
    fulls = _full_tensors()
    for src, dst in [([S, S], [R, S]), ([R, S], [S, S]), ([S, R], [R, S]), ([S, S], [S, R])]:
        moved = distribute_tensors(fulls, mesh, src).redistribute(dst)
        assert moved.placements == tuple(dst)
        _check_holds(moved, fulls)
    return True


def test_multi_axis_redistribute_on_2x2() -> None:
    assert all(run_ranks(_multi_axis_moves, 4, backend="threaded"))


# --------------------------------------------------------------------- reductions


def _partial_reductions(mesh_shape, src, dst) -> bool:
    mesh = _mesh(mesh_shape)
    fulls = _full_tensors()
    world = dist.get_world_size()
    rank = dist.get_rank()
    contributions = [[t * (r + 1) for t in fulls] for r in range(world)]
    buf = DBuffer(mesh, src, SHAPES, torch.float32)
    for i, t in enumerate(contributions[rank]):
        buf.get_local_tensor(i).copy_(t)
    # Reference: reduce over the ranks that differ only along the partial axes.
    coord = mesh.get_coordinate()
    peers = [
        r for r in range(world)
        if all(c == c0 for a, (c, c0) in enumerate(zip(_coord_of(r, mesh_shape), coord)) if not isinstance(src[a], Partial))
    ]
    avg_axes = [a for a, p in enumerate(src) if p == AVG]
    divisor = 1
    for a in avg_axes:
        divisor *= mesh_shape[a]
    expected = [sum(contributions[r][i] for r in peers) / divisor for i in range(len(fulls))]
    result = buf.redistribute(dst)
    _check_holds(result, expected, rtol=1e-5, atol=1e-5)
    return True


def _coord_of(rank, mesh_shape):
    coord = []
    for d in reversed(mesh_shape):
        coord.append(rank % d)
        rank //= d
    return list(reversed(coord))


@pytest.mark.parametrize(
    "backend,mesh_shape,src,dst",
    [
        ("gloo", (2,), [SUM], [S]),
        ("gloo", (2,), [AVG], [S]),
        ("gloo", (2,), [AVG], [R]),
        ("threaded", (4,), [SUM], [R]),
        ("threaded", (4,), [AVG], [S]),
        ("threaded", (2, 2), [SUM, SUM], [S, S]),
        ("threaded", (2, 2), [AVG, AVG], [R, S]),  # HSDP gradients
        ("threaded", (2, 2), [SUM, AVG], [R, R]),
    ],
)
def test_partial_reduces_to_reference(backend, mesh_shape, src, dst) -> None:
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    assert all(run_ranks(_partial_reductions, world, mesh_shape, src, dst, backend=backend))


# --------------------------------------------------------------------- out=, cast, async, storage


def _out_shares_storage() -> bool:
    mesh = _mesh((dist.get_world_size(),))
    fulls = _full_tensors()
    sharded = distribute_tensors(fulls, mesh, [S])
    out = DBuffer(mesh, [R], SHAPES, torch.float32)
    ptr = out.local_buffer.data_ptr()
    result = sharded.allgather(0, out=out)
    assert result.local_buffer.data_ptr() == ptr
    _check_holds(result, fulls)
    # reduce-scatter and in-place all-reduce into caller memory
    partial = DBuffer.from_local(result.local_buffer.clone(), mesh, [SUM], SHAPES)
    rs_out = DBuffer(mesh, [S], SHAPES, torch.float32)
    assert partial.reduce_scatter(0, out=rs_out).local_buffer.data_ptr() == rs_out.local_buffer.data_ptr()
    _check_holds(rs_out, [t * dist.get_world_size() for t in fulls], rtol=1e-5, atol=1e-5)
    in_place = partial.allreduce(0, out=partial)
    assert in_place.local_buffer.data_ptr() == partial.local_buffer.data_ptr()
    # scatter without out is a view; with out it copies into out
    view = result.scatter(0)
    assert view.local_buffer.untyped_storage().data_ptr() == result.local_buffer.untyped_storage().data_ptr()
    assert torch.equal(view.local_buffer, sharded.local_buffer)
    return True


def _cast_is_exact() -> bool:
    mesh = _mesh((dist.get_world_size(),))
    bf16 = distribute_tensors(_full_tensors(torch.bfloat16), mesh, [S])
    up = bf16.cast(torch.float32)
    assert up.dtype == torch.float32 and torch.equal(up.local_buffer.to(torch.bfloat16), bf16.local_buffer)
    out = DBuffer(mesh, [S], SHAPES, torch.bfloat16)
    down = up.cast(torch.bfloat16, out=out)
    assert down is out and torch.equal(out.local_buffer, bf16.local_buffer)
    # the second cast into the same out (checked once for its fit) still refuses what changed:
    # its storage released, or another out that does not fit
    out.release_storage()
    with pytest.raises(ValueError, match="cast: out has released storage"):
        up.cast(torch.bfloat16, out=out)
    out.reallocate_storage()
    assert torch.equal(up.cast(torch.bfloat16, out=out).local_buffer, bf16.local_buffer)
    with pytest.raises(ValueError, match="cast: out has dtype torch.bfloat16; the result has torch.float16"):
        up.cast(torch.float16, out=out)
    with pytest.raises(ValueError, match="cast: out has placements"):
        up.cast(torch.bfloat16, out=DBuffer(mesh, [R], SHAPES, torch.bfloat16))
    held = weakref.ref(out)
    del out, down
    gc.collect()
    assert held() is None, "a cast keeps no out alive"
    return True


def _async_handles_complete() -> bool:
    mesh = _mesh((dist.get_world_size(),))
    fulls = _full_tensors()
    sharded = distribute_tensors(fulls, mesh, [S])
    handle = sharded.allgather(0, async_op=True)
    full = handle.wait()
    _check_holds(full, fulls)
    partial = DBuffer.from_local(full.local_buffer.clone(), mesh, [AVG], SHAPES)
    handles = [partial.reduce_scatter(0, async_op=True), partial.allreduce(0, async_op=True),
               sharded.redistribute([R], async_op=True)]
    rs, ar, rd = (h.wait() for h in handles)
    _check_holds(rs, fulls, rtol=1e-6, atol=1e-6)
    _check_holds(ar, fulls, rtol=1e-6, atol=1e-6)
    _check_holds(rd, fulls)
    return True


def _saved_view_survives_release() -> bool:
    mesh = _mesh((dist.get_world_size(),))
    fulls = _full_tensors()
    weights = distribute_tensors(fulls, mesh, [S])
    full = weights.allgather(0)
    w = full.get_local_tensor(0)
    x = torch.ones(3, requires_grad=True)
    loss = (w * x).sum()  # autograd saves the view w
    full.release_storage()
    assert full.is_storage_released() and w.untyped_storage().nbytes() == 0
    with pytest.raises(ValueError, match="released storage"):  # refused: it would write freed memory
        weights.allgather(0, out=full)
    full.reallocate_storage()
    weights.allgather(0, out=full)
    loss.backward()
    torch.testing.assert_close(x.grad, fulls[0].sum(0))
    return True


@pytest.mark.parametrize("backend", ["gloo", "threaded"])
def test_out_cast_async_and_storage(backend) -> None:
    for fn in (_out_shares_storage, _cast_is_exact, _async_handles_complete, _saved_view_survives_release):
        assert all(run_ranks(fn, 2, backend=backend)), fn.__name__


# --------------------------------------------------------------------- DTensor exactness and DCP


def _dtensors_are_exact(mesh_shape, placements) -> bool:
    mesh = _mesh(mesh_shape)
    fulls = _full_tensors()
    buf = distribute_tensors(fulls, mesh, placements)
    ragged = 0
    for i, t in enumerate(fulls):
        d = buf.get_dtensor(i)
        ragged += isinstance(d, RowShardedDTensor)
        assert d.shape == t.shape
        torch.testing.assert_close(d.full_tensor(), t, rtol=0, atol=0)
        if isinstance(d, RowShardedDTensor):
            assert d.to_local().data_ptr() == buf.get_local_tensor(i).data_ptr()
    return ragged


def test_get_dtensor_full_tensor_is_exact() -> None:
    ragged = run_ranks(_dtensors_are_exact, 4, (4,), [S], backend="threaded")
    assert ragged[0] > 0  # the test really covers splits DTensor would get wrong
    run_ranks(_dtensors_are_exact, 4, (2, 2), [S, S], backend="threaded")
    run_ranks(_dtensors_are_exact, 4, (2, 2), [R, S], backend="threaded")
    run_ranks(_dtensors_are_exact, 2, (2,), [S], backend="gloo")


def _dcp_round_trip(path: str) -> bool:
    import torch.distributed.checkpoint as dcp

    mesh = _mesh((dist.get_world_size(),))
    fulls = _full_tensors()
    buf = distribute_tensors(fulls, mesh, [S])
    dcp.save({f"t{i}": buf.get_dtensor(i) for i in range(len(fulls))}, checkpoint_id=path)
    fresh = DBuffer(mesh, [S], SHAPES, torch.float32)
    dcp.load({f"t{i}": fresh.get_dtensor(i) for i in range(len(fulls)) if len(SHAPES[i])}, checkpoint_id=path)
    for i, shape in enumerate(SHAPES):
        if len(shape):
            assert torch.equal(fresh.get_local_tensor(i), buf.get_local_tensor(i)), i
    # A replicated load of a sharded save also sees the right values.
    dense = DBuffer(mesh, [R], SHAPES, torch.float32)
    dcp.load({f"t{i}": dense.get_dtensor(i) for i in range(len(fulls))}, checkpoint_id=path)
    _check_holds(dense, fulls, rtol=0, atol=0)
    return True


def test_dcp_sees_the_right_values() -> None:
    with tempfile.TemporaryDirectory() as path:
        assert all(run_ranks(_dcp_round_trip, 2, path, backend="gloo"))


# --------------------------------------------------------------------- bad input


def _bad_inputs() -> bool:
    mesh = _mesh((dist.get_world_size(),))
    other_mesh = _mesh((1, dist.get_world_size()))
    buf = distribute_tensors(_full_tensors(), mesh, [S])
    cases = [
        (lambda: buf.allgather(0, out=DBuffer(mesh, [R], SHAPES, torch.float64)), "dtype"),
        (lambda: buf.allgather(0, out=DBuffer(mesh, [S], SHAPES, torch.float32)), "placements"),
        (lambda: buf.allgather(0, out=DBuffer(mesh, [R], SHAPES[:-1], torch.float32)), "layout"),
        (lambda: buf.allgather(0, out=DBuffer(other_mesh, [R, R], SHAPES, torch.float32)), "mesh"),
        (lambda: buf.allreduce(0), "Partial"),
        (lambda: DBuffer(mesh, [Shard(1)], SHAPES, torch.float32), "Shard\\(0\\)"),
        (lambda: DBuffer(mesh, [Partial("max")], SHAPES, torch.float32), "Partial\\('sum'\\)"),
        (lambda: DBuffer(mesh, [S, S], SHAPES, torch.float32), "one placement per mesh axis"),
        (lambda: DBuffer.from_local(torch.zeros(4, 1000).t()[0], mesh, [S], SHAPES), "contiguous"),
        (lambda: DBuffer.from_local(torch.zeros(3), mesh, [S], SHAPES), "elements"),
        (lambda: distribute_tensors([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], mesh, [S]), "mixed dtypes"),
        (lambda: buf.redistribute([SUM]), "Partial"),
    ]
    for fn, pattern in cases:
        with pytest.raises((ValueError, TypeError), match=pattern):
            fn()
            raise AssertionError(f"no error for the case expecting {pattern!r}")
    # nothing stored was lost, and the group still works
    _check_holds(buf, _full_tensors())
    _check_holds(buf.redistribute([R]), _full_tensors())
    return True


@pytest.mark.parametrize("backend", ["gloo", "threaded"])
def test_bad_input_raises_before_any_collective(backend) -> None:
    assert all(run_ranks(_bad_inputs, 2, backend=backend, timeout=60))


# --------------------------------------------------------------------- fake: rank r of a huge world


def _fake_rank_memory() -> tuple[int, int]:
    mesh = _mesh((dist.get_world_size(),))
    shapes = [(4096, 4096)] * 8 + [(4096,)] * 4
    buf = DBuffer(mesh, [S], shapes, torch.bfloat16)
    full = buf.allgather(0)
    assert full.local_buffer.numel() == buf.layout.total_numel
    return buf.local_buffer.numel(), full.local_buffer.numel()


def test_fake_group_gives_rank_shapes() -> None:
    [(local, full)] = run_ranks(_fake_rank_memory, 1024, backend="fake", fake_rank=1000)
    data = 8 * 4096 * 4096 + 4 * 4096
    assert local * 1024 == full and data <= full <= data * 1.05


# --------------------------------------------------------------------- gloo's point-to-point paths


def _point_to_point_paths() -> bool:
    """Large shards take gloo's hand-built point-to-point all-gather and reduce-scatter; force
    that path on small data and rerun the checks above through it."""
    from dbuffer import collectives

    saved = collectives._P2P_MIN_SHARD_BYTES
    collectives._P2P_MIN_SHARD_BYTES = 0
    try:
        _out_shares_storage()
        _async_handles_complete()
        for src, dst in (([SUM], [S]), ([AVG], [S]), ([AVG], [R])):
            _partial_reductions((dist.get_world_size(),), src, dst)
        _shard_replicate_shard((dist.get_world_size(),), [S])
    finally:
        collectives._P2P_MIN_SHARD_BYTES = saved
        collectives.release_workspaces()
    return True


@pytest.mark.parametrize("world", [2, 4])  # 2: the first peer's chunk lands in out; 4: also scratch
def test_gloo_point_to_point_paths(world: int) -> None:
    assert all(run_ranks(_point_to_point_paths, world, backend="gloo"))


def _world_one_makes_no_c10d_call() -> bool:
    import dbuffer.collectives as coll

    mesh = init_device_mesh("cpu", (1,))
    tensors = [torch.arange(6.0).reshape(3, 2), torch.ones(4)]
    names = (compat.all_gather_name(), compat.reduce_scatter_name(), "all_reduce", "all_to_all_single", "isend", "irecv")
    real = {n: getattr(coll.dist, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("a group of one must not call c10d")

    for n in names:
        setattr(coll.dist, n, refuse)
    try:
        sharded = distribute_tensors(tensors, mesh, [Shard(0)])
        full = sharded.redistribute([Replicate()])
        grads = DBuffer.from_local(full.local_buffer.clone(), mesh, [Partial("avg")], [t.shape for t in tensors])
        reduced = grads.redistribute([Shard(0)])
        summed = grads.allreduce(0)
    finally:
        for n, fn in real.items():
            setattr(coll.dist, n, fn)
    same = all(torch.equal(full.get_local_tensor(k), t) for k, t in enumerate(tensors))
    return same and torch.equal(reduced.local_buffer, full.local_buffer) and torch.equal(summed.local_buffer, full.local_buffer)


def test_a_group_of_one_copies_without_calling_c10d() -> None:
    assert run_ranks(_world_one_makes_no_c10d_call, 1) == [True]


# --------------------------------------------------------------------- misuse made safe


def _release_while_in_flight() -> list[bool]:
    """release_storage() of a buffer an async collective still writes or reads waits for it
    (before: gloo wrote into freed memory, SIGSEGV). 4 MiB shards take gloo's point-to-point
    path, smaller ones the one-call collective; rank 1 starts late so the transfers are still in
    flight when rank 0 releases."""
    import time

    mesh = _mesh((dist.get_world_size(),))
    rank, checks = dist.get_rank(), []
    for n in (1 << 20, 1000):
        shapes = [(2 * n,)]
        full = torch.arange(2 * n, dtype=torch.float32)
        src = distribute_tensors([full], mesh, [S])
        out = DBuffer(mesh, [R], shapes, torch.float32)
        if rank == 1:
            time.sleep(0.3)
        handle = src.allgather(0, out=out, async_op=True)
        out.release_storage()  # the gather's destination
        checks.append(out.is_storage_released() and handle.wait() is out)
        out.reallocate_storage()
        if rank == 1:
            time.sleep(0.3)
        handle = src.redistribute([R], out=out, async_op=True)
        src.release_storage()  # the gather's source: it was read in full before being freed
        checks.append(handle.wait() is out and torch.equal(out.local_buffer, full))
        partial = DBuffer.from_local(full.clone(), mesh, [SUM], shapes)
        handle = partial.allreduce(0, out=partial, async_op=True)  # in place
        partial.release_storage()
        checks.append(partial.is_storage_released())
        handle.wait()
    return checks


def test_release_storage_waits_for_a_collective_in_flight() -> None:
    assert run_ranks(_release_while_in_flight, 2, backend="gloo", timeout=60) == [[True] * 6] * 2


def _distribute_parameters() -> bool:
    mesh = _mesh((dist.get_world_size(),))
    fulls = _full_tensors()
    params = [torch.nn.Parameter(t.clone()) for t in fulls]
    buf = distribute_tensors(params, mesh, [S])
    assert buf.local_buffer.grad_fn is None and not buf.local_buffer.requires_grad
    assert all(buf.get_local_tensor(i).grad_fn is None for i in range(len(params)))
    _check_holds(buf, fulls)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a list"):
        distribute_tensors([fulls[0], [1.0, 2.0]], mesh, [S])
    return True


def test_distribute_tensors_takes_values_only() -> None:
    assert all(run_ranks(_distribute_parameters, 2, backend="gloo"))


# --------------------------------------------------------------------- ragged (element-granular) layout


def _ragged_primitives(shapes, mesh_shape, placements, seed: int) -> int:
    """Every primitive on a ragged buffer against the full tensors; returns how many tensors
    were cut mid-row on this rank's mesh (so the caller can check the property saw some)."""
    from dbuffer import ElementShardedDTensor, compute_ragged_layout

    mesh = _mesh(mesh_shape)
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=g) for s in shapes]
    layout = compute_ragged_layout(shapes, mesh.size())
    buf = distribute_tensors(fulls, mesh, placements, layout=layout)

    def holds(b: DBuffer, values: list[torch.Tensor], **tol) -> None:
        for i, t in enumerate(values):
            local = b.get_local_tensor(i)
            if b.num_shards == 1:
                expected = t
            else:  # the layout's element range, independent of the buffer's views
                e0, e1 = layout.item_elements(i, b.shard_index, b.num_shards)
                expected = t.reshape(-1)[e0:e1]
                expected = expected if b.is_flat(i) else expected.reshape(local.shape)
            torch.testing.assert_close(local, expected, **tol)

    holds(buf, fulls, rtol=0, atol=0)
    flat = 0
    for i, t in enumerate(fulls):
        d = buf.get_dtensor(i)
        flat += isinstance(d, ElementShardedDTensor)
        assert isinstance(d, ElementShardedDTensor) == buf.is_flat(i)
        torch.testing.assert_close(d.full_tensor(), t, rtol=0, atol=0)
    full = buf.redistribute([R] * mesh.ndim)  # all-gather(s)
    holds(full, fulls, rtol=0, atol=0)
    assert torch.equal(full.redistribute(placements).local_buffer, buf.local_buffer)  # scatter
    # Partial -> placements (reduce-scatter) and Partial -> Replicate (all-reduce) sum the ranks'
    # contributions (rank r contributes (r + 1) * t).
    world, rank = dist.get_world_size(), dist.get_rank()
    part = DBuffer(mesh, [SUM] * mesh.ndim, shapes, torch.float32, layout=layout)
    for i, t in enumerate(fulls):
        part.get_local_tensor(i).copy_(t * (rank + 1))
    total = sum(range(1, world + 1))
    expected = [t * total for t in fulls]
    holds(part.redistribute(placements), expected, rtol=1e-5, atol=1e-5)
    holds(part.redistribute([R] * mesh.ndim), expected, rtol=1e-5, atol=1e-5)
    # cast, out=, release / reallocate
    half = buf.cast(torch.bfloat16)
    holds(half, [t.to(torch.bfloat16) for t in fulls], rtol=0, atol=0)
    out = DBuffer(mesh, [R] * mesh.ndim, shapes, torch.bfloat16, layout=layout)
    out.release_storage()
    out.reallocate_storage()
    got = half.redistribute([R] * mesh.ndim, out=out)
    assert got is out
    holds(out, [t.to(torch.bfloat16) for t in fulls], rtol=0, atol=0)
    return flat


ragged_shapes = st.lists(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5
)
ragged_meshes = st.sampled_from([((2,), [S]), ((3,), [S]), ((4,), [S]), ((2, 2), [S, S]), ((2, 2), [R, S])])


@pytest.mark.hypothesis
def test_ragged_layout_primitives_are_exact() -> None:
    """The property, then its guard: some of the examples it ran really had tensors cut mid-row
    (counted in this test, so it holds whatever ran before)."""
    cut_per_example: list[int] = []

    @settings(max_examples=examples(15), deadline=None)
    @given(shapes=ragged_shapes, mesh=ragged_meshes, seed=st.integers(0, 2**16))
    def ragged_layout_primitives_are_exact(shapes, mesh, seed) -> None:
        mesh_shape, placements = mesh
        flat = run_ranks(_ragged_primitives, math.prod(mesh_shape), shapes, mesh_shape, placements, seed, backend="threaded")
        cut_per_example.append(max(flat))

    ragged_layout_primitives_are_exact()
    assert any(cut_per_example), cut_per_example


def test_ragged_layout_on_gloo() -> None:
    assert all(run_ranks(_ragged_primitives, 2, [(3, 5), (2, 3, 2), (), (4,)], (2,), [S], 1, backend="gloo"))


def _ragged_dcp_round_trip(path: str) -> bool:
    """Save element pieces (several boxes per tensor) and load them into a row-atomic, a ragged
    and a replicated buffer; and the other way round."""
    import torch.distributed.checkpoint as dcp

    from dbuffer import ElementShardedDTensor, compute_ragged_layout

    shapes = [(3, 5), (2, 3, 3), (4,)]
    mesh = _mesh((dist.get_world_size(),))
    fulls = _full_tensors(shapes=shapes)
    ragged = compute_ragged_layout(shapes, mesh.size())
    buf = distribute_tensors(fulls, mesh, [S], layout=ragged)
    assert isinstance(buf.get_dtensor(1), ElementShardedDTensor)
    dcp.save({f"t{i}": buf.get_dtensor(i) for i in range(len(fulls))}, checkpoint_id=path + "/a")
    for placements, layout in (([S], None), ([S], ragged), ([R], ragged)):
        fresh = DBuffer(mesh, placements, shapes, torch.float32, layout=layout)
        dcp.load({f"t{i}": fresh.get_dtensor(i) for i in range(len(fulls))}, checkpoint_id=path + "/a")
        for i, t in enumerate(fulls):
            torch.testing.assert_close(fresh.get_dtensor(i).full_tensor(), t, rtol=0, atol=0)
    packed = distribute_tensors(fulls, mesh, [S])
    dcp.save({f"t{i}": packed.get_dtensor(i) for i in range(len(fulls))}, checkpoint_id=path + "/b")
    fresh = DBuffer(mesh, [S], shapes, torch.float32, layout=ragged)
    dcp.load({f"t{i}": fresh.get_dtensor(i) for i in range(len(fulls))}, checkpoint_id=path + "/b")
    assert torch.equal(fresh.local_buffer, buf.local_buffer)
    return True


def test_ragged_dcp_round_trip() -> None:
    with tempfile.TemporaryDirectory() as path:
        assert all(run_ranks(_ragged_dcp_round_trip, 2, path, backend="gloo"))
def _waited_collective_frees_its_scratch() -> bool:
    """Once a redistribute's handle is waited for, nothing of the collective holds its scratch:
    with the garbage collector off, the gloo reduce-scatter's receive buffer (4 MiB, the p2p
    path) is freed as soon as the pool's idle scratch is released, not at the next collection.
    At world 2 there is none to free: the peer's chunk is received straight into the output."""
    import gc
    import weakref

    from dbuffer import collectives

    mesh = _mesh((dist.get_world_size(),))
    shapes = [(1024, 1024)]  # 4 MiB fp32 in all: a 2 MiB shard per rank on 2 ranks
    partial = DBuffer.from_local(torch.ones(1024 * 1024), mesh, [Partial("sum")], shapes)
    seen, sizes = [], []
    take = collectives._WORKSPACES.take

    def spy(numel, dtype):
        sizes.append(numel)
        t = take(numel, dtype)
        seen.append(weakref.ref(t if t._base is None else t._base))
        return t

    gc.disable()
    try:
        collectives._WORKSPACES.take = spy
        result = partial.redistribute([S], async_op=True).wait()
        collectives._WORKSPACES.take = take
        assert bool((result.local_buffer == dist.get_world_size()).all())
        collectives.release_workspaces()
        scratch_ok = max(sizes) == (dist.get_world_size() - 2) * result.local_buffer.numel()
        return bool(seen) and all(ref() is None for ref in seen) and scratch_ok
    finally:
        collectives._WORKSPACES.take = take
        gc.enable()


def test_waited_collective_frees_its_scratch() -> None:
    assert run_ranks(_waited_collective_frees_its_scratch, 2, backend="gloo") == [True, True]


def _siblings() -> bool:
    mesh = _mesh((2,))
    buf = DBuffer(mesh, [S], [(5, 3), (4,)], torch.float32)
    buf.local_buffer.fill_(1.0)
    full = buf.sibling([R], torch.bfloat16)
    assert full.layout is buf.layout and full.shapes == buf.shapes and full.mesh is buf.mesh
    assert full.placements == (R,) and full.dtype == torch.bfloat16 and full.local_buffer.abs().sum() == 0
    assert full.local_buffer.untyped_storage().data_ptr() != buf.local_buffer.untyped_storage().data_ptr()
    same = buf.sibling(local_buffer=buf.local_buffer)  # around the same memory, no copy
    assert same.local_buffer is buf.local_buffer and same.placements == buf.placements
    gathered = buf.sibling([R], zero_fill=False)
    buf.allgather(0, out=gathered)  # a sibling is a valid out= of this buffer's primitives
    return bool(torch.equal(gathered.local_buffer, torch.ones_like(gathered.local_buffer)))


def test_a_sibling_has_the_same_tensors_and_layout() -> None:
    assert run_ranks(_siblings, 2, backend="threaded") == [True, True]


def _shared_storage_refused() -> bool:
    mesh = _mesh((2,))
    own = DBuffer(mesh, [S], [(5, 3), (4,)], torch.float32)
    numel = own.local_buffer.numel()
    block = torch.arange(3 * numel, dtype=torch.float32)
    views = [block[:numel], block[numel : 2 * numel]]  # a prefix (offset 0, shorter storage), a middle piece
    refused = []
    for view in views:
        buf = own.sibling(local_buffer=view)
        for op in (buf.release_storage, buf.reallocate_storage):
            with pytest.raises(ValueError, match="view into a larger storage"):
                op()
            refused.append(torch.equal(block, torch.arange(3 * numel, dtype=torch.float32)))
    own.release_storage()
    released = own.is_storage_released()
    own.reallocate_storage()
    return all(refused) and len(refused) == 4 and released and not own.is_storage_released()


def test_a_buffer_viewing_a_larger_storage_refuses_release_and_keeps_its_neighbours() -> None:
    assert run_ranks(_shared_storage_refused, 2, backend="threaded") == [True, True]
