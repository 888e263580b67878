"""fully_shard's surface: class swapping, FSDP2-compatible methods, and misuse errors that are
raised before any collective (only rank 0 misuses; a collective would hang it)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp
import fsdp.unit.fully_shard
from tests.fsdp.models import Block, loss_fn, make_batches, make_model
from tests.harness import run_ranks


def _surface(model) -> bool:
    names = [n for n, _ in model.named_parameters()]
    m = copy.deepcopy(model)
    for b in m.blocks:
        fsdp.fully_shard(b)
    out = fsdp.fully_shard(m)
    assert out is m and type(m).__name__ == "FSDPTinyLM" and isinstance(m, fsdp.FSDPModule)
    assert isinstance(m, type(model)) and type(m.blocks[0]).__name__ == "FSDPBlock"
    assert [n for n, _ in m.named_parameters()] == names  # same FQNs as before
    assert all(isinstance(p, DTensor) for p in m.parameters())
    # unshard / reshard by hand
    handle = m.blocks[0].unshard(async_op=True)
    handle.wait()
    assert not any(isinstance(p, DTensor) for p in m.blocks[0].parameters())
    m.blocks[0].reshard()
    assert all(isinstance(p, DTensor) for p in m.blocks[0].parameters())
    # a list of modules is one unit
    m2 = copy.deepcopy(model)
    fsdp.fully_shard([m2.blocks[0], m2.blocks[1]])
    assert m2.blocks[0]._fsdp_state is m2.blocks[1]._fsdp_state
    fsdp.fully_shard(m2)
    x, y = make_batches(1)[0]
    loss_fn(m2, x, y).backward()
    assert all(p.grad is not None for p in m2.parameters())
    x, y = make_batches(1)[0]
    # another method run like forward
    m5 = fsdp.fully_shard(copy.deepcopy(model))
    m5.logits_of = lambda tokens: m5.head(m5.norm(m5.embed(tokens)))
    fsdp.register_fsdp_forward_method(m5, "logits_of")
    with torch.no_grad():
        assert m5.logits_of(x).shape == (*x.shape, 16)
    # a root without parameters of its own
    m4 = torch.nn.Sequential(*copy.deepcopy(model).blocks)
    for b in m4:
        fsdp.fully_shard(b)
    fsdp.fully_shard(m4)
    assert m4._fsdp_state.groups == []
    m4(torch.randn(2, 3, 8)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in m4.parameters())
    # ignored parameters stay plain and unmanaged (their gradients are not synchronised)
    m3 = copy.deepcopy(model)
    keep = m3.norm.weight
    fsdp.fully_shard(m3, ignored_params={keep})
    assert m3.norm.weight is keep and not isinstance(keep, DTensor)
    assert all(info.fqn != "norm.weight" for g in m3._fsdp_state.groups for info in g.infos)
    loss_fn(m3, x, y).backward()
    assert keep.grad is not None and isinstance(m3.head.weight.grad, DTensor)
    return True


def test_class_swap_and_fsdp2_methods() -> None:
    assert all(run_ranks(_surface, 2, make_model(), backend="gloo"))


class WithInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.count = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))


def _expect(fn, exc, text) -> str:
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, str(e))
        return "ok"
    raise AssertionError(f"expected {exc.__name__} containing {text!r}")


def _misuse() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mesh3d = init_device_mesh("cpu", (dist.get_world_size(), 1, 1))
    other = DeviceMesh("cpu", [1])  # excludes rank 0
    out = {}
    if dist.get_rank() == 0:  # rank 0 alone: each raises before any collective, or it would hang
        _misuse_alone(out, mesh, mesh3d, other)
    # Every rank: these shard something first, and fully_shard's agreement check is a collective.
    _misuse_after_sharding(out, mesh)
    return out


def _misuse_alone(out: dict, mesh, mesh3d, other) -> None:
    bf16 = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    out["non_float"] = _expect(lambda: fsdp.fully_shard(WithInt(), mesh=mesh, mp_policy=bf16), ValueError, "non-floating")
    out["mesh_3d"] = _expect(lambda: fsdp.fully_shard(Block(), mesh=mesh3d), ValueError, "1-D")
    out["mesh_rank"] = _expect(lambda: fsdp.fully_shard(Block(), mesh=other), ValueError, "not part of mesh")
    out["mesh_type"] = _expect(lambda: fsdp.fully_shard(Block(), mesh="cpu"), TypeError, "DeviceMesh")
    out["strategy"] = _expect(lambda: fsdp.fully_shard(Block(), sharding_strategy="zero4"), ValueError, "unknown sharding_strategy")
    out["policy"] = _expect(lambda: fsdp.MixedPrecisionPolicy(param_dtype=torch.int8), ValueError, "floating")
    out["scalar"] = _expect(lambda: fsdp.fully_shard(Scalar(), mesh=mesh), ValueError, "0-D")
    out["raf_type"] = _expect(lambda: fsdp.fully_shard(Block(), mesh=mesh, reshard_after_forward="no"), TypeError, "bool")
    out["raf_int"] = _expect(lambda: fsdp.fully_shard(Block(), mesh=mesh, reshard_after_forward=3), ValueError, "factor")


def _misuse_after_sharding(out: dict, mesh) -> None:
    torch.manual_seed(0)  # every rank builds the same values (rank 0 built more above)
    # sharding twice
    block = fsdp.fully_shard(Block(), mesh=mesh)
    out["twice"] = _expect(lambda: fsdp.fully_shard(block, mesh=mesh), ValueError, "already sharded")
    # a module shared by two parents: the second parent finds its parameters owned
    shared = nn.Linear(2, 2)
    a, b = nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2), shared)
    fsdp.fully_shard(a, mesh=mesh)
    out["owned"] = _expect(lambda: fsdp.fully_shard(b, mesh=mesh), ValueError, "already owned")
    assert type(b) is nn.Sequential and not isinstance(b[0].weight, DTensor)  # untouched
    # a failure during setup restores the class and the parameters
    block = Block()
    before = dict(block.named_parameters())
    real = fsdp.unit.fully_shard.ParameterGroup

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    fsdp.unit.fully_shard.ParameterGroup = boom
    try:
        out["restore"] = _expect(lambda: fsdp.fully_shard(block, mesh=mesh), RuntimeError, "injected")
    finally:
        fsdp.unit.fully_shard.ParameterGroup = real
    assert type(block) is Block and dict(block.named_parameters()) == before
    fsdp.fully_shard(block, mesh=mesh)  # and it can be sharded afterwards


def test_misuse_raises_before_any_collective() -> None:
    results = run_ranks(_misuse, 2, backend="gloo", timeout=60)
    assert set(results[0].values()) == {"ok"} and len(results[0]) == 12, results[0]


def test_policy_dtypes(monkeypatch) -> None:
    from fsdp.group import policy as policy_module

    p = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    # reduce_dtype=None as the installed FSDP2 reads it: the compute dtype before torch 2.15 ...
    monkeypatch.setattr(policy_module, "reduces_in_grad_dtype", lambda: False)
    d = p.dtypes_for(torch.float32)
    assert (d.main, d.model, d.main_grad, d.reduce) == (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
    # ... the gradient dtype from 2.15 (the original dtype, or grad_dtype), never below the compute dtype
    monkeypatch.setattr(policy_module, "reduces_in_grad_dtype", lambda: True)
    assert p.dtypes_for(torch.float32).reduce == torch.float32
    assert p.dtypes_for(torch.bfloat16).reduce == torch.bfloat16
    assert p.dtypes_for(torch.bfloat16, grad_dtype=torch.float32).reduce == torch.float32
    assert fsdp.MixedPrecisionPolicy().dtypes_for(torch.bfloat16).reduce == torch.bfloat16  # computed in bf16
    assert fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16).dtypes_for(torch.float32).reduce == torch.bfloat16
    monkeypatch.undo()
    assert not policy_module.reduces_in_grad_dtype(type("OldFSDPParam", (), {}))
    assert policy_module.reduces_in_grad_dtype(type("NewFSDPParam", (), {"unsharded_grad_dtype": property(lambda s: None)}))
    d = fsdp.MixedPrecisionPolicy(main_params_dtype=None).dtypes_for(torch.float64)
    assert (d.main, d.model, d.main_grad, d.reduce) == (torch.float64,) * 4


@pytest.mark.parametrize("reduces_in_grad_dtype", [False, True])
def test_default_dtypes_follow_the_built_dtype(monkeypatch, reduces_in_grad_dtype) -> None:
    """No policy: compute (and so reduce) in the dtype a parameter was built in, as FSDP2; main
    weights and main grads FP32 or wider (never less precise than built); explicit dtypes win."""
    from fsdp.group import policy as policy_module

    monkeypatch.setattr(policy_module, "reduces_in_grad_dtype", lambda: reduces_in_grad_dtype)
    default = fsdp.MixedPrecisionPolicy()
    f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
    for built, main in ((bf16, f32), (f16, f32), (f32, f32), (f64, f64)):
        d = default.dtypes_for(built)
        assert (d.main, d.model, d.main_grad, d.reduce) == (main, built, main, built), (built, d)
    assert fsdp.MixedPrecisionPolicy(main_params_dtype=None).dtypes_for(bf16).main == bf16  # FSDP2's storage
    fp8 = torch.float8_e4m3fn
    assert default.dtypes_for(fp8).main == f32  # trained: FP32 main (torch cannot promote float8)
    for built in (bf16, fp8, f64):  # frozen: no step to keep precise, the built dtype stays
        d = default.dtypes_for(built, requires_grad=False)
        assert (d.main, d.model) == (built, built)
    explicit = fsdp.MixedPrecisionPolicy(main_params_dtype=f32).dtypes_for(f64)  # a policy may say less precise
    assert (explicit.main, explicit.model) == (f32, f64)
    assert fsdp.MixedPrecisionPolicy(main_params_dtype=bf16).dtypes_for(f32).main == bf16
    assert fsdp.MixedPrecisionPolicy(param_dtype=bf16).dtypes_for(f64).model == bf16
    assert repr(default.main_params_dtype) == "fsdp.FLOAT32_OR_WIDER"  # the same on every rank (agreement digest)


def test_torch_mixed_precision_policy_is_accepted() -> None:
    """torch's own MixedPrecisionPolicy, every field of the installed torch, converts to fsdp's;
    anything else is refused naming the argument."""
    import dataclasses

    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from fsdp.group.policy import as_policy

    values = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.float16,
              "cast_forward_inputs": False, "param_dtype_override_fn": lambda p: None}
    theirs = TorchPolicy(**{f.name: values[f.name] for f in dataclasses.fields(TorchPolicy)})
    ours = as_policy(theirs)
    assert isinstance(ours, fsdp.MixedPrecisionPolicy)
    for f in dataclasses.fields(TorchPolicy):
        assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    assert ours.main_params_dtype is fsdp.FLOAT32_OR_WIDER
    assert as_policy(ours) is ours
    with pytest.raises(TypeError, match="buckets\\[0\\].mp_policy must be an fsdp.MixedPrecisionPolicy or torch's"):
        as_policy("bf16", "buckets[0].mp_policy")
    assert fsdp.MixedPrecisionPolicy().dtypes_for(torch.int64).main == torch.int64
    with pytest.raises(ValueError, match="unknown sharding_strategy"):
        fsdp.unit.fully_shard.parse_strategy("FULL_SHARD")


# ----------------------------------------------------------------------------- module.to after fully_shard


def _loss64(model, x, y) -> torch.Tensor:
    """Cross entropy in the logits' own dtype (``loss_fn`` rounds to fp32, which would hide float64)."""
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1))


