"""HFSDP (fsdp.compose.outer_shard): on a 2x2 (replicate, shard) mesh, outer_dp_sharding_strategy='optim'
shards main weights, main grads and optimizer state over all four ranks while weights are
gathered on the shard axis only. Parity with plain HSDP and with one process on the global batch;
optimizer-state bytes per rank; DCP checkpoints load into HSDP and into 1-D FSDP exactly; bad
arguments raise before any collective."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp
from fsdp.group.layout_choice import layout_policy
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks, spy_collectives


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _shard(model, mesh, outer: str, strategy: str = "optim_grads_params", **kw):
    m = copy.deepcopy(model)
    for block in m.blocks:
        fsdp.fully_shard(block, mesh=mesh, sharding_strategy=strategy, outer_dp_sharding_strategy=outer, **kw)
    fsdp.fully_shard(m, mesh=mesh, sharding_strategy=strategy, outer_dp_sharding_strategy=outer, **kw)
    return m


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's tensor optimizer state (DTensors: their local pieces)."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            local = value._local_tensor if isinstance(value, DTensor) else value
            if isinstance(local, torch.Tensor) and local.dim() > 0:
                total += local.numel() * local.element_size()
    return total


def _parity(model, batches, strategy: str, policy, layout: str = "auto") -> dict:
    mesh = _mesh()
    rank = dist.get_rank()
    kw = {} if policy is None else {"mp_policy": policy}
    out = {}
    opts = {}
    for outer in ("no_shard", "optim"):
        with layout_policy(layout):  # "ragged": every group cut element-granularly
            m = _shard(model, mesh, outer, strategy, **kw)
        group = m._fsdp_state.groups[0]
        assert (type(group.main.layout).__name__ == "RaggedLayout") == (layout == "ragged")
        if outer == "optim":
            # this rank's main piece is finest piece s*R + r of R*S = 4: inside its HSDP shard s
            r, s = mesh.get_coordinate()
            assert group.main.num_shards == 4 and group.main.shard_index == s * 2 + r
            assert group.weights.model.num_shards == 2 and group.weights.model.shard_index == s
            p = next(m.parameters())
            assert isinstance(p, DTensor) and list(p.placements) == [Shard(0), Shard(0)]
            assert p.device_mesh.mesh_dim_names == ("shard", "replicate")
        captured = []
        train(m, batches, rank=rank, world=4, micro=2, make_opt=lambda ps: captured.append(
            torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)) or captured[-1])
        out[outer] = full_state(m)
        opts[outer] = _state_bytes(captured[0])
    return {
        "hfsdp_vs_hsdp": max_diff(out["optim"], out["no_shard"]),
        "states": out["optim"],
        "bytes": (opts["no_shard"], opts["optim"]),
    }


@pytest.mark.parametrize(
    "strategy,policy,backend,layout",
    [
        ("optim_grads_params", None, "threaded", "auto"),
        ("optim_grads_params", None, "gloo", "auto"),
        ("optim_grads", None, "threaded", "auto"),
        ("optim", None, "threaded", "auto"),
        ("optim_grads_params", fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "threaded", "auto"),
        ("optim_grads_params", None, "threaded", "ragged"),
    ],
    ids=["zero3", "zero3-gloo", "zero2", "zero1", "zero3-bf16", "zero3-ragged"],
)
def test_hfsdp_matches_hsdp_and_single_process(strategy, policy, backend, layout) -> None:
    model, batches = make_model(), make_batches(3)
    results = run_ranks(_parity, 4, model, batches, strategy, policy, layout, backend=backend, timeout=180)
    r0 = results[0]
    assert r0["hfsdp_vs_hsdp"] <= 1e-6, r0["hfsdp_vs_hsdp"]
    if policy is None:  # the same run on one process, global batch, 2 micro-batches
        ref = reference(model, batches, micro=2)
        assert max_diff(r0["states"], ref) <= 1e-5
    # every rank: optimizer state is HSDP's / R (R = 2), up to the rows a row-atomic cut moves
    # between the two halves of a shard (at most one row of each parameter, two AdamW states)
    slack = 2 * 4 * sum(p[0].numel() if p.dim() else 1 for p in model.parameters())
    for r in results:
        h, f = r["bytes"]
        assert abs(2 * f - h) <= 2 * slack, (h, f)
    total_hsdp = sum(r["bytes"][0] for r in results)
    total_hfsdp = sum(r["bytes"][1] for r in results)
    assert total_hfsdp * 2 == total_hsdp, (total_hsdp, total_hfsdp)


def _checkpoint_reshards(model, other, batches, path: str) -> tuple:
    """Train HFSDP 2x2 (AdamW), save with DCP; load into HSDP 2x2 and into 1-D ZeRO-3 over the
    same four ranks, both built from a different init; the full parameters and AdamW state."""
    from tests.fsdp.test_checkpoint import _diff, _full, _load, _save, _steps

    mesh = _mesh()
    m = _shard(model, mesh, "optim")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(m, opt, batches)
    _save(m, opt, path)
    saved = _full(m, opt)
    diffs = []
    for target in ("hsdp", "fsdp"):
        if target == "hsdp":
            o = _shard(other, mesh, "no_shard")
        else:
            o = copy.deepcopy(other)
            for block in o.blocks:
                fsdp.fully_shard(block)
            fsdp.fully_shard(o)
        opt2 = torch.optim.AdamW(o.parameters(), lr=1e-2, weight_decay=0.1)
        _load(o, opt2, path)
        diffs.append(_diff(saved, _full(o, opt2)))
    # and into HFSDP of another init (the same shape)
    o = _shard(other, mesh, "optim")
    opt3 = torch.optim.AdamW(o.parameters(), lr=1e-2, weight_decay=0.1)
    _load(o, opt3, path)
    diffs.append(_diff(saved, _full(o, opt3)))
    return diffs, len(saved[0])


def test_hfsdp_checkpoint_loads_into_hsdp_and_fsdp_exactly(tmp_path) -> None:
    diffs, saved = run_ranks(
        _checkpoint_reshards, 4, make_model(), make_model(seed=3), make_batches(2), str(tmp_path / "c"), timeout=180
    )[0]
    assert saved == len(dict(make_model().named_parameters()))  # rank 0 gathered every parameter
    assert diffs == [[], [], []]  # parameters and AdamW state, bit for bit: HSDP, FSDP, HFSDP again


def _refusals(model) -> dict:
    """Each bad use raises ValueError on every rank before any collective (a collective with
    only some ranks would hang the threaded world, which the harness reports)."""
    mesh2 = _mesh()
    mesh1 = init_device_mesh("cpu", (4,))
    cases = {
        "one_d": dict(mesh=mesh1, outer_dp_sharding_strategy="optim"),
        "no_shard": dict(mesh=mesh2, sharding_strategy="no_shard", outer_dp_sharding_strategy="optim"),
        "unknown": dict(mesh=mesh2, outer_dp_sharding_strategy="full"),
        "chunked": dict(mesh=mesh2, outer_dp_sharding_strategy="optim", shard_placement_fn=lambda p: Shard(0)),
    }
    out = {}
    for name, kw in cases.items():
        m = copy.deepcopy(model)
        try:
            fsdp.fully_shard(m, **kw)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
        out[name + "_untouched"] = not isinstance(m, fsdp.FSDPModule)
    return out


def test_hfsdp_bad_arguments_raise_before_any_collective() -> None:
    results = run_ranks(_refusals, 4, make_model(), backend="threaded", timeout=60)
    assert all(r == results[0] for r in results)
    r = results[0]
    assert "2-D (replicate, shard) mesh" in r["one_d"]
    assert "'no_shard'" in r["no_shard"] and "shards the optimizer" in r["no_shard"]
    assert "unknown outer_dp_sharding_strategy 'full'" in r["unknown"]
    assert "shard_placement_fn" in r["chunked"]
    assert all(r[k + "_untouched"] for k in ("one_d", "no_shard", "unknown", "chunked"))


def _deferred_replica_reduction(model, batches) -> dict:
    """set_requires_all_reduce(False) on the first of two micro-batches: HFSDP keeps the shard-
    axis reduce-scatter's sums and reduce-scatters them over replicas with the second one."""
    from tests.fsdp.models import loss_fn

    mesh, rank = _mesh(), dist.get_rank()
    x, y = batches[0]
    x, y = x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]
    grads, out = {}, {}
    for outer in ("no_shard", "optim"):
        m = _shard(model, mesh, outer)
        for k in range(2):
            m.set_requires_all_reduce(k == 1)
            (loss_fn(m, x[k : k + 1], y[k : k + 1]) / 2).backward()
            if k == 0 and outer == "optim":
                group = m._fsdp_state.groups[0]
                out["held"] = group.grads._partial is not None and list(group.grads._partial.placements)[1].is_partial()
                out["no grad yet"] = all(p.grad is None for p in m.parameters())
        grads[outer] = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    out["diff"] = max_diff(grads["optim"], grads["no_shard"])
    return out


