"""torch FSDP2's public surface on fsdp (fsdp/unit/surface.py, fsdp/group/reduction.py): every public
name, method and argument exists with compatible parameters; the reduction knobs change the
gradients exactly as FSDP2's do (checked against one process on the global batch); the
iteration controls (unshard_in_backward, reset_iter_state, post-optimizer event) work; and
misuse raises FSDP2's exception types."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp
from tests.fsdp.models import Block, loss_fn, make_batches, make_model
from tests.harness import run_ranks
from tests.versions import has_dp_mesh_dims

WORLD = 4

# ----------------------------------------------------------------------------- signatures


def _compatible(ours: inspect.Signature, theirs: inspect.Signature, where: str) -> None:
    """Every parameter of torch's exists on ours and can be passed the same way."""
    mine = ours.parameters
    for name, p in theirs.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        assert name in mine, f"{where}: parameter {name!r} missing"
        q = mine[name]
        if p.kind == p.KEYWORD_ONLY:
            assert q.kind in (q.KEYWORD_ONLY, q.POSITIONAL_OR_KEYWORD), f"{where}: {name!r} is {q.kind}"
        else:
            assert q.kind == q.POSITIONAL_OR_KEYWORD, f"{where}: {name!r} is {q.kind}, torch's {p.kind}"
        assert (p.default is p.empty) == (q.default is q.empty) or p.default is not p.empty, f"{where}: {name!r}"
    positional = [n for n, p in theirs.parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [n for n, q in mine.items() if q.kind == q.POSITIONAL_OR_KEYWORD][: len(positional)] == positional, where
    extra_required = [n for n, q in mine.items() if q.default is q.empty and n not in theirs.parameters]
    assert not extra_required, f"{where}: ours requires {extra_required}"


def test_every_public_fsdp2_name_method_and_argument_exists() -> None:
    """Against the installed torch's surface: a torch that adds a name fails here, not a user."""
    from torch.distributed.fsdp import _fully_shard

    fsdp2_names = list(_fully_shard.__all__)  # FSDP2's exports (torch.distributed.fsdp re-exports them)
    assert {"FSDPModule", "fully_shard", "MixedPrecisionPolicy", "UnshardHandle"} <= set(fsdp2_names) <= set(torch_fsdp.__all__)
    assert ("DataParallelMeshDims" in torch_fsdp.__all__) == has_dp_mesh_dims()  # fsdp's: a stand-in before 2.12
    for name in fsdp2_names:
        assert hasattr(fsdp, name), name
    theirs = {f.name for f in dataclasses.fields(torch_fsdp.MixedPrecisionPolicy)}
    assert theirs <= {f.name for f in dataclasses.fields(fsdp.MixedPrecisionPolicy)}, theirs
    common = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common")
    if hasattr(common, "ShardPlacementResult"):  # what shard_placement_fn may return: torch's own class
        assert fsdp.ShardPlacementResult is common.ShardPlacementResult
    methods = [n for n, v in vars(torch_fsdp.FSDPModule).items() if not n.startswith("_") and callable(v)]
    assert len(methods) >= 18, methods  # (18 in torch 2.11) the test would pass vacuously if torch's class changed shape
    for name in methods:
        ours = getattr(fsdp.FSDPModule, name, None)
        assert ours is not None, f"FSDPModule.{name} missing"
        _compatible(inspect.signature(ours), inspect.signature(getattr(torch_fsdp.FSDPModule, name)), name)
    _compatible(inspect.signature(fsdp.fully_shard), inspect.signature(torch_fsdp.fully_shard), "fully_shard")
    for name in ("register_fsdp_forward_method", "share_comm_ctx"):
        _compatible(inspect.signature(getattr(fsdp, name)), inspect.signature(getattr(torch_fsdp, name)), name)
    _compatible(inspect.signature(fsdp.UnshardHandle.wait), inspect.signature(torch_fsdp.UnshardHandle.wait), "wait")
    assert callable(fsdp.fully_shard.state)


# ----------------------------------------------------------------------------- helpers


def _shard(model: nn.Module, mesh, **kw) -> nn.Module:
    m = copy.deepcopy(model)
    for block in m.blocks:
        fsdp.fully_shard(block, mesh=mesh, **kw)
    return fsdp.fully_shard(m, mesh=mesh, **kw)


def _local(x: torch.Tensor, y: torch.Tensor, rank: int, world: int):
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None}


