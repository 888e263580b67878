"""dbuffer.compat: each difference between the supported torch releases, both branches run on
whichever torch the suite runs on (the other torch's branch forced), against an independent
reference: the full tensors in one process, or torch's own behaviour."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from dbuffer import compat
from dbuffer.torch_version import TorchVersionError, parse
from tests.harness import run_ranks

# ---------------------------------------------------------------- c10d names


def test_c10d_names_prefer_the_new_ones() -> None:
    new = SimpleNamespace(all_gather_single=1, reduce_scatter_single=1, all_gather_into_tensor=1, reduce_scatter_tensor=1)
    old = SimpleNamespace(all_gather_into_tensor=1, reduce_scatter_tensor=1)
    assert (compat.all_gather_name(new), compat.reduce_scatter_name(new)) == ("all_gather_single", "reduce_scatter_single")
    assert (compat.all_gather_name(old), compat.reduce_scatter_name(old)) == ("all_gather_into_tensor", "reduce_scatter_tensor")
    # this torch: a name it has, the new one from 2.13 on
    assert hasattr(dist, compat.all_gather_name()) and hasattr(dist, compat.reduce_scatter_name())
    assert (compat.all_gather_name() == "all_gather_single") == (parse(torch.__version__) >= (2, 13))


def _one_call_collectives() -> dict:
    """dbuffer's all_gather and reduce_scatter on the threaded group, which takes the one-call
    c10d path for both."""
    from dbuffer import collectives

    rank, size = dist.get_rank(), dist.get_world_size()
    gathered, reduced = torch.empty(size * 3), torch.empty(2)
    collectives.all_gather(gathered, torch.arange(3.0) + 10 * rank, dist.group.WORLD)
    collectives.reduce_scatter(reduced, torch.arange(2.0 * size) * (rank + 1), "avg", dist.group.WORLD)
    return {"gathered": gathered, "reduced": reduced}


def _names_here() -> list[tuple[str, str]]:
    both = [("all_gather_single", "reduce_scatter_single"), ("all_gather_into_tensor", "reduce_scatter_tensor")]
    return [pair for pair in both if all(hasattr(dist, n) for n in pair)]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the old names are deprecated on 2.13+
@pytest.mark.parametrize("names", _names_here(), ids=lambda p: p[0])
def test_both_c10d_names_give_the_reference_result(names: tuple[str, str]) -> None:
    """On 2.13+ both pairs exist (the old as deprecated aliases): the 2.11 path is the old pair
    forced. On 2.11 only the old pair exists. Each must be called and give the exact result.
    The names are forced and the c10d functions counted here, around the run: the rank threads
    share both modules."""
    from dbuffer import collectives

    world, calls = 4, []
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            calls.append((threading.current_thread().name, name))
            return real[name](*args, **kwargs)

        return call

    saved = collectives._ALL_GATHER, collectives._REDUCE_SCATTER
    collectives._ALL_GATHER, collectives._REDUCE_SCATTER = names
    for n in names:
        setattr(dist, n, counting(n))
    try:
        results = run_ranks(_one_call_collectives, world, backend="threaded")
    finally:
        collectives._ALL_GATHER, collectives._REDUCE_SCATTER = saved
        for n, fn in real.items():
            setattr(dist, n, fn)
    assert sorted(calls) == sorted((f"rank{r}", n) for r in range(world) for n in names)
    for rank, out in enumerate(results):
        assert torch.equal(out["gathered"], torch.cat([torch.arange(3.0) + 10 * r for r in range(world)]))
        full = sum(torch.arange(2.0 * world) * (r + 1) for r in range(world)) / world
        assert torch.equal(out["reduced"], full[2 * rank : 2 * rank + 2])


# ---------------------------------------------------------------- DataParallelMeshDims


def test_data_parallel_mesh_dims_is_torchs_class_where_torch_has_it() -> None:
    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    cls = compat.data_parallel_mesh_dims()
    assert (cls is getattr(torch_fsdp, "DataParallelMeshDims", None)) == hasattr(torch_fsdp, "DataParallelMeshDims")
    assert fsdp.DataParallelMeshDims is cls
    assert hasattr(torch_fsdp, "DataParallelMeshDims") == (parse(torch.__version__) >= compat.DP_MESH_DIMS_TORCH)


def test_without_torchs_class_constructing_the_stand_in_names_the_torch_needed() -> None:
    cls = compat.data_parallel_mesh_dims(SimpleNamespace())  # a torch.distributed.fsdp without it
    assert cls.__name__ == "DataParallelMeshDims"
    with pytest.raises(TorchVersionError) as info:
        cls(shard="dp_shard")
    message = str(info.value)
    assert message.startswith("DataParallelMeshDims (fully_shard's dp_mesh_dims) needs torch 2.12 or newer; ")
    assert f"this is torch {torch.__version__}" in message and "mesh=full_mesh['dp_shard']" in message
    with pytest.raises(TorchVersionError, match="needs torch 2.12"):
        compat.require_data_parallel_mesh_dims(SimpleNamespace())
    compat.require_data_parallel_mesh_dims(SimpleNamespace(DataParallelMeshDims=object))  # has it: nothing


def test_fully_shard_with_dp_mesh_dims_on_a_torch_without_it_raises_first(monkeypatch) -> None:
    """The check runs before anything else of fully_shard (no process group needed)."""
    import torch.distributed.fsdp as torch_fsdp

    import fsdp

    monkeypatch.delattr(torch_fsdp, "DataParallelMeshDims", raising=False)
    with pytest.raises(TorchVersionError, match=r"dp_mesh_dims\) needs torch 2.12 or newer"):
        fsdp.fully_shard(torch.nn.Linear(2, 2), dp_mesh_dims=object())


# ---------------------------------------------------------------- DTensor subclasses' dispatch


@pytest.mark.parametrize("version, bypassed", [("2.11.0", True), ("2.11.0+cu130", True), ("2.12.0", False), ("2.13.0+cpu", False), ("2.15.0", False)])
def test_the_bypass_is_torch_2_11s(version: str, bypassed: bool) -> None:
    assert compat.dtensor_subclass_dispatch_bypassed(version) is bypassed


class _Recording(DTensor):
    """A DTensor subclass whose ``__torch_dispatch__`` records each op, then runs it as DTensor."""

    seen: list = []

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        plain = [DTensor(a._local_tensor, a._spec, requires_grad=False) if isinstance(a, _Recording) else a for a in args]
        out = func(*plain, **(kwargs or {}))
        return _Recording(out._local_tensor, out._spec, requires_grad=False) if isinstance(out, DTensor) else out


def _subclass_dispatch_runs(route: bool) -> tuple[list[str], str, int]:
    """Which ops reach a DTensor subclass's ``__torch_dispatch__`` on this torch (with the route
    on or off), the type ``detach()`` returns, and how many ops the route's mode handed over."""
    mesh = init_device_mesh("cpu", (2,))
    spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([4, 3]), (3, 1), torch.float32))
    t = _Recording(torch.ones(2, 3), spec, requires_grad=False)
    _Recording.seen = []
    handed: list[str] = []
    mode_dispatch = compat._SubclassRoute.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        handed.append(str(func))
        return mode_dispatch(self, func, types, args, kwargs)

    compat._SubclassRoute.__torch_dispatch__ = counting  # this process only (fake backend: one rank)
    compat.route_subclass_dispatch(_Recording, route)
    try:
        detached = t.detach()
        torch.ops.aten.alias.default(t)
    finally:
        compat.route_subclass_dispatch(_Recording, False)
        compat._SubclassRoute.__torch_dispatch__ = mode_dispatch
    assert "__torch_function__" not in _Recording.__dict__  # off removes it
    return list(_Recording.seen), type(detached).__name__, len(handed)


