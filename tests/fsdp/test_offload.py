"""CPU offload (``offload_policy=CPUOffloadPolicy(...)``), world 2.

* Parity (threaded ranks): every strategy, 1 and 2 micro-batches, fp32 and bf16 compute,
  ``shard_placement_fn`` groups: offloaded training equals training without offload bit for bit,
  and (fp32) the single-process reference on the global batch within 1e-5, as torch FSDP2 with
  its CPUOffloadPolicy does in the same run. Also bit for bit: HSDP (2 x 2) and micro-batches
  without gradient sync until the last, with and without resharding after backward.
* Where things live (gloo ranks, as below): sharded parameters are views of the host ``main``
  buffer, ``.grad`` views of the host ``main_grad``, optimizer state follows them; the unsharded
  weights, the upload target and ``grad_in`` are other storages; every gather uploads the shard
  and every reduction downloads its result (counted); ``pin_memory=True`` on a CPU mesh works
  unpinned.
* Checkpoints: a DCP save of an offloaded model loads into offloaded and non-offloaded models
  and training continues bit for bit; a full state dict loads by broadcast from rank 0;
  meta-device init with offload equals the eager build.
* Bad arguments raise ``TypeError`` before any collective.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import Shard

import fsdp
from fsdp import checkpoint as ckpt
from tests.fsdp.models import RMSNorm, TinyLM, full_state, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import STRATEGIES, shard
from tests.harness import run_ranks

OFFLOAD = fsdp.CPUOffloadPolicy(pin_memory=False)


def _storage(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)
    return local.untyped_storage().data_ptr()


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(-1).view(torch.int32), b[k].view(-1).view(torch.int32)) for k in a)


# ----------------------------------------------------------------------------- validation


def test_policy_classes_are_torchs_and_bad_values_raise_before_any_collective() -> None:
    assert fsdp.CPUOffloadPolicy is TorchCPUOffloadPolicy and fsdp.OffloadPolicy is TorchOffloadPolicy
    # No process group exists here: each error comes from validation, before anything else.
    with pytest.raises(TypeError, match="offload_policy must be"):
        fsdp.fully_shard(nn.Linear(2, 2), offload_policy="cpu")
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        fsdp.fully_shard(nn.Linear(2, 2), offload_policy=fsdp.CPUOffloadPolicy(pin_memory="yes"))
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):  # the policies themselves pass
        fsdp.fully_shard(nn.Linear(2, 2), offload_policy=fsdp.OffloadPolicy())


# ----------------------------------------------------------------------------- parity


def _parity(model, batches, ref) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    cases = [(s, 1, None, None) for s in STRATEGIES] + [(s, 2, None, None) for s in ("no_shard", "optim_grads_params")]
    cases.append(("optim_grads_params", 2, fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16), None))
    cases.append(("optim_grads_params", 1, None, lambda p: Shard(p.dim() - 1)))  # torch.chunk pieces
    for strategy, micro, policy, placement in cases:
        kw = dict(sharding_strategy=strategy, shard_placement_fn=placement)
        if policy is not None:
            kw["mp_policy"] = policy
        states = []
        for offload in (OFFLOAD, fsdp.OffloadPolicy()):
            m = shard(copy.deepcopy(model), True, offload_policy=offload, **kw)
            train(m, batches, rank=rank, world=world, micro=micro)
            states.append(full_state(m))
        key = (strategy, micro, "bf16" if policy else "fp32", "chunk" if placement else "rows")
        out[key] = (_bitwise(*states), max_diff(states[0], ref))
    m = copy.deepcopy(model)
    for block in m.blocks:
        torch_fully_shard(block, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    torch_fully_shard(m, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    train(m, batches, rank=rank, world=world)
    out["fsdp2"] = (None, max_diff(full_state(m), ref))
    return out


def test_offload_equals_no_offload_bitwise_and_the_single_process_reference() -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    results = run_ranks(_parity, 2, model, batches, ref, backend="threaded")
    assert results[0] == results[1]
    for key, (same, diff) in results[0].items():
        print(f"{key}: bitwise equal to no offload: {same}, max|d| vs reference {diff:.3g}")
        if key != "fsdp2":
            assert same, key
        if "bf16" not in key:  # bf16 compute is held to no offload's (test_parity: to FSDP2's)
            assert diff <= 1e-5, (key, diff)


# ----------------------------------------------------------------------------- where things live


class _Counter:
    """Counts calls of one method of one object (an instance attribute: nothing global patched)."""

    def __init__(self, obj, name: str) -> None:
        self.calls = 0
        method = getattr(obj, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        setattr(obj, name, counted)


def _placement(model) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True, offload_policy=fsdp.CPUOffloadPolicy(), mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    units = [mod._fsdp_state for mod in m.modules() if isinstance(mod, fsdp.FSDPModule)]
    groups = [g for u in units for g in u.groups]
    uploads = [_Counter(g.offload, "upload") for g in groups]
    downloads = [_Counter(g.offload, "download") for g in groups]
    seen_unsharded: list[tuple[int, int]] = []  # (unsharded param storage, main storage) in forward

    def look(module, args):
        group = module._fsdp_state.groups[0]
        p = group.unsharded_params[0]
        seen_unsharded.append((p.untyped_storage().data_ptr(), group.main.local_buffer.untyped_storage().data_ptr()))
        assert group.offload._staging is not None and group.offload._staging.is_storage_released()  # freed after the gather

    for block in m.blocks:
        block.register_forward_pre_hook(look)  # runs after the unit's own pre-hook (the gather)
    checks = {}

    def before_step(model) -> None:
        for g in groups:
            main_grad = g.grads.main_grad.local_buffer.untyped_storage().data_ptr()
            for p in g.sharded_params:
                assert p.grad is not None and _storage(p.grad) == main_grad
            checks["grad_not_grad_in"] = g.grads.grad_in.is_storage_released() or _storage(g.grads.grad_in.local_buffer) != main_grad

    opt_holder = {}

    def make_opt(params):
        opt_holder["opt"] = torch.optim.AdamW(params, lr=1e-2)
        return opt_holder["opt"]

    batches = make_batches(2)
    train(m, batches, rank=rank, world=world, before_step=before_step, make_opt=make_opt)
    host = torch.device("cpu")
    for g in groups:
        main = g.main.local_buffer.untyped_storage().data_ptr()
        assert g.main.device == host and g.grads.main_grad.device == host and g.compute_device == host
        assert g.offload.pin is False and not g.main.local_buffer.is_pinned()  # pin_memory on a CPU mesh
        assert g.weights.model is not g.main and g.weights.model.device == host  # bf16 copy cast on the host
        for p in g.sharded_params:
            assert _storage(p) == main  # the parameters are views of the host main buffer
            state = opt_holder["opt"].state[p]
            for name in ("exp_avg", "exp_avg_sq"):
                t = state[name]._local_tensor
                assert t.device == host and t.shape == p._local_tensor.shape
        assert g.weights.unsharded.local_buffer.untyped_storage().nbytes() == 0  # ZeRO-3: freed after use
        assert g.offload._staging is not g.weights.model and g.offload._staging.is_storage_released()
    assert seen_unsharded and all(u != mn for u, mn in seen_unsharded)
    return {
        "uploads": [c.calls for c in uploads],
        "downloads": [c.calls for c in downloads],
        "checks": checks,
        "groups": len(groups),
    }


def test_state_lives_in_host_buffers_and_every_gather_uploads() -> None:
    results = run_ranks(_placement, 2, make_model(), backend="gloo")
    r = results[0]
    assert r["checks"]["grad_not_grad_in"]
    # 2 steps: the root gathers once per step (no reshard after forward), each block twice
    # (forward, backward); every group reduces once per step.
    assert r["uploads"] == [2] + [4] * (r["groups"] - 1), r["uploads"]
    assert r["downloads"] == [2] * r["groups"], r["downloads"]


# ----------------------------------------------------------------------------- checkpoints, meta init


def _checkpoint(model, batches, path: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()

    def build(offload, strategy="optim_grads_params"):
        m = shard(copy.deepcopy(model), True, sharding_strategy=strategy, offload_policy=offload)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    def steps(m, opt, part):
        train(m, part, rank=rank, world=world, make_opt=lambda params: opt)

    whole, whole_opt = build(OFFLOAD)
    steps(whole, whole_opt, batches)
    first, first_opt = build(OFFLOAD)
    steps(first, first_opt, batches[:2])
    msd, osd = ckpt.get_state_dict(first, first_opt)
    ckpt.save({"model": msd, "optim": osd}, path)
    out = {}
    for name, offload, strategy in (("offload", OFFLOAD, "optim_grads_params"), ("plain", fsdp.OffloadPolicy(), "optim")):
        m, opt = build(offload, strategy)
        steps(m, opt, batches[:1])  # state to overwrite
        main_before = [_storage(p) for p in m.parameters()]
        msd, osd = ckpt.get_state_dict(m, opt)
        state = {"model": msd, "optim": osd}
        ckpt.load(state, path)
        ckpt.set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert [_storage(p) for p in m.parameters()] == main_before  # loaded in place, on the host
        steps(m, opt, batches[2:])
        out[name] = _bitwise(full_state(m), full_state(whole))
    # full state dict: exported on rank 0, loaded by broadcast from rank 0 into an offloaded model
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, _ = ckpt.get_state_dict(whole, whole_opt, options=full)
    fresh, fresh_opt = build(OFFLOAD)
    ckpt.set_state_dict(fresh, fresh_opt, model_state_dict=msd,
                        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
    out["full"] = _bitwise(full_state(fresh), full_state(whole))
    return out


def test_dcp_save_load_with_offload_continues_bit_for_bit(tmp_path) -> None:
    results = run_ranks(_checkpoint, 2, make_model(), make_batches(4), str(tmp_path / "ck"), backend="gloo")
    assert results[0] == results[1] == {"offload": True, "plain": True, "full": True}, results


def _init(m: nn.Module) -> None:
    if isinstance(m, RMSNorm):
        nn.init.ones_(m.weight)
    elif isinstance(m, (nn.Linear, nn.Embedding)):
        m.reset_parameters()


def _meta(eager_state) -> bool:
    torch.manual_seed(0)
    with torch.device("meta"):
        m = TinyLM()
    shard(m, True, offload_policy=OFFLOAD)
    m.to_empty(device="cpu")  # as with FSDP2's CPU offload: materialise on the host
    fsdp.init_weights(m, _init)
    assert all(p._local_tensor.device.type == "cpu" for p in m.parameters())
    m.to("cpu")  # the host: accepted, nothing moves
    with pytest.raises(ValueError, match="CPUOffloadPolicy keeps them on the host"):
        m.to("meta")
    return _bitwise(full_state(m), eager_state)


def test_meta_init_with_offload_equals_the_eager_build() -> None:
    assert run_ranks(_meta, 2, full_state(make_model()), backend="gloo") == [True, True]


def _hsdp(model, batches) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    states = []
    for offload in (OFFLOAD, fsdp.OffloadPolicy()):
        m = shard(copy.deepcopy(model), True, mesh=mesh, offload_policy=offload)
        train(m, batches, rank=rank, world=world, micro=2)
        states.append(full_state(m))
    return _bitwise(*states)


def test_hsdp_2x2_offload_equals_no_offload() -> None:
    results = run_ranks(_hsdp, 4, make_model(), make_batches(2), backend="threaded", timeout=120)
    assert results == [True] * 4


def _no_sync(model, batches, ref) -> tuple:
    """Micro-batches without gradient sync until the last (``set_requires_gradient_sync``), with
    and without resharding after backward: grads accumulate on the device, one download each."""
    from tests.fsdp.models import loss_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    states, micro = [], 4  # equal micro-batches: the mean over them is the global mean
    for offload, reshard_after_backward in ((OFFLOAD, True), (OFFLOAD, False), (fsdp.OffloadPolicy(), True)):
        m = shard(copy.deepcopy(model), True, offload_policy=offload)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        for x, y in batches:
            per = x.shape[0] // world
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                last = i == micro - 1
                m.set_requires_gradient_sync(last)
                m.set_reshard_after_backward(last or reshard_after_backward)
                (loss_fn(m, xm, ym) / micro).backward()
            opt.step()
            opt.zero_grad()
        states.append(full_state(m))
    return _bitwise(states[0], states[2]), _bitwise(states[1], states[2]), max_diff(states[0], ref)


def test_gradient_accumulation_without_sync_equals_no_offload() -> None:
    model, batches = make_model(), make_batches(2)
    ref = reference(model, batches, micro=4)
    results = run_ranks(_no_sync, 2, model, batches, ref, backend="threaded")
    for same, same_kept, diff in results:
        assert same and same_kept and diff <= 1e-5, results
