"""All-gather extensions (fsdp/extensions.py): tensor-subclass parameters with FSDP2's
fsdp_pre_all_gather / fsdp_post_all_gather protocol train exactly like one process on the global
batch; the sharded parameters keep their subclass; post_all_gather reuses its output in place;
HSDP passes the 1-D shard mesh; a float8 all-gather casts once per optimizer step (FSDP2, in the
same test, casts on every gather); misuse raises naming the parameter, before any collective."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.two_tensor import TwoTensor

import fsdp
from dbuffer.agreement import RankMismatchError
from tests.harness import run_ranks
from tests.models.float8_weight import Float8RowwiseWeight, cast_count, float8_weights, reference_float8_model
from tests.models.nf4_weight import SplitOnlyTwoTensor

DIM, ROWS_PER_RANK, STEPS = 8, 2, 3


class MLP(nn.Module):
    """``mid=5``: a weight torch.chunk splits unevenly over 4 ranks (5 rows: 2, 2, 1, 0)."""

    def __init__(self, dim: int = DIM, mid: int = 5) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 12, bias=False)
        self.down = nn.Linear(12, mid, bias=False)
        self.out = nn.Linear(mid, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.down(torch.relu(self.up(x)))))


def make_plain(seed: int = 0, mid: int = 5) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(MLP(mid=mid), MLP(mid=mid))


def as_two_tensor(model: nn.Module) -> nn.Module:
    """The same model with every weight a TwoTensor of two copies of it."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(TwoTensor(m.weight.detach().clone(), m.weight.detach().clone()))
    return model


def batches(world: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(world * ROWS_PER_RANK, DIM, generator=g) for _ in range(STEPS)]