def _reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of the mean loss over the global batch, one process: what averaging gives."""
    ref = copy.deepcopy(model)
    per = x.shape[0] // WORLD
    for k in range(micro):  # microbatch k of every rank
        rows = torch.cat([torch.arange(r * per, (r + 1) * per).chunk(micro)[k] for r in range(WORLD)])
        (loss_fn(ref, x[rows], y[rows]) / micro).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _close(got: dict, want: dict, scale: dict | float = 1.0) -> float:
    """Largest difference of ``got`` from ``want`` times ``scale`` (per name or for all)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    s = scale if isinstance(scale, dict) else {k: scale for k in want}
    return max(float((got[k] - want[k] * s[k]).abs().max()) for k in want)


def _meshes():
    return {
        "fsdp": init_device_mesh("cpu", (WORLD,)),
        "hsdp": init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard")),
    }


# ----------------------------------------------------------------------------- reduction knobs


def _reduction_knobs(model, x, y, ref, kinds) -> dict:
    rank = dist.get_rank()
    xl, yl = _local(x, y, rank, WORLD)
    root_names = {n for n in ref if not n.startswith("blocks.")}
    out = {}
    for kind, mesh in _meshes().items():
        if kind not in kinds:
            continue

        def run(configure):
            m = _shard(model, mesh)
            configure(m)
            loss_fn(m, xl, yl).backward()
            return _grads(m)

        units = lambda m: [m, *m.blocks]  # noqa: E731  (the setters are per unit, as FSDP2's)
        out[(kind, "default")] = _close(run(lambda m: None), ref)
        out[(kind, "divide 2")] = _close(
            run(lambda m: [u.set_gradient_divide_factor(2.0) for u in units(m)]), ref, WORLD / 2
        )
        out[(kind, "deprecated alias")] = _close(
            run(lambda m: [u.set_reduce_scatter_divide_factor(8) for u in units(m)]), ref, WORLD / 8
        )
        out[(kind, "force sum")] = _close(run(lambda m: [u.set_force_sum_reduction_for_comms(True) for u in units(m)]), ref)

        def sum_and_divide(m):
            for u in units(m):
                u.set_force_sum_reduction_for_comms(True)
                u.set_gradient_divide_factor(2.0)

        out[(kind, "force sum, divide 2")] = _close(run(sum_and_divide), ref, WORLD / 2)
        # the hook: on the root's reduction only, in place; it sees the averaged shard, or the
        # sum before division when sums are forced
        for force in (False, True):
            seen = []

            def hook(t: torch.Tensor) -> None:
                seen.append(float(t.abs().sum()))
                t.mul_(3)

            def with_hook(m, force=force, hook=hook):
                m.set_all_reduce_hook(hook)
                m.set_force_sum_reduction_for_comms(force)

            got = run(with_hook)
            out[(kind, "hook", force)] = _close(got, ref, {n: 3.0 if n in root_names else 1.0 for n in ref})
            out[(kind, "hook calls", force)] = len(seen)
            out[(kind, "hook input", force)] = seen[0]
        ratio = out[(kind, "hook input", True)] / out[(kind, "hook input", False)]
        out[(kind, "forced sum is world x")] = abs(ratio - WORLD) < 1e-3
        del out[(kind, "hook input", True)], out[(kind, "hook input", False)]
    return out


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_divide_factor_force_sum_and_all_reduce_hook_change_gradients_as_fsdp2(backend) -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    kinds = ("fsdp", "hsdp") if backend == "threaded" else ("hsdp",)  # real processes: the 2-D path only
    results = run_ranks(_reduction_knobs, WORLD, model, x, y, ref, kinds, backend=backend, timeout=120)
    r = results[0]
    for key, value in r.items():
        if "hook calls" in key:
            assert value == 1, (key, value)  # the root unit has one group: one reduction
        elif isinstance(value, bool):
            assert value, key
        else:
            assert value < 1e-5, (key, value)