def test_the_bypass_is_what_this_torch_does() -> None:
    """Without the route, a subclass's dispatch runs exactly where compat says it is not bypassed."""
    seen, _, handed = run_ranks(_subclass_dispatch_runs, 2, False, backend="fake")[0]
    assert (seen == []) == compat.dtensor_subclass_dispatch_bypassed()
    if seen:
        assert seen == ["aten.detach.default", "aten.alias.default"]
    assert handed == 0


def test_the_route_hands_every_op_to_the_subclass() -> None:
    """With the route (on by default on 2.11; forced here on any torch) the subclass sees each op
    once, and ``detach()`` keeps its type, which ``nn.Parameter`` needs."""
    seen, detached, handed = run_ranks(_subclass_dispatch_runs, 2, True, backend="fake")[0]
    assert seen == ["aten.detach.default", "aten.alias.default"]
    assert detached == "_Recording"
    assert handed == 2  # by the route's mode, not by torch's own subclass dispatch


def test_row_and_element_sharded_ops_are_exact_through_the_route() -> None:
    """The 2.11 path on this torch: every op of the two property tests, with the route forced,
    against the single-process reference (the checks themselves compare; they return counts)."""
    from dbuffer.pieces import PieceShardedDTensor
    from tests.dbuffer import test_element_sharded, test_row_sharded

    shapes = [(5, 3), (3,), (2, 4), (7, 3)]
    was = "__torch_function__" in PieceShardedDTensor.__dict__  # on by default where bypassed
    assert was == compat.dtensor_subclass_dispatch_bypassed()
    for module in (test_row_sharded, test_element_sharded):
        seen = 0
        for mesh_shape, placements in (((2,), [Shard(0)]), ((3,), [Shard(0)])):
            world = mesh_shape[0]
            compat.route_subclass_dispatch(PieceShardedDTensor, True)  # here: the rank threads share the class
            try:
                results = run_ranks(module._check_ops, world, shapes, mesh_shape, placements, 7, backend="threaded")
            finally:
                compat.route_subclass_dispatch(PieceShardedDTensor, was)
            checked, pieces = results[0][:2]  # (cases checked, views checked[, refusals])
            assert checked >= 10 * pieces, (module.__name__, mesh_shape, results)
            seen += pieces
        assert seen > 0, module.__name__  # the shapes do give pieces that are not torch.chunk's