def train_reference(model: nn.Module, data: list[torch.Tensor]) -> nn.Module:
    """One process, the global batch: the independent reference."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x in data:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def local_rows(full: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's torch.chunk piece of ``full`` along dim 0 over the shard axis."""
    world, rank = mesh.shape[-1], mesh.get_coordinate()[-1]
    chunks = torch.chunk(full, world, 0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def _train_and_diff(model: nn.Module, reference: nn.Module, data: list[torch.Tensor]) -> float:
    """Train the sharded ``model`` (Adam, each rank its rows of each batch) and return the largest
    difference of its local pieces (``.a`` of the subclass) from the reference's rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x in data:
        model(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ref = dict(reference.named_parameters())
    mesh = next(model.parameters()).device_mesh
    return max(
        (p._local_tensor.a - local_rows(ref[n].detach(), mesh)).abs().max().item()
        for n, p in model.named_parameters()
        if local_rows(ref[n], mesh).numel()
    )


# ----------------------------------------------------------------- TwoTensor with the protocol

CALLS: dict[str, list] = {"pre": [], "post": [], "post_out": []}
_LOCK = threading.Lock()


def pre_v1(self, mesh):
    """The old signature: cannot know the padded size, so only for evenly sharded weights."""
    with _LOCK:
        CALLS["pre"].append(("v1", mesh.ndim, mesh.size()))
    return (self.a, self.b), None


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
    """Pads a short (or empty) piece to the padded piece's rows, as the protocol requires."""
    with _LOCK:
        CALLS["pre"].append(("v2", mesh.ndim, mesh.size(), tuple(outer_size), tuple(outer_stride), type(module)))
    rows = -(-outer_size[0] // mesh.size())
    return (_pad_rows(self.a, rows), _pad_rows(self.b, rows)), tuple(outer_size)


def post(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:
        # in-place reuse: the unsharded parameter already aliases the (refilled) outputs
        assert isinstance(out, TwoTensor) and out.a.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        with _LOCK:
            CALLS["post_out"].append(metadata)
        return None
    with _LOCK:
        CALLS["post"].append(metadata)
    return TwoTensor(a, b), (a, b)


def _two_tensor_parity(model, reference, data, hsdp: bool, reshard_after_forward: bool, strategy: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(model)  # threads: one copy per rank
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, sharding_strategy=strategy)
    for block in model:
        fsdp.fully_shard(block, **kw)
    fsdp.fully_shard(model, **kw)
    for name, p in model.named_parameters():  # the sharded parameter keeps its subclass
        assert type(p) is DTensor and type(p._local_tensor) is TwoTensor, (name, type(p), type(p._local_tensor))
        assert tuple(p.placements) == ((Replicate(), Shard(0)) if hsdp else (Shard(0),))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x in data:
        mine = x.chunk(world)[rank]
        model(mine).square().mean().backward()
        opt.step()
        opt.zero_grad()
    worst = 0.0
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = local_rows(ref[name].detach(), mesh)
        local = p._local_tensor
        worst = max(worst, (local.a - want).abs().max().item() if want.numel() else 0.0)
        worst = max(worst, (local.b - want).abs().max().item() if want.numel() else 0.0)
    return {"worst": worst}


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize(
    "hsdp,reshard,strategy",
    [(False, True, "optim_grads_params"), (False, False, "optim_grads_params"), (True, True, "optim_grads_params"),
     (False, True, "optim_grads")],
)
def test_two_tensor_extension_trains_like_one_process(version, hsdp, reshard, strategy) -> None:
    world = 4
    plain = make_plain(mid=4 if version == "v1" else 5)
    data = batches(world)
    reference = train_reference(plain, data)
    moved = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), plain.parameters()))
    assert moved > 1e-3  # the comparison below is not between untrained weights
    for key in CALLS:
        CALLS[key].clear()
    TwoTensor.fsdp_pre_all_gather = pre_v1 if version == "v1" else pre_v2
    TwoTensor.fsdp_post_all_gather = post
    try:
        results = run_ranks(
            _two_tensor_parity, world, as_two_tensor(plain), reference, data, hsdp, reshard, strategy,
            backend="threaded", timeout=120,
        )
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
    assert max(r["worst"] for r in results) <= 1e-6, results
    weights, units = 6, 3  # 2 blocks x 3 weights; the root owns none
    # Each weight is prepared once per optimizer step, on every rank, with the 1-D shard mesh.
    assert len(CALLS["pre"]) == weights * STEPS * world, len(CALLS["pre"])
    shard = world // 2 if hsdp else world
    assert {c[1:3] for c in CALLS["pre"]} == {(1, shard)}
    assert {c[0] for c in CALLS["pre"]} == {version}
    if version == "v2":
        sizes = {c[3] for c in CALLS["pre"]}
        assert sizes == {(12, DIM), (5, 12), (DIM, 5)}
        assert {c[4] for c in CALLS["pre"]} == {(DIM, 1), (12, 1), (5, 1)}
        assert {c[5] for c in CALLS["pre"]} == {nn.Linear}
    # The unsharded parameter is built once per weight and rank, then refilled in place: ZeRO-3
    # regathers in backward and every step, ZeRO-2 (optim_grads) once per step
    assert len(CALLS["post"]) == weights * world
    regathers = weights * world * (STEPS - 1 if strategy == "optim_grads" or not reshard else 2 * STEPS - 1)
    assert len(CALLS["post_out"]) == regathers, (len(CALLS["post_out"]), regathers)
    del units