def _custom_replica_all_reduce(model, x, y, ref) -> float:
    """FSDP2's custom HSDP: fully_shard over the shard group only, the hook all-reduces across
    replicas itself (the user's own collective): the gradients are the global average."""
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    replicas = mesh.get_group("replicate")
    m = _shard(model, mesh["shard"])
    for unit in (m, *m.blocks):
        unit.set_all_reduce_hook(lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG, group=replicas))
    loss_fn(m, *_local(x, y, dist.get_rank(), WORLD)).backward()
    return _close(_grads(m), ref)


def test_all_reduce_hook_can_replace_native_hsdp() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    results = run_ranks(_custom_replica_all_reduce, WORLD, model, x, y, ref, backend="threaded", timeout=60)
    assert max(results) < 1e-5, results


def _deferred_all_reduce(model, x, y, ref) -> dict:
    rank = dist.get_rank()
    mesh = _meshes()["hsdp"]
    m = _shard(model, mesh)
    out = {}
    xl, yl = _local(x, y, rank, WORLD)
    micro = 4  # one row per microbatch
    for k, (xm, ym) in enumerate(zip(xl.chunk(micro), yl.chunk(micro))):
        last = k == micro - 1
        m.set_requires_all_reduce(last)
        (loss_fn(m, xm, ym) / micro).backward()
        if k == 0:
            group = m._fsdp_state.groups[0]
            partial = group.grads._partial.local_buffer.clone()  # reduce-scattered, not all-reduced
            peers = [torch.empty_like(partial) for _ in range(2)]
            dist.all_gather(peers, partial, group=mesh.get_group("replicate"))
            out["replicas differ"] = not torch.equal(peers[0], peers[1])
            out["no grad yet"] = all(p.grad is None for p in m.parameters())
    out["grads"] = _close(_grads(m), ref)
    # a strategy that does not reduce-scatter gradients cannot defer the all-reduce alone; the
    # root's unit (ZeRO-3, which could) is left unchanged too: every unit is checked first
    m2 = copy.deepcopy(model)
    for block in m2.blocks:
        fsdp.fully_shard(block, mesh=mesh, sharding_strategy="optim")
    fsdp.fully_shard(m2, mesh=mesh)
    try:
        m2.set_requires_all_reduce(False)
        out["optim refused"] = False
    except ValueError as e:
        out["optim refused"] = "set_requires_gradient_sync" in str(e)
    out["optim refused"] &= all(g.reduction.all_reduce for unit in m2._states(True) for g in unit.groups)
    return out


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_requires_all_reduce_false_defers_the_replica_all_reduce(backend) -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y, micro=4)
    results = run_ranks(_deferred_all_reduce, WORLD, model, x, y, ref, backend=backend, timeout=60)
    for r in results:
        assert r["replicas differ"] and r["no grad yet"] and r["optim refused"], r
        assert r["grads"] < 1e-5, r


# ----------------------------------------------------------------------------- iteration controls


def _unshard_in_backward(model, x, y, ref) -> dict:
    rank = dist.get_rank()
    out = {}
    for flag in (True, False):
        m = copy.deepcopy(model)
        fsdp.fully_shard(m.embed)  # its backward needs the indices only, never the weight
        for block in m.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(m)
        m.embed.set_unshard_in_backward(flag)
        state, calls = m.embed._fsdp_state, []
        for name in ("unshard", "unshard_for_backward"):  # forward's gather, backward's
            real = getattr(state, name)
            setattr(state, name, lambda async_op=False, real=real: (calls.append(torch.is_grad_enabled()), real(async_op))[1])
        logits = m(_local(x, y, rank, WORLD)[0])
        forward_calls = len(calls)
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), _local(x, y, rank, WORLD)[1].reshape(-1)).backward()
        out[flag] = (forward_calls, len(calls) - forward_calls, _close(_grads(m), ref))
    return out