def _parameter_of_a_row_sharded_view() -> tuple[str, bool, float]:
    from torch.distributed.tensor import Replicate

    from dbuffer import distribute_tensors

    mesh = init_device_mesh("cpu", (2,))
    shapes = [(1, 3), (5, 3)]  # packed rows: rank 0 holds 4 rows of the second tensor, not chunk's 3
    full = torch.arange(18.0).reshape(6, 3)
    buf = distribute_tensors([full[:1], full[1:]], mesh, [Shard(0)])
    p = torch.nn.Parameter(buf.get_dtensor(1))
    p.data.mul_(2)  # through the parameter's data: the buffer's rows
    gathered = buf.redistribute([Replicate()]).get_local_tensor(1)
    return type(p).__name__, p.requires_grad, float((gathered - 2 * full[1:]).abs().max())


def test_a_row_sharded_view_becomes_a_parameter() -> None:
    """torch 2.11's bypass made ``nn.Parameter(view)`` fail (``detach()`` returned a DTensor)."""
    for kind, requires_grad, error in run_ranks(_parameter_of_a_row_sharded_view, 2, backend="gloo"):
        assert (kind, requires_grad, error) == ("RowShardedDTensor", True, 0.0)


# ---------------------------------------------------------------- DTensors on a meta mesh


def _meta_mesh_ops() -> dict:
    """DTensor's redistribution pricing and ``nn.Parameter`` of a DTensor on a meta mesh,
    outside and inside :func:`compat.meta_mesh_device_count`."""
    from torch.distributed.device_mesh import _mesh_resources
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._collective_utils import redistribute_cost

    mesh = init_device_mesh("meta", (4,))
    sharded = DTensor.from_local(torch.empty(2, 3, device="meta"), mesh, [Shard(0)], run_check=False)
    replicated = DTensor.from_local(torch.empty(8, 3, device="meta"), mesh, [Replicate()], run_check=False)
    out: dict = {}
    try:  # what every torch does without it: "meta" has no device module to count devices
        _mesh_resources.num_devices_per_host("meta")
    except AttributeError as exc:
        out["outside"] = str(exc)
    original = type(_mesh_resources).__dict__["num_devices_per_host"]
    with compat.meta_mesh_device_count():
        out["count"] = (_mesh_resources.num_devices_per_host("meta"), _mesh_resources.num_devices_per_host("cpu"))
        out["cost"] = redistribute_cost(sharded._spec, replicated._spec)  # an all-gather: priced, > 0
        p = torch.nn.Parameter(sharded)
        out["param"] = (type(p).__name__, isinstance(p, torch.nn.Parameter), p.requires_grad, tuple(p.shape))
    out["restored"] = type(_mesh_resources).__dict__["num_devices_per_host"] is original
    return out


def test_meta_mesh_device_count_lets_dtensor_price_and_detach_on_meta() -> None:
    out = run_ranks(_meta_mesh_ops, 4, backend="fake")[0]
    assert "device_count" in out["outside"]
    assert out["count"] == (1, torch.cpu.device_count())  # meta as the CPU; the CPU as before
    assert out["cost"] > 0
    assert out["param"] == ("DTensor", True, True, (8, 3))
    assert out["restored"]