def _adamw64(model, batches, rank: int = 0, world: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        per = x.shape[0] // world
        _loss64(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full64(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _to_float64(model, batches, ref) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        m = copy.deepcopy(model)
        for b in m.blocks:
            fsdp.fully_shard(b, sharding_strategy=strategy)
        fsdp.fully_shard(m, sharding_strategy=strategy)
        before = list(m.parameters())
        assert m.to(torch.float64) is m
        params = list(m.parameters())
        assert all(a is b for a, b in zip(before, params)), "parameters keep their identity"
        assert all(isinstance(p, DTensor) and p.dtype == p._local_tensor.dtype == torch.float64 for p in params)
        assert m.cpu() is m and m.to("cpu") is m and list(m.parameters()) == params  # the mesh's device: no-op
        # the first step: gradients are float64; after the last, the AdamW state is too
        x, y = batches[0]
        per = x.shape[0] // world
        _loss64(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        assert all(p.grad.dtype == p.grad._local_tensor.dtype == torch.float64 for p in params), strategy
        m.zero_grad()
        _, opt = _adamw64(m, batches, rank, world)
        assert all(v.dtype == torch.float64 for s in opt.state.values() for k, v in s.items() if k != "step")
        got = _full64(m)
        out[strategy] = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    return out


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_to_float64_after_fully_shard_trains_like_a_float64_model(backend, world) -> None:
    model, batches = make_model(), make_batches(3)
    ref = _full64(_adamw64(copy.deepcopy(model).to(torch.float64), batches)[0])
    result = run_ranks(_to_float64, world, model, batches, ref, backend=backend)[0]
    assert all(v <= 1e-12 for v in result.values()), result


def _to_details(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batches[0]
    per = x.shape[0] // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    out = {}
    # Explicit policy dtypes stay; the ones derived from the parameters follow.
    bf16 = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = fsdp.fully_shard(copy.deepcopy(model), mp_policy=bf16)
    m.double()
    d = m._fsdp_state.groups[0].dtypes
    out["explicit_stay"] = (d.main, d.model, d.main_grad, d.reduce) == (
        torch.float64, torch.bfloat16, torch.float64, torch.float32
    )
    loss_fn(m, x, y).backward()  # runs in bf16, gradients land in the float64 main grads
    out["bf16_compute"] = all(p.dtype == p.grad.dtype == torch.float64 for p in m.parameters())
    # A converted group keeps no view of the gather buffers it replaced (freed with them).
    m = fsdp.fully_shard(copy.deepcopy(model), mp_policy=bf16)
    loss_fn(m, x, y).backward()
    rows = [g.weights._row_of for g in m._fsdp_state.groups]
    m.double()
    out["rows_dropped"] = all(r is not None for r in rows) and all(g.weights._row_of is None for g in m._fsdp_state.groups)
    # Gradients already reduced are converted with the parameters (nn.Module._apply does too).
    m = fsdp.fully_shard(copy.deepcopy(model))
    loss_fn(m, x, y).backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    m.to(torch.float64)
    out["grads_follow"] = all(
        p.grad.dtype == torch.float64 and torch.equal(p.grad.full_tensor(), grads[n].double())
        for n, p in m.named_parameters()
    )
    # The unsharded parameters registered after the root's forward are resharded first.
    with torch.no_grad():
        m(x)
    m.half()
    out["half"] = all(isinstance(p, DTensor) and p.dtype == torch.float16 for p in m.parameters())
    # Another device than the mesh's raises before anything changes.
    params = list(m.parameters())
    try:
        m.to("meta")
        out["meta"] = "no error"
    except ValueError as e:
        out["meta"] = "mesh" in str(e) and all(p.device.type == "cpu" and p.dtype == torch.float16 for p in params)
    return out


def test_to_keeps_explicit_policy_dtypes_converts_gradients_and_refuses_other_devices() -> None:
    result = run_ranks(_to_details, 2, make_model(), make_batches(1), backend="threaded")[0]
    assert all(v is True for v in result.values()), result


def _stale_parameters(model, batches) -> dict:
    """Parameters fsdp no longer trains: an optimizer built before fully_shard (or on the
    unsharded views of an unsharded unit) and a parameter reassigned after it raise, naming the
    fix, before anything changes; correct use afterwards still works."""
    x, y = batches[0]
    out = {}
    m = copy.deepcopy(model)
    early = torch.optim.SGD(m.parameters(), lr=0.1)
    early.step()  # fine before sharding (nothing to do: no gradients)
    for b in m.blocks:
        fsdp.fully_shard(b)
    fsdp.fully_shard(m)
    loss_fn(m, x, y).backward()
    before = [p._local_tensor.clone() for p in m.parameters()]
    out["early"] = _expect(early.step, RuntimeError, "Build the optimizer after fully_shard")
    assert all(torch.equal(b, p._local_tensor) for b, p in zip(before, m.parameters()))
    m.blocks[0].unshard()
    gathered = torch.optim.SGD(m.parameters(), lr=0.1)
    m.blocks[0].reshard()
    out["unsharded"] = _expect(gathered.step, RuntimeError, "model.reshard() first")
    late = torch.optim.SGD(m.parameters(), lr=0.1)
    late.step()  # built after fully_shard: steps the shards
    assert not all(torch.equal(b, p._local_tensor) for b, p in zip(before, m.parameters()))
    late.step()  # checked once: the cached check still passes

    new = nn.Parameter(torch.zeros_like(model.blocks[0].gate.weight))
    m.blocks[0].gate.weight = new
    out["reassigned"] = _expect(lambda: loss_fn(m, x, y), RuntimeError, "'gate.weight' of the unit of Block was replaced")
    assert m.blocks[0].gate.weight is new  # the user's parameter was not overwritten
    out["reshard"] = _expect(m.blocks[0].reshard, RuntimeError, "Assign parameters before fully_shard")
    assert m.blocks[0].gate.weight is new

    # Replaced while unsharded: the refused reshard registers nothing, not even the parameters
    # checked before the replaced one (norm.weight stays the unsharded tensor it found).
    m = copy.deepcopy(model)
    fsdp.fully_shard(m.blocks[0])
    fsdp.fully_shard(m)
    m.blocks[0].unshard()
    registered = dict(m.blocks[0].named_parameters())
    assert not isinstance(registered["norm.weight"], DTensor), "unshard() registers the unsharded parameters"
    m.blocks[0].gate.weight = new
    out["unsharded_reshard"] = _expect(m.blocks[0].reshard, RuntimeError, "'gate.weight' of the unit of Block was replaced")
    assert all(p is (new if n == "gate.weight" else registered[n]) for n, p in m.blocks[0].named_parameters())
    return out


def test_stale_optimizer_and_reassigned_parameter_raise() -> None:
    results = run_ranks(_stale_parameters, 2, make_model(), make_batches(1), backend="gloo", timeout=60)
    assert results[0] == results[1] == {"early": "ok", "unsharded": "ok", "reassigned": "ok", "reshard": "ok", "unsharded_reshard": "ok"}, results