def _plain_subclass_parity(model, reference, data) -> dict:
    """A subclass without the methods: gathered as its values, plain unsharded parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(model)
    for block in model:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kinds = set()
    model[0].up.register_forward_pre_hook(lambda m, a: kinds.add(type(m.weight).__name__))
    for x in data:
        model(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mesh = next(model.parameters()).device_mesh
    ref = dict(reference.named_parameters())
    worst = max(
        (p._local_tensor.b - local_rows(ref[n].detach(), mesh)).abs().max().item()
        for n, p in model.named_parameters()
        if local_rows(ref[n], mesh).numel()
    )
    return {"worst": worst, "kinds": kinds, "local": {type(p._local_tensor).__name__ for p in model.parameters()}}


def test_subclass_without_the_methods_trains_like_one_process() -> None:
    world = 4
    plain = make_plain()
    data = batches(world)
    reference = train_reference(plain, data)
    for r in run_ranks(_plain_subclass_parity, world, as_two_tensor(plain), reference, data, backend="threaded", timeout=120):
        assert r["worst"] <= 1e-6 and r["kinds"] == {"Parameter"} and r["local"] == {"TwoTensor"}, r


# ----------------------------------------------------------------- float8 all-gather

MICRO = 2  # micro-batches per optimizer step: ZeRO-3 gathers each weight 2 x MICRO times a step


def _train_float8(model, data, shard, rank: int, world: int) -> int:
    """Shard with ``shard`` (fsdp's or torch's fully_shard), train; return the casts it made
    (fsdp's first one may come at fully_shard already)."""
    before = cast_count()
    for block in model:
        shard(block)
    shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x in data:
        for micro in x.chunk(MICRO):
            model(micro.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return cast_count() - before


def _float8_run(plain, reference, data) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    ref = dict(reference.named_parameters())
    for name, shard in (("fsdp", lambda m: fsdp.fully_shard(m, mesh=mesh)), ("torch", lambda m: torch_fully_shard(m, mesh=mesh))):
        model = float8_weights(plain)
        out[f"{name}_casts"] = _train_float8(model, data, shard, rank, world)
        worst = 0.0
        for pname, p in model.named_parameters():
            local = p._local_tensor
            assert type(local) is Float8RowwiseWeight, (name, pname, type(local))
            want = local_rows(ref[pname].detach(), mesh)
            if want.numel():
                worst = max(worst, (local._data - want).abs().max().item())
        out[f"{name}_worst"] = worst
        if name == "fsdp":
            groups = [g for m in model.modules() if isinstance(m, fsdp.FSDPModule) for g in m._fsdp_state.groups]
            out["send_dtype"] = {str(g.weights.send.dtype) for g in groups}
            out["send_bytes"] = sum(g.weights.send.local_buffer.nbytes for g in groups)
            out["fp32_shard_bytes"] = sum(p._local_tensor.numel() * 4 for p in model.parameters())
            out["weights"] = sum(1 for _ in model.parameters())
    return out


def test_float8_gather_trains_like_one_process_and_casts_once_per_step() -> None:
    world = 2
    plain = make_plain(mid=4)  # even pieces: FSDP2 refuses a scale input for an unevenly sharded weight
    data = batches(world * MICRO)
    reference = reference_float8_model(plain)  # the same rounding on one process (straight-through)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for x in data:
        for micro in x.chunk(MICRO):
            reference(micro).square().mean().backward()
        opt.step()
        opt.zero_grad()
    results = run_ranks(_float8_run, world, plain, reference, data, backend="threaded", timeout=180)
    for r in results:
        assert r["fsdp_worst"] <= 1e-5 and r["torch_worst"] <= 1e-5, r
        assert r["send_dtype"] == {"torch.uint8"}  # float8 data and fp32 scales travel as bytes
        # 1 byte per element + 4 per row (+ alignment), against 4 per element for the fp32 shard
        assert r["send_bytes"] < 0.5 * r["fp32_shard_bytes"], r
        # once per weight and optimizer step, however many gathers; torch FSDP2 casts at each gather
        assert r["fsdp_casts"] == r["weights"] * STEPS, r
        assert r["torch_casts"] == r["weights"] * STEPS * MICRO * 2, r


# ----------------------------------------------------------------- meta init, late patches, misuse


def _meta_init_and_patch(plain, reference, data) -> dict:
    """Built on meta, initialised by fsdp.init_weights (full TwoTensors, one unit at a time),
    then trained: the same weights as one process. Then a bf16 pre/post pair monkey-patched on
    the local tensors (after fully_shard, as FSDP2 allows) is used from the next step on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = as_two_tensor(make_plain(mid=4))
    for block in model:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    weights = dict(plain.named_parameters())
    names = {id(m): n for n, m in model.named_modules()}

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            w = weights[names[id(m)] + ".weight"].detach()
            assert type(m.weight) is TwoTensor and m.weight.shape == w.shape  # full, its own type
            m.weight.copy_(TwoTensor(w, w))

    fsdp.init_weights(model, init)
    worst = _train_and_diff(model, reference, data)
    seen = []

    def pre(self, mesh):
        seen.append(self.dtype)
        return (self.a.to(torch.bfloat16),), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:
            out.copy_(outputs[0])
            return None
        upcast = outputs[0].to(param_dtype)
        return upcast, (outputs[0], upcast)

    for p in model.parameters():
        p._local_tensor.fsdp_pre_all_gather = pre.__get__(p._local_tensor)
        p._local_tensor.fsdp_post_all_gather = post.__get__(p._local_tensor)
    model(data[0].chunk(world)[rank]).square().mean().backward()
    # the new unsharded parameters (built by the patched post) report their gradients too
    grads = sum(p.grad is not None for p in model.parameters())
    sharded = model[0].up.weight
    return {"worst": worst, "patched_calls": len(seen), "sharded_type": type(sharded._local_tensor).__name__, "grads": grads}


def test_meta_init_weights_and_late_monkey_patch() -> None:
    world = 4
    plain = make_plain(mid=4)
    data = batches(world)
    reference = train_reference(plain, data)
    for r in run_ranks(_meta_init_and_patch, world, plain, reference, data, backend="threaded", timeout=120):
        assert r["worst"] <= 1e-6, r
        assert r["patched_calls"] == 6 and r["sharded_type"] == "TwoTensor" and r["grads"] == 6, r


class PreOnly(TwoTensor):
    def fsdp_pre_all_gather(self, mesh):
        return (self.a,), None


def _errors(plain) -> dict:
    out = {}
    cases = {
        "pre without post": (lambda m: _swap(m, PreOnly), {}, ValueError),
        "no_shard": (as_two_tensor, {"sharding_strategy": "no_shard"}, ValueError),
        "shard dim 1": (as_two_tensor, {"shard_placement_fn": lambda p: Shard(1)}, ValueError),
    }
    for case, (convert, kw, error) in cases.items():
        model = convert(plain)
        with pytest.raises(error) as info:
            fsdp.fully_shard(model, **kw)
        out[case] = str(info.value)
        assert not isinstance(model, fsdp.FSDPModule)  # nothing changed
    # a plain model whose local tensors get the methods after fully_shard: refused at the next use
    model = fsdp.fully_shard(copy.deepcopy(plain))
    p = model[0].up.weight
    p._local_tensor.fsdp_pre_all_gather = lambda mesh: ((p._local_tensor,), None)
    p._local_tensor.fsdp_post_all_gather = lambda *a, **k: None
    with pytest.raises(TypeError) as info:
        model(torch.randn(2, DIM))
    out["late on plain"] = str(info.value)
    # a pre-all-gather that returns a bare tensor
    model = fsdp.fully_shard(as_two_tensor(plain))
    for q in model.parameters():
        q._local_tensor.fsdp_pre_all_gather = (lambda t: lambda mesh: (t.a, None))(q._local_tensor)
        q._local_tensor.fsdp_post_all_gather = post.__get__(q._local_tensor)
    with pytest.raises(TypeError) as info:
        model(torch.randn(2, DIM))
    out["bare tensor"] = str(info.value)
    with pytest.raises(ValueError) as info:
        model.to(torch.float64)
    out["to float64"] = str(info.value)
    return out


def _swap(model: nn.Module, cls: type) -> nn.Module:
    model = as_two_tensor(model)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            m.weight = nn.Parameter(cls(w.a.detach(), w.b.detach()))
    return model


def test_misuse_raises_naming_the_parameter() -> None:
    results = run_ranks(_errors, 2, make_plain(), backend="threaded", timeout=60)
    assert results[0] == results[1]
    msgs = results[0]
    assert "'0.up.weight'" in msgs["pre without post"] and "fsdp_post_all_gather" in msgs["pre without post"]
    assert "'0.up.weight'" in msgs["no_shard"] and "no_shard" in msgs["no_shard"]
    assert "'0.up.weight'" in msgs["shard dim 1"] and "Shard(1)" in msgs["shard dim 1"]
    assert "'0.up.weight'" in msgs["late on plain"] and "before fully_shard" in msgs["late on plain"]
    assert "'0.up.weight'" in msgs["bare tensor"] and "tuple of tensors" in msgs["bare tensor"]
    assert "float64" in msgs["to float64"] and "before sharding" in msgs["to float64"]


def _differing_subclass_values() -> str:
    torch.manual_seed(dist.get_rank())  # a different init on every rank
    model = as_two_tensor(make_plain(seed=dist.get_rank()))
    try:
        fsdp.fully_shard(model)
    except RankMismatchError as exc:
        assert not isinstance(model, fsdp.FSDPModule)
        return str(exc)
    return "sharded"


def test_ranks_with_different_subclass_values_raise_naming_the_parameter() -> None:
    messages = run_ranks(_differing_subclass_values, 2, backend="gloo")
    assert messages[0] == messages[1]
    assert "'0.up.weight values'" in messages[0], messages[0]


# ----------------------------------------------------------------- a cached cast is never stale


class ScaledTwoTensor(TwoTensor):
    """Mirrors torchao's float8 weight where fsdp meets it: ``fsdp_pre_all_gather`` reads an
    attribute (torchao's ``_precomputed_scale``) that ``precompute_float8_dynamic_scale_for_fsdp``
    replaces after the optimizer step without changing any tensor's version."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        scale = getattr(self, "_precomputed_scale", None)
        a = self.a if scale is None else self.a * scale
        rows = -(-outer_size[0] // mesh.size())
        return (_pad_rows(a, rows), _pad_rows(self.b, rows)), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        a, b = outputs
        if out is not None:
            return None
        return TwoTensor(a, b), (a, b)


def _scale_seen_after_a_gather_in_between(model) -> dict:
    world = dist.get_world_size()
    model = copy.deepcopy(model)
    full = {n: p.detach().a.clone() for n, p in model.named_parameters()}
    fsdp.fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    out = {}
    for order in ("documented", "gather in between"):
        scale = torch.tensor(2.0 if order == "documented" else 3.0)
        if order == "gather in between":  # e.g. an eval forward between opt.step() and the precompute
            model.unshard()
            model.reshard()
        for p in model.parameters():
            p._local_tensor._precomputed_scale = scale.clone()  # a new tensor: no version bump anywhere
        model.unshard()
        seen = {n: m.weight.a for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        out[order] = max(float((seen[n[: -len(".weight")]] - full[n] * scale).abs().max()) for n in full)
        model.reshard()
    return out


def test_a_cached_cast_is_recomputed_when_its_inputs_change_without_a_version_bump() -> None:
    model = as_two_tensor(make_plain(mid=4))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            w = m.weight.detach()
            m.weight = nn.Parameter(ScaledTwoTensor(w.a.clone(), w.b.clone()))
    for r in run_ranks(_scale_seen_after_a_gather_in_between, 2, model, backend="threaded"):
        assert r == {"documented": 0.0, "gather in between": 0.0}, r


# ----------------------------------------------------------------- NF4: cut by torch.chunk


def _split_only_parity(model, reference, data) -> float:
    model = copy.deepcopy(model)
    for block in model:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    assert all(type(p._local_tensor) is SplitOnlyTwoTensor for p in model.parameters())
    return _train_and_diff(model, reference, data)


def test_a_subclass_without_partial_slices_is_cut_by_torch_chunk_and_trains_like_one_process() -> None:
    plain = make_plain(mid=4)  # every weight divides evenly over 2 ranks, as NF4's FSDP2 path needs
    data = batches(2)
    reference = train_reference(plain, data)
    model = copy.deepcopy(plain)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            w = m.weight.detach()
            m.weight = nn.Parameter(SplitOnlyTwoTensor(w.clone(), w.clone()))
    with pytest.raises(NotImplementedError, match="aten.slice"):  # the mirror refuses what NF4 refuses
        next(model.parameters()).detach()[0:1]
    assert max(run_ranks(_split_only_parity, 2, model, reference, data, backend="gloo")) <= 1e-6