def test_hfsdp_deferred_replica_reduction_matches_hsdp() -> None:
    results = run_ranks(_deferred_replica_reduction, 4, make_model(), make_batches(1), backend="threaded", timeout=60)
    for r in results:
        assert r["held"] and r["no grad yet"] and r["diff"] <= 1e-6, r


def _features(model, batches) -> dict:
    """HFSDP with the rest of fsdp: a meta-device build + to_empty + init_weights (full plain
    parameters per unit, kept as this rank's rows), a full state dict import, clip_grad_norm_ and fsdp.FlatAdamW;
    compared with the same run on plain HSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import fsdp.checkpoint as ckpt
    from tests.fsdp.models import TinyLM

    mesh, rank = _mesh(), dist.get_rank()
    out = {}
    with torch.device("meta"):
        meta = TinyLM()
    m = _shard(meta, mesh, "optim")
    m.to_empty(device="cpu")
    # (threads share the RNG, so the init copies the eager model's values, module by module)
    names = {id(mod): name for name, mod in m.named_modules()}
    eager = dict(model.named_modules())

    def init(mod) -> None:
        for pname, p in mod.named_parameters(recurse=False):  # full plain tensors during init
            p.copy_(getattr(eager[names[id(mod)]], pname))

    fsdp.init_weights(m, init)
    out["init"] = max_diff(full_state(m), {n: p.detach() for n, p in model.named_parameters()})
    # a full state dict of other values, imported row by row
    other = {n: p.detach() + 1 for n, p in model.named_parameters()}
    ckpt.set_state_dict(m, model_state_dict=other, options=StateDictOptions(full_state_dict=True))
    out["import"] = max_diff(full_state(m), other)
    runs = {}
    for outer in ("no_shard", "optim"):
        k = _shard(model, mesh, outer)
        norms = train(k, batches, rank=rank, world=4, micro=2, clip=0.5,
                      make_opt=lambda ps: fsdp.FlatAdamW(ps, lr=1e-2, weight_decay=0.1))
        runs[outer] = (full_state(k), norms)
    out["flat+clip"] = max_diff(runs["optim"][0], runs["no_shard"][0])
    out["norms"] = (runs["optim"][1], runs["no_shard"][1])
    return out


def test_hfsdp_meta_init_full_import_clip_and_flat_optimizer() -> None:
    model, batches = make_model(), make_batches(2)
    results = run_ranks(_features, 4, model, batches, backend="threaded", timeout=120)
    r = results[0]
    assert r["init"] == 0.0 and r["import"] == 0.0, r
    assert r["flat+clip"] <= 1e-6, r["flat+clip"]
    hfsdp_norms, hsdp_norms = r["norms"]
    assert max(abs(a - b) for a, b in zip(hfsdp_norms, hsdp_norms)) <= 1e-6, r["norms"]


def _collective_groups() -> list:
    """(collective, ranks of its group) of one HFSDP training step: forward/backward, optimizer
    step, and the next forward's refresh."""
    from tests.fsdp.models import loss_fn

    m = _shard(make_model(), _mesh(), "optim")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x, y = make_batches(1)[0]
    with spy_collectives("all_gather", "reduce_scatter", "all_reduce") as seen:
        loss_fn(m, x[:2], y[:2]).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(m, x[:2], y[:2]).backward()  # its forward refreshes the model shard first
    return sorted(set(seen))


def test_hfsdp_gathers_weights_in_the_shard_group_only() -> None:
    results = run_ranks(_collective_groups, 4, backend="gloo")  # processes: the spy is global
    # rank 0's shard group is {0, 1}, its replica group {0, 2}: forward gathers on the shard
    # group, gradients reduce-scatter on both, the refresh all-gathers the optimizer piece
    # across replicas; nothing is all-reduced
    assert results[0] == [("all_gather", (0, 1)), ("all_gather", (0, 2)), ("reduce_scatter", (0, 1)),
                          ("reduce_scatter", (0, 2))], results[0]
