"""The Owned placement: owner assignment and the owned layout (pure, hypothesis properties), the
planner's rules for it, and Owned DBuffers on real ranks (gloo world 2, threaded world 4).

References are independent of the code under test: brute-force optima for the balance bound, a
straightforward re-implementation of the owner rule, and the full tensors every rank rebuilds
from a seed for the collectives.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dbuffer import DBuffer, Owned, OwnedLayout, RowShardedDTensor, distribute_tensors
from dbuffer import compat
from dbuffer.layout import assign_owners, compute_layout, compute_owned_layout
from dbuffer.placements import check_layout_kind, check_placements, plan_redistribute
from tests.dbuffer.test_buffer import SHAPES
from tests.dbuffer.test_layout import _divisors, check_sharding, shapes_st
from tests.harness import run_ranks
from tests.hypothesis_profiles import examples

S, R, O = Shard(0), Replicate(), Owned()
SUM, AVG = Partial("sum"), Partial("avg")


# ============================================================================ pure: owners, layout


def _owners_oracle(sizes: list[int], n: int) -> list[int]:
    """The documented rule, written plainly: largest first (ties: lower index), onto the shard
    with the smallest load (ties: lower shard)."""
    loads = [0] * n
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(n), key=lambda k: (loads[k], k))
        owners[i] = k
        loads[k] += sizes[i]
    return owners


def _loads(sizes, owners, n) -> list[int]:
    loads = [0] * n
    for s, k in zip(sizes, owners):
        loads[k] += s
    return loads


@settings(max_examples=examples(500), deadline=None)
@given(sizes=st.lists(st.one_of(st.integers(0, 10), st.integers(0, 10_000)), max_size=40), n=st.integers(1, 40))
def test_assign_owners_rule_and_balance(sizes, n):
    owners = assign_owners(sizes, n)
    assert list(owners) == _owners_oracle(sizes, n)
    assert assign_owners(sizes, n) == owners  # deterministic
    assert all(0 <= k < n for k in owners)
    loads = _loads(sizes, owners, n)
    biggest = max(sizes, default=0)
    assert max(loads) <= min(loads) + biggest
    assert n * max(loads) <= sum(sizes) + (n - 1) * biggest


@settings(max_examples=examples(300), deadline=None)
@given(sizes=st.lists(st.integers(0, 60), max_size=7), n=st.integers(1, 3))
def test_assign_owners_within_lpt_bound_of_the_optimum(sizes, n):
    """Graham's bound for largest-first: max load <= (4/3 - 1/(3n)) * the best max load, with the
    best found by trying every assignment."""
    best = min((max(_loads(sizes, a, n)) for a in itertools.product(range(n), repeat=len(sizes))), default=0)
    got = max(_loads(sizes, assign_owners(sizes, n), n))
    assert 3 * n * got <= (4 * n - 1) * best


def check_owned_layout(layout: OwnedLayout, shapes, n: int, align: int) -> None:
    """Invariants of an owned layout for its fine sharding into n shards."""
    assert isinstance(layout, OwnedLayout) and layout.num_shards == n
    size = layout.shard_numel
    numels = [math.prod(s) for s in shapes]
    owners = [layout.owner(i) for i in range(len(shapes))]
    assert owners == list(assign_owners(numels, n))
    loads = _loads(numels, owners, n)
    assert list(layout.loads()) == loads
    assert size == -(-max(loads, default=0) // align) * align  # padded to the largest load
    assert layout.data_numel == sum(numels) and layout.total_numel == n * size
    for i, (it, shape) in enumerate(zip(layout.items, shapes)):
        assert it.shape == tuple(shape) and it.numel == numels[i]
        k = owners[i]
        # Whole inside its owner's shard, which alone holds rows of it.
        assert k * size <= it.offset and it.offset + it.numel <= (k + 1) * size or size == 0
        if it.numel:
            assert layout.owners(i) == range(k, k + 1)
        per_shard = layout.rows_per_shard(i)
        assert per_shard[k] == it.num_rows and sum(per_shard) == it.num_rows
        start, stop = layout.item_local_range(i, k)
        assert stop - start == it.numel and k * size + start == it.offset
    for k in range(n):  # registration order, packed from the shard's start, no overlap
        mine = layout.owned_items(k)
        assert list(mine) == [i for i in range(len(shapes)) if owners[i] == k]
        pos = k * size
        for i in mine:
            it = layout.items[i]
            if it.numel:
                assert it.offset == pos
                pos += it.numel
        assert pos - k * size == loads[k]
    biggest = max(numels, default=0)
    assert max(loads, default=0) <= min(loads, default=0) + biggest


@settings(max_examples=examples(600), deadline=None)
@given(
    shapes=shapes_st,
    n=st.one_of(st.integers(1, 16), st.sampled_from([32, 64, 96, 128])),
    align=st.sampled_from([1, 1, 2, 4, 8]),
    data=st.data(),
)
def test_owned_layout_properties(shapes, n, align, data):
    layout = compute_owned_layout(shapes, n, align=align)
    check_owned_layout(layout, shapes, n, align)
    check_sharding(layout, n)  # the generic row-atomic invariants hold too
    coarse = data.draw(st.sampled_from(_divisors(n)), label="coarse num_shards")
    check_sharding(layout, coarse)
    for i in range(len(shapes)):  # coarse shard j is fine shards [j*n/c, (j+1)*n/c)
        assert layout.owner(i, coarse) == layout.owner(i) // (n // coarse)
    again = compute_owned_layout(shapes, n, align=align)
    assert again == layout and again != compute_layout(shapes, n, align=align)


def test_owned_layout_example():
    # An MLP: w0 (32,12) 384, b0 32, w1 (24,32) 768, b1 24, w2 (5,24) 120, b2 5.
    shapes = [(32, 12), (32,), (24, 32), (24,), (5, 24), (5,)]
    two = compute_owned_layout(shapes, 2)
    assert [two.owner(i) for i in range(6)] == [1, 1, 0, 1, 1, 1]
    assert two.loads() == (768, 565) and two.shard_numel == 768 and two.padding_numel == 203
    assert [it.offset for it in two.items] == [768, 1152, 0, 1184, 1208, 1328]
    four = compute_owned_layout(shapes, 4)
    assert [four.owner(i) for i in range(6)] == [1, 3, 0, 3, 2, 3]
    assert four.loads() == (768, 384, 120, 61)
    assert four.rows_per_shard(0) == (0, 32, 0, 0) and four.item_rows(0, 2) == (32, 32)
    assert four.owner(0, num_shards=2) == 0 and four.owner(4, num_shards=2) == 1
    # Empty tensors get an owner too, inside its shard even when that shard is full.
    edge = compute_owned_layout([(4, 4), (3, 0), (0, 5), ()], 2)
    assert [edge.owner(i) for i in range(4)] == [0, 1, 1, 1]
    assert edge.rows_per_shard(1) == (0, 3) and edge.owners(2) == range(0)
    full = compute_owned_layout([(2, 2), (3, 0)], 1)
    assert full.owner(1) == 0 and full.rows_per_shard(1) == (3,)
    assert compute_owned_layout([], 3).total_numel == 0
    assert compute_owned_layout([(0, 2)], 3).owner(0) == 0


def test_owned_layout_errors_name_argument_and_fix():
    with pytest.raises(ValueError, match=r"num_shards must be >= 1.*world size"):
        compute_owned_layout([(2, 2)], 0)
    with pytest.raises(ValueError, match=r"align must be >= 1"):
        compute_owned_layout([(2, 2)], 2, align=0)
    with pytest.raises(ValueError, match=r"shapes\[1\].*negative.*>= 0"):
        compute_owned_layout([(2, 2), (3, -1)], 2)
    with pytest.raises(ValueError, match=r"sizes\[0\]=-1 is negative"):
        assign_owners([-1], 2)
    with pytest.raises(ValueError, match=r"sizes\[1\] must be an int"):
        assign_owners([1, 2.5], 2)
    with pytest.raises(ValueError, match=r"num_shards=3 must divide the layout's num_shards=4"):
        compute_owned_layout([(2, 2)], 4).owner(0, num_shards=3)


# ============================================================================ pure: placements


def test_owned_placement_value_and_rules():
    assert Owned() == Owned() and hash(Owned()) == hash(Owned()) and repr(Owned()) == "Owned()"
    assert Owned() != S and S != Owned() and Owned() != R
    with pytest.raises(Exception):
        Owned().x = 1  # frozen
    assert check_placements([O], 1) == (O,)
    with pytest.raises(ValueError, match=r"placements\[0\] is Owned\(\) on a 2-D mesh.*1-D meshes only"):
        check_placements([O, R], 2)
    with pytest.raises(ValueError, match=r"placements\[1\] is Owned\(\) on a 2-D mesh"):
        check_placements([R, O], 2)
    check_layout_kind([O], owned_layout=True)
    check_layout_kind([R], owned_layout=True)
    check_layout_kind([SUM], owned_layout=False)
    with pytest.raises(ValueError, match=r"Owned\(\) but the layout is packed.*compute_owned_layout"):
        check_layout_kind([O], owned_layout=False)
    with pytest.raises(ValueError, match=r"Shard\(0\) but the layout is owned.*use Owned\(\)"):
        check_layout_kind([S], owned_layout=True)


@pytest.mark.parametrize(
    "src,dst,kinds",
    [
        ([O], [R], ["allgather"]),
        ([SUM], [O], ["reduce_scatter"]),
        ([AVG], [O], ["reduce_scatter"]),
        ([R], [O], ["scatter"]),
        ([O], [O], []),
        ([AVG], [R], ["allreduce"]),
    ],
)
def test_planner_moves_owned_like_shard(src, dst, kinds):
    steps = plan_redistribute(src, dst)
    assert [s.kind for s in steps] == kinds
    assert (steps[-1].after if steps else tuple(src)) == tuple(dst)


@pytest.mark.parametrize("src,dst", [([O], [S]), ([S], [O])])
def test_planner_refuses_shard_owned_swaps(src, dst):
    with pytest.raises(ValueError, match=r"packed layout.*owned one.*distribute_tensors"):
        plan_redistribute(src, dst)
    with pytest.raises(ValueError, match=r"nothing turns data into Partial"):
        plan_redistribute([O], [SUM])


# ============================================================================ buffers on ranks


def _fulls(integer: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if integer:  # small integers: every sum and power-of-2 mean is exact in fp32, in any order
        return [torch.randint(-8, 9, s, generator=g).float() for s in SHAPES]
    return [torch.randn(s, generator=g) for s in SHAPES]


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.dim() == 0 else t


def _check_owned(buf: DBuffer, fulls: list[torch.Tensor]) -> None:
    """Each tensor whole on its owner (a view of the local buffer), 0 rows elsewhere."""
    rank = dist.get_rank()
    storage = buf.local_buffer.untyped_storage().data_ptr()
    for i, t in enumerate(fulls):
        local = buf.get_local_tensor(i)
        if buf.owner(i) == rank:
            assert torch.equal(local, _as_rows(t)), i
        else:
            assert local.shape == (0, *t.shape[1:]), (i, local.shape)
        assert local.numel() == 0 or local.untyped_storage().data_ptr() == storage


def _owned_round_trips() -> list[int]:
    mesh = _mesh()
    fulls = _fulls()
    owned = distribute_tensors(fulls, mesh, [O])
    layout = compute_owned_layout(SHAPES, dist.get_world_size())
    assert owned.layout == layout and owned.is_owned and owned.placements == (O,)
    assert owned.local_buffer.numel() == layout.shard_numel
    _check_owned(owned, fulls)
    # Owned -> Replicate, two ways: redistribute, and allgather into memory we own.
    full = owned.redistribute([R])
    target = DBuffer(mesh, [R], SHAPES, torch.float32, layout=owned.layout)
    ptr = target.local_buffer.data_ptr()
    assert owned.allgather(0, out=target).local_buffer.data_ptr() == ptr
    for buf in (full, target):
        for i, t in enumerate(fulls):
            assert torch.equal(buf.get_local_tensor(i), t), i
    # Replicate -> Owned: a local slice, bit for bit what was distributed.
    back = full.redistribute([O])
    assert torch.equal(back.local_buffer, owned.local_buffer)
    view = full.scatter(0)
    assert view.placements == (O,) and torch.equal(view.local_buffer, owned.local_buffer)
    out = DBuffer(mesh, [O], SHAPES, torch.float32)
    assert full.scatter(0, O, out=out) is out and torch.equal(out.local_buffer, owned.local_buffer)
    # from_local wraps a local buffer into the same owned layout.
    wrapped = DBuffer.from_local(owned.local_buffer.clone(), mesh, [O], SHAPES)
    _check_owned(wrapped, fulls)
    return [owned.owner(i) for i in range(len(SHAPES))]


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_owned_round_trips_are_exact(backend, world) -> None:
    owners = run_ranks(_owned_round_trips, world, backend=backend)
    layout = compute_owned_layout(SHAPES, world)
    assert all(o == [layout.owner(i) for i in range(len(SHAPES))] for o in owners)
    assert len(set(owners[0])) > 1  # tensors really sit on different ranks


def _reduce_to_owner(op: str) -> bool:
    mesh = _mesh()
    fulls = _fulls(integer=True)
    world, rank = dist.get_world_size(), dist.get_rank()
    grads = DBuffer(mesh, [Partial(op)], SHAPES, torch.float32, layout=compute_owned_layout(SHAPES, world))
    for i, t in enumerate(fulls):
        grads.get_local_tensor(i).copy_(t * (rank + 1))
    total = sum(range(1, world + 1))
    expected = [t * total / (world if op == "avg" else 1) for t in fulls]
    for result in (grads.reduce_scatter(0), grads.redistribute([O]), grads.reduce_scatter(0, O, async_op=True).wait()):
        assert result.placements == (O,)
        _check_owned(result, expected)
    return True


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
@pytest.mark.parametrize("op", ["avg", "sum"])
def test_partial_reduces_to_the_owner(backend, world, op) -> None:
    assert all(run_ranks(_reduce_to_owner, world, op, backend=backend))


def _owned_dtensors() -> int:
    mesh = _mesh()
    fulls = _fulls()
    buf = distribute_tensors(fulls, mesh, [O])
    row_sharded = 0
    for i, t in enumerate(fulls):
        d = buf.get_dtensor(i)
        assert isinstance(d, DTensor) and d.shape == t.shape
        assert all(not isinstance(p, Owned) for p in d.placements)  # DTensor never sees Owned
        assert torch.equal(d.full_tensor(), t), i
        if t.dim():
            assert d.placements == (S,)
            assert d.to_local().shape == buf.get_local_tensor(i).shape
            if d.to_local().numel():
                assert d.to_local().data_ptr() == buf.get_local_tensor(i).data_ptr()
        row_sharded += isinstance(d, RowShardedDTensor)
        if isinstance(d, RowShardedDTensor):
            assert torch.equal(d.redistribute(mesh, [R]).to_local(), t)
    return row_sharded


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_owned_dtensor_full_tensor_is_exact(backend, world) -> None:
    assert run_ranks(_owned_dtensors, world, backend=backend)[0] > 0


def _owned_bad_inputs() -> bool:
    world = dist.get_world_size()
    mesh = _mesh()
    mesh_2d = init_device_mesh("cpu", (1, world) if world == 2 else (2, world // 2))
    owned = distribute_tensors(_fulls(), mesh, [O])
    packed = distribute_tensors(_fulls(), mesh, [S])
    owned_partial = DBuffer(mesh, [SUM], SHAPES, torch.float32, layout=owned.layout)
    packed_partial = DBuffer(mesh, [SUM], SHAPES, torch.float32)
    cases = [
        (lambda: DBuffer(mesh, [S], SHAPES, torch.float32, layout=owned.layout), r"Shard\(0\) but the layout is owned"),
        (lambda: DBuffer(mesh, [O], SHAPES, torch.float32, layout=packed.layout), r"Owned\(\) but the layout is packed"),
        (lambda: DBuffer(mesh, [O], SHAPES, torch.float32, layout="owned"), r"layout must be a dbuffer Layout"),
        (lambda: DBuffer(mesh_2d, [O, R], SHAPES, torch.float32), r"1-D meshes only"),
        (lambda: owned.redistribute([S]), r"Shard\(0\) but the layout is owned"),
        (lambda: packed.redistribute([O]), r"Owned\(\) but the layout is packed"),
        (lambda: owned.redistribute([SUM]), r"Partial"),
        (lambda: owned.allgather(0, out=DBuffer(mesh, [R], SHAPES, torch.float32)), r"out has a packed layout.*layout=<this buffer>.layout"),
        (lambda: packed.allgather(0, out=DBuffer(mesh, [R], SHAPES, torch.float32, layout=owned.layout)), r"out has an owned layout"),
        (lambda: owned_partial.reduce_scatter(0, S), r"owned layout produces Owned\(\)"),
        (lambda: packed_partial.reduce_scatter(0, O), r"packed layout produces S"),
        (lambda: owned_partial.reduce_scatter(0, out=DBuffer(mesh, [S], SHAPES, torch.float32)), r"out has placements"),
        (lambda: owned.reduce_scatter(0), r"needs a Partial placement"),
        (lambda: packed.owner(0), r"packed layout.*Owned\(\)"),
        (lambda: owned.owner(len(SHAPES)), r"out of range"),
    ]
    for fn, pattern in cases:
        with pytest.raises((ValueError, TypeError, IndexError), match=pattern):
            fn()
            raise AssertionError(f"no error for the case expecting {pattern!r}")
    # Nothing stored changed, and the group still works (no rank was left in a collective).
    _check_owned(owned, _fulls())
    assert torch.equal(owned.redistribute([R]).get_local_tensor(0), _fulls()[0])
    return True


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_owned_bad_input_raises_before_any_collective(backend, world) -> None:
    assert all(run_ranks(_owned_bad_inputs, world, backend=backend, timeout=60))


@given(
    st.lists(st.integers(0, 50), max_size=12),
    st.lists(st.integers(0, 200), min_size=1, max_size=6),
)
def test_assign_owners_continues_from_initial_loads(sizes, initial) -> None:
    """Loads already on the shards steer new items to the lightest ones: each item still lands on
    a least-loaded shard, so the final spread is bounded by the old maximum or one item."""
    n = len(initial)
    owners = assign_owners(sizes, n, initial_loads=initial)
    final = list(initial)
    for size, k in zip(sizes, owners):
        final[k] += size
    biggest = max(sizes, default=0)
    assert max(final) <= max(max(initial), min(final) + biggest)
    assert assign_owners(sizes, n, initial_loads=[0] * n) == assign_owners(sizes, n)
    assert assign_owners([5, 5, 5], 4, initial_loads=[5, 5, 5, 0]) == (3, 0, 1)


def _owned_gather_calls(shapes) -> dict:
    """Gather an Owned buffer; report which c10d calls ran and whether the values are exact."""
    import dbuffer.collectives as coll

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(s, generator=g) for s in shapes]
    owned = distribute_tensors(tensors, mesh, [Owned()])
    calls: list[tuple[str, int]] = []
    real = {n: getattr(coll.dist, n) for n in ("broadcast", compat.all_gather_name(), "isend")}

    def spy(name):
        def run(tensor, *args, **kwargs):
            calls.append((name, tensor.numel()))
            return real[name](tensor, *args, **kwargs)

        return run

    for name in real:
        setattr(coll.dist, name, spy(name))
    try:
        full = owned.redistribute([Replicate()])
    finally:
        for name, fn in real.items():
            setattr(coll.dist, name, fn)
    exact = all(torch.equal(full.get_local_tensor(k), t) for k, t in enumerate(tensors))
    return {"calls": calls, "exact": exact, "loads": owned.layout.loads(), "shard": owned.local_buffer.numel()}


def test_sparse_owned_gather_broadcasts_only_what_owners_hold() -> None:
    """One big tensor makes every shard as large as it: an all-gather would send 4 x 128
    elements for 139 real ones; broadcasting each owner's used range sends just those."""
    sparse = run_ranks(_owned_gather_calls, 4, [(16, 8), (2, 2), (2, 2), (1, 3)])
    dense = run_ranks(_owned_gather_calls, 4, [(4, 4), (4, 4), (4, 4), (4, 4)])
    for out in sparse:
        assert out["exact"]
        assert all(name == "broadcast" for name, _ in out["calls"])
        assert sorted(n for _, n in out["calls"]) == sorted(x for x in out["loads"] if x)  # no padding sent
        assert out["shard"] * 4 > 1.25 * sum(out["loads"])
    for out in dense:  # no padding: the one all-gather
        assert out["exact"] and [name for name, _ in out["calls"]] == [compat.all_gather_name()]


