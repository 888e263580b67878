"""torch 2.15's per-parameter choices on fsdp (any torch): ``param_dtype_override_fn`` (a compute
dtype per parameter) and ``shard_placement_fn`` returning ``ShardPlacementResult`` (a mesh per
parameter).

* Norm weights kept in FP32 under a BF16 policy: they form groups of their own, compute in FP32,
  and training equals torch FSDP2 with the same override where torch has it (2.15), else the
  same run expressed with explicit ``fsdp.Bucket`` policies (an independent path).
* Parameters placed on a 2-D (replicate 2, shard 2) mesh of their own inside a unit on a 1-D
  mesh of 4 ranks: their groups live on that mesh and training equals one process on the
  global batch, and torch FSDP2 where it accepts the same placement.
* Bad answers raise ``ValueError`` / ``TypeError`` naming the parameter, before any collective.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from torch.distributed.tensor import Shard

import fsdp
from tests.fsdp.models import DIM, HIDDEN, full_state, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks

WORLD = 4
TORCH_OVERRIDE = "param_dtype_override_fn" in getattr(torch_fsdp.MixedPrecisionPolicy, "__dataclass_fields__", {})


def _is_norm(p: torch.Tensor) -> bool:
    return p.dim() == 1 and p.shape[0] == DIM  # TinyLM's RMSNorm weights (its one bias has HIDDEN)


def _keep_norms(p):
    return p.dtype if _is_norm(p) else None


def _shard_all(m, make, **kw):
    for block in m.blocks:
        make(block, **kw)
    return make(m, **kw)


def _overridden(model, batches) -> dict:
    rank = dist.get_rank()
    out = {}
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=_keep_norms)
    m = _shard_all(copy.deepcopy(model), fsdp.fully_shard, mp_policy=policy)
    groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule) for g in mod._fsdp_state.groups]
    out["compute"] = sorted({(str(g.dtypes.model), all(_is_norm(i.param if i.param is not None else p) for i, p in zip(g.infos, g.sharded_params))) for g in groups})
    train(m, batches, rank=rank, world=WORLD)
    out["fsdp"] = full_state(m)
    if TORCH_OVERRIDE:
        t = _shard_all(copy.deepcopy(model), torch_fsdp.fully_shard,
                       mp_policy=torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=_keep_norms))
        train(t, batches, rank=rank, world=WORLD)
        out["control"] = full_state(t)
    else:  # the same policies as explicit buckets, on fsdp's older path
        names = [n for n, p in model.named_parameters() if _is_norm(p)]

        def buckets(prefix):
            mine = [n[len(prefix):] for n in names if n.startswith(prefix) and "." not in n[len(prefix):].split(".weight")[0]]
            return [fsdp.Bucket(mine, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.float32))] if mine else []

        b = copy.deepcopy(model)
        bf16 = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for k, block in enumerate(b.blocks):
            fsdp.fully_shard(block, mp_policy=bf16, buckets=buckets(f"blocks.{k}."))
        fsdp.fully_shard(b, mp_policy=bf16, buckets=buckets(""))
        train(b, batches, rank=rank, world=WORLD)
        out["control"] = full_state(b)
    return out


def test_param_dtype_override_keeps_norms_in_fp32() -> None:
    model, batches = make_model(), make_batches(3)
    r = run_ranks(_overridden, WORLD, model, batches, backend="threaded")[0]
    assert r["compute"] == [("torch.bfloat16", False), ("torch.float32", True)], r["compute"]
    assert max_diff(r["fsdp"], r["control"]) <= (1e-6 if TORCH_OVERRIDE else 0), max_diff(r["fsdp"], r["control"])


def _placed(model, batches, use_torch: bool) -> dict:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    info = HSDPMeshInfo(hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)

    def place(p):
        return fsdp.ShardPlacementResult(Shard(0), info) if tuple(p.shape) == (HIDDEN, DIM) else None  # gate, up

    make = torch_fsdp.fully_shard if use_torch else fsdp.fully_shard
    m = _shard_all(copy.deepcopy(model), make, mesh=mesh, shard_placement_fn=place)
    meshes = []
    if not use_torch:
        groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule) for g in mod._fsdp_state.groups]
        meshes = sorted({tuple(g.mesh.shape) for g in groups})
    train(m, batches, rank=rank, world=WORLD)
    return {"state": full_state(m), "meshes": meshes}


def test_shard_placement_result_puts_parameters_on_their_own_mesh() -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    r = run_ranks(_placed, WORLD, model, batches, False, backend="threaded")[0]
    assert r["meshes"] == [(2, 2), (4,)], r["meshes"]
    assert max_diff(r["state"], ref) <= 1e-5, max_diff(r["state"], ref)
    try:  # torch FSDP2 where it accepts the same placement (2.15)
        t = run_ranks(_placed, WORLD, model, batches, True, backend="threaded")[0]
    except Exception as e:  # older FSDP2: no per-parameter mesh
        print(f"torch {torch.__version__} FSDP2 refuses ShardPlacementResult: {type(e).__name__}")
    else:
        assert max_diff(r["state"], t["state"]) <= 1e-6, max_diff(r["state"], t["state"])


def _bad_answers() -> list[str]:
    raised = []
    cases = [
        (ValueError, "param_dtype_override_fn must return None, param_dtype",
         dict(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16))),
        (ValueError, "fsdp shards on a 1-D mesh", dict(shard_placement_fn=lambda p: fsdp.ShardPlacementResult(Shard(0), object()))),
        (TypeError, "return Shard", dict(shard_placement_fn=lambda p: fsdp.ShardPlacementResult("rows", FSDPMeshInfo(
            init_device_mesh("cpu", (WORLD,)), shard_mesh_dim=0)))),
    ]
    for error, match, kw in cases:
        with pytest.raises(error, match=match):
            fsdp.fully_shard(make_model(), **kw)
        raised.append(match)
    return raised


def test_bad_per_parameter_answers_raise_on_every_rank() -> None:
    with pytest.raises(TypeError, match="param_dtype_override_fn must be a callable"):
        fsdp.MixedPrecisionPolicy(param_dtype_override_fn="fp32")
    results = run_ranks(_bad_answers, WORLD, backend="threaded")
    assert all(len(r) == 3 for r in results), results