def test_unshard_in_backward_false_skips_the_backward_gather() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    r = run_ranks(_unshard_in_backward, WORLD, model, x, y, ref, backend="threaded", timeout=60)[0]
    assert r[True][:2] == (1, 1) and r[False][:2] == (1, 0), r
    assert r[True][2] < 1e-5 and r[False][2] < 1e-5, r


class _Failure(Exception):
    pass


def _reset_iter_state(model, x, y, ref) -> dict:
    rank = dist.get_rank()
    xl, yl = _local(x, y, rank, WORLD)
    m = _shard(model, init_device_mesh("cpu", (WORLD,)))
    out = {}
    # a forward that fails inside the second block (the root and block 0 are gathered)
    real = m.blocks[1].down.forward
    m.blocks[1].down.forward = lambda h: (_ for _ in ()).throw(_Failure("forward"))
    with pytest.raises(_Failure):
        loss_fn(m, xl, yl)
    m.blocks[1].down.forward = real
    try:
        m.blocks[0].reset_iter_state()
        out["non-root refused"] = False
    except RuntimeError as e:
        out["non-root refused"] = "root" in str(e)
    m.reset_iter_state()
    out["resharded"] = all(isinstance(p, torch.distributed.tensor.DTensor) for p in m.parameters())
    # a backward that fails half-way: block 1's gradients are computed, block 0's are not
    h = {}

    def fail(grad):
        raise _Failure("backward")

    real_forward = m.blocks[0].forward
    m.blocks[0].forward = lambda t: (h.setdefault("out", real_forward(t)).register_hook(fail), h["out"])[1]
    with pytest.raises(_Failure):
        loss_fn(m, xl, yl).backward()
    m.blocks[0].forward = real_forward
    m.reset_iter_state()
    # the next iteration is exact: nothing of the failed ones leaks into its gradients
    m.zero_grad()
    loss_fn(m, xl, yl).backward()
    out["grads"] = _close(_grads(m), ref)
    return out


def test_reset_iter_state_recovers_from_failed_forward_and_backward() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    results = run_ranks(_reset_iter_state, WORLD, model, x, y, ref, backend="threaded", timeout=60)
    for r in results:
        assert r["non-root refused"] and r["resharded"], r
        assert r["grads"] < 1e-5, r


class _HostEvent:
    """Stands in for a torch.Event on CPU, which has none; records being waited for."""

    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def _small_knobs(model, x, y, ref) -> dict:
    rank = dist.get_rank()
    xl, yl = _local(x, y, rank, WORLD)
    m = _shard(model, init_device_mesh("cpu", (WORLD,)))
    event = _HostEvent()
    m.set_post_optim_event(event)
    m.set_reduce_scatter_max_input_buffers(2)
    m.set_reduce_scatter_unused_params(True)
    m.set_separate_reduce_scatter_group(True)
    m.set_allocate_memory_from_process_group_for_comm(True)  # gloo / CPU: no effect
    fsdp.share_comm_ctx([m, m.blocks[0]])
    loss_fn(m, xl, yl).backward()
    loss_fn(m, xl, yl).backward()  # the event is used once
    out = {"event waited": event.waited, "in flight": m._fsdp_state.root_ctx.max_reductions_in_flight}
    out["grads"] = _close(_grads(m), ref, 2.0)
    return out


def test_post_optim_event_max_buffers_and_accepted_knobs() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    r = run_ranks(_small_knobs, WORLD, model, x, y, ref, backend="threaded", timeout=60)[0]
    assert r["event waited"] == 1 and r["in flight"] == 2, r
    assert r["grads"] < 1e-5, r