def _owned_reduce_calls(shapes, op: str) -> dict:
    """Reduce a Partial buffer to its owners; report the c10d calls and exactness against the
    sum over ranks taken in rank order."""
    import dbuffer.collectives as coll

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    base = [torch.randn(s, generator=g) for s in shapes]
    layout = distribute_tensors(base, mesh, [Owned()]).layout
    partial = DBuffer(mesh, [Partial(op)], shapes, torch.float32, layout=layout)
    for k, t in enumerate(base):
        partial.get_local_tensor(k).copy_(t * (rank + 1))
    calls: list[str] = []
    real = {n: getattr(coll.dist, n) for n in ("all_to_all_single", compat.reduce_scatter_name(), "isend")}

    def spy(name):
        def run(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)

        return run

    for name in real:
        setattr(coll.dist, name, spy(name))
    try:
        owned = partial.redistribute([Owned()])
    finally:
        for name, fn in real.items():
            setattr(coll.dist, name, fn)
    exact = True
    for k, t in enumerate(base):
        if owned.owner(k) == rank:
            want = t * 1
            for r in range(1, world):
                want = want + t * (r + 1)
            if op == "avg":
                want = want / world
            exact &= torch.equal(owned.get_local_tensor(k), want)
        else:
            exact &= owned.get_local_tensor(k).numel() == 0
    return {"calls": calls, "exact": exact}


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("backend", ["gloo", "threaded"])
def test_sparse_owned_reduction_sends_no_padding(op, backend) -> None:
    for out in run_ranks(_owned_reduce_calls, 4, [(16, 8), (2, 2), (2, 2), (1, 3)], op, backend=backend):
        assert out["exact"]
        if backend == "gloo":  # threads share the patched module, so count calls in processes only
            assert out["calls"] == ["all_to_all_single"]