class _Branches(nn.Module):
    """Rank-dependent control flow: only some ranks run ``b`` (MoE routing, multi-modal)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if use_b else y


def _unused_params(model, xs) -> dict:
    rank = dist.get_rank()
    out = {}
    for flag in (False, True):
        m = fsdp.fully_shard(copy.deepcopy(model))
        m.set_reduce_scatter_unused_params(flag)
        m(xs[rank], rank == 0).sum().backward()
        # each rank's own rows: rank 1 holds some of b's rows (torch.chunk pieces, or row-atomic a then b)
        out[flag] = {n: None if p.grad is None else p.grad.to_local().clone() for n, p in m.named_parameters()}
        out[(flag, "rows")] = {n: p.to_local().shape[0] for n, p in m.named_parameters()}
    return out


def test_reduce_scatter_unused_params_gives_every_rank_the_reduced_gradient() -> None:
    torch.manual_seed(0)
    model, xs = _Branches(), [torch.randn(2, 4) for _ in range(2)]
    ref = copy.deepcopy(model)
    for rank in range(2):  # the mean over ranks of each rank's loss, one process
        (ref(xs[rank], rank == 0).sum() / 2).backward()
    results = run_ranks(_unused_params, 2, model, xs, backend="threaded", timeout=60)
    owner = 1  # does not run b
    assert results[owner][(True, "rows")]["b.weight"] > 0, "the test needs b's rows on a rank that does not run b"
    assert results[owner][False]["b.weight"] is None  # its backward never reached b
    for name, p in ref.named_parameters():
        pieces = [results[r][True][name] for r in range(2)]
        assert torch.allclose(torch.cat(pieces), p.grad, atol=1e-6), name


# ----------------------------------------------------------------------------- dp_mesh_dims


def _dp_mesh_dims(model, x, y, ref) -> dict:
    rank = dist.get_rank()
    xl, yl = _local(x, y, rank, WORLD)
    named = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("a", "b"))
    named3 = init_device_mesh("cpu", (2, 1, WORLD // 2), mesh_dim_names=("r", "s1", "s2"))
    out = {}
    for key, mesh, dims, shards in (
        ("flattened", named, fsdp.DataParallelMeshDims(shard=("a", "b")), WORLD),
        ("hsdp", named, fsdp.DataParallelMeshDims(shard="b", replicate="a"), WORLD // 2),
        ("hsdp flattened", named3, fsdp.DataParallelMeshDims(shard=("s1", "s2"), replicate="r"), WORLD // 2),
    ):
        m = _shard(model, mesh, dp_mesh_dims=dims)
        group = m._fsdp_state.groups[0]
        loss_fn(m, xl, yl).backward()
        out[key] = (group.main.num_shards == shards, group.mesh.ndim, _close(_grads(m), ref))
    # a dim named in neither role belongs to another parallelism: plain parameters are sharded
    # over the named dims only (tests/fsdp/test_dp_mesh_dims.py trains that, spmd_types' shape)
    leftover = fsdp.fully_shard(Block(), mesh=named, dp_mesh_dims=fsdp.DataParallelMeshDims(shard="b"))
    group = leftover._fsdp_state.groups[0]
    out["leftover dim"] = (group.main.num_shards, group.mesh.mesh_dim_names) == (WORLD // 2, ("b",))
    for key, dims, text in (
        ("unknown name", fsdp.DataParallelMeshDims(shard="dp"), "not found"),
        ("ddp", fsdp.DataParallelMeshDims(replicate=("a", "b")), "no_shard"),
    ):
        try:
            fsdp.fully_shard(Block(), mesh=named, dp_mesh_dims=dims)
            out[key] = "not raised"
        except ValueError as e:
            out[key] = text in str(e)
    return out


@pytest.mark.dp_mesh_dims  # torch 2.12+; on 2.11 the clear refusal is checked instead
def test_dp_mesh_dims_selects_and_flattens_dims() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    r = run_ranks(_dp_mesh_dims, WORLD, model, x, y, ref, backend="threaded", timeout=60)[0]
    assert r["flattened"][:2] == (True, 1) and r["hsdp"][:2] == (True, 2) and r["hsdp flattened"][:2] == (True, 2), r
    assert r["flattened"][2] < 1e-5 and r["hsdp"][2] < 1e-5 and r["hsdp flattened"][2] < 1e-5, r
    assert r["leftover dim"] is True and r["unknown name"] is True and r["ddp"] is True, r


# ----------------------------------------------------------------------------- FSDP2's exception types


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.scalar_p = nn.Parameter(torch.tensor(1.0))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def _raises(fn, types: tuple, text: str) -> bool:
    try:
        fn()
    except Exception as e:
        assert all(isinstance(e, t) for t in types), (type(e).__mro__, types)
        assert text in str(e), (text, str(e))
        return True
    raise AssertionError(f"nothing raised, expected {types} with {text!r}")


def _errors() -> dict:
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    # raised before any collective, identically on every rank
    out["3-D mesh"] = _raises(
        lambda: fsdp.fully_shard(Block(), mesh=init_device_mesh("cpu", (WORLD, 1, 1))),
        (ValueError,), "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh",
    )
    out["unnamed 2-D"] = _raises(
        lambda: fsdp.fully_shard(Block(), mesh=init_device_mesh("cpu", (2, WORLD // 2))),
        (AssertionError, ValueError), "Please init the 2D mesh for HSDP with mesh_dim_names specified",
    )
    out["scalar"] = _raises(lambda: fsdp.fully_shard(_Scalar(), mesh=mesh), (ValueError,), "Change scalar_p to a 1D tensor with numel equal to 1")
    conv = nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)
    out["non-contiguous"] = _raises(
        lambda: fsdp.fully_shard(conv, mesh=mesh), (NotImplementedError, ValueError), "FSDP does not support non-contiguous parameters"
    )
    torch.manual_seed(0)  # the same values on every rank from here: fully_shard compares them
    tied = _Tied()
    fsdp.fully_shard(tied.embed, mesh=mesh)
    fsdp.fully_shard(tied.out, mesh=mesh)  # as in FSDP2, a tie split across units raises at the first forward
    fsdp.fully_shard(tied, mesh=mesh)
    ids = torch.tensor([[0, 4, 2]])
    out["tied split"] = _raises(lambda: tied(ids), (ValueError,), "'weight' is shared with a parameter already managed by another")
    out["tied split, again"] = _raises(lambda: tied(ids), (ValueError,), "already managed by another")
    hsdp = fsdp.fully_shard(Block(), mesh=init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("r", "s")))
    out["hook stream on HSDP"] = _raises(
        lambda: hsdp.set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream()), (ValueError,), "stream cannot be set when using native HSDP"
    )
    out["raf int setter"] = _raises(lambda: hsdp.set_reshard_after_forward(2), (ValueError, TypeError), "should be a bool")
    out["custom all-gather"] = _raises(lambda: hsdp.set_custom_all_gather(object()), (TypeError,), "AllGather protocol")
    out["custom reduce-scatter"] = _raises(lambda: hsdp.set_custom_reduce_scatter(object()), (TypeError,), "ReduceScatter protocol")
    out["divide factor"] = _raises(lambda: hsdp.set_gradient_divide_factor(0), (ValueError,), "positive")
    out["share_comm_ctx"] = _raises(lambda: fsdp.share_comm_ctx([hsdp, nn.Linear(2, 2)]), (ValueError,), "FSDPModule")
    # fully_shard.state and the lazy-initialisation errors (first forward)
    seq = nn.Sequential(Block(), Block())
    fsdp.fully_shard(seq[0], mesh=mesh)
    fsdp.fully_shard(seq, mesh=mesh)
    state = fsdp.fully_shard.state
    out["state"] = state(seq) is seq._fsdp_state and state(seq[0]) is not state(seq) and state(seq[1]) is None
    x = torch.randn(2, 8)
    seq[0](x)  # a nested unit run first becomes a root of its own ...
    out["double lazy init"] = _raises(lambda: seq(x), (RuntimeError,), "FSDP state has already been lazily initialized for 0")
    pair = nn.Sequential(Block(), Block())
    fsdp.fully_shard([pair[0], pair[1]], mesh=mesh)
    out["multi-module root"] = _raises(lambda: pair(x), (RuntimeError,), "FSDP requires a single root module")
    out["list state"] = state(pair[0]) is state(pair[1]) is not None
    return out


def test_misuse_raises_fsdp2_exception_types() -> None:
    results = run_ranks(_errors, WORLD, backend="threaded", timeout=60)
    assert all(v is True for v in results[0].values()), results[0]
    assert len(results[0]) == 16, results[0]
