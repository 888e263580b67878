"""Optimizer state on the host, weights and grads on the device: ``fsdp.OptimizerStateOffloadPolicy``.

Every run here goes through the CPU stand-ins of a GPU (``tests/models/device_standins.py``):
``moving_from_local`` (a view built through ``DTensor.from_local`` would be a copy) and
``deferred_transfers`` (pinned memory; a non-blocking copy lands only when the host
synchronizes it: a download's destination reads NaN until then, an upload checks its source was
not written meanwhile), so a copy read before its completion or a view that became a copy fails.

* Parity (threaded ranks): every strategy, fp32 and bf16 compute, bf16 main grads, the flat
  (ragged) layout, ``FlatAdamW`` and ``torch.optim.AdamW``, ``step="device"`` and ``"host"``,
  pinned and pageable: the weights and the optimizer state (read right after the last step)
  equal training without offload bit for bit, and (fp32) the single-process reference on the
  global batch within 1e-5.
* Where things live, checked before every step: the optimizer state in host memory (pinned when
  asked: the transfers' ``is_pinned``), the sharded parameters views of the group's ``main``
  and ``.grad`` views of its ``main_grad`` (the same storages, not host memory); a device step
  with ``FlatAdamW`` never uploads more than one chunk of one state at once; every non-blocking
  copy was waited for.
* HSDP (2 x 2) with micro-batches, bit for bit. A ``Bucket`` with its own offload policy; DCP save / load of offloaded ``torch.optim`` state
  and ``FlatAdamW``'s ``state_dict`` round trip continue bit for bit, the loaded state back in
  host memory at once.
* Bad arguments raise naming the argument and the fix, before any collective.
"""

from __future__ import annotations

import copy
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy

import fsdp
from fsdp import checkpoint as ckpt
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import STRATEGIES, shard
from tests.harness import run_ranks
from tests.models.device_standins import deferred_transfers, moving_from_local

CHUNK = 37  # FlatAdamW's chunk_numel here: several chunks per group, a chunk across parameters
BF16 = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
BF16_GRADS = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16)


def _storage(t: torch.Tensor) -> int:
    return getattr(t, "_local_tensor", t).untyped_storage()._cdata


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _groups(m) -> list:
    return [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule) for g in mod._fsdp_state.groups]


# ----------------------------------------------------------------------------- validation


def test_policy_and_bad_arguments_raise_before_any_collective() -> None:
    policy = fsdp.OptimizerStateOffloadPolicy()
    assert isinstance(policy, TorchOffloadPolicy) and not isinstance(policy, TorchCPUOffloadPolicy)
    assert (policy.pin_memory, policy.step) == (True, "device")
    with pytest.raises(ValueError, match=r"step=\.\.\.\) must be 'device' .* or 'host'.* got 'gpu'"):
        fsdp.OptimizerStateOffloadPolicy(step="gpu")
    with pytest.raises(TypeError, match=r"pin_memory=\.\.\.\) must be a bool"):
        fsdp.OptimizerStateOffloadPolicy(pin_memory="yes")
    changed = fsdp.OptimizerStateOffloadPolicy()
    changed.step = "cpu"  # changed after it was built: fully_shard checks again
    # No process group exists here: each error comes from validation, before anything else.
    with pytest.raises(ValueError, match=r"offload_policy=OptimizerStateOffloadPolicy\(step=\.\.\.\) must be"):
        fsdp.fully_shard(nn.Linear(2, 2), offload_policy=changed)
    with pytest.raises(ValueError, match=r"buckets\[0\]\.offload_policy=OptimizerStateOffloadPolicy"):
        fsdp.fully_shard(nn.Linear(2, 2), buckets=[fsdp.Bucket("weight", offload_policy=changed)])
    with pytest.raises(TypeError, match=r"buckets\[1\]\.offload_policy must be .*OptimizerStateOffloadPolicy"):
        fsdp.fully_shard(nn.Linear(2, 2), buckets=[fsdp.Bucket("weight"), fsdp.Bucket("bias", offload_policy="cpu")])
    with pytest.raises(TypeError, match="offload_policy must be .*OptimizerStateOffloadPolicy"):
        fsdp.fully_shard(nn.Linear(2, 2), offload_policy="optimizer")
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):  # the policy itself passes
        fsdp.fully_shard(nn.Linear(2, 2), offload_policy=policy)


# ----------------------------------------------------------------------------- parity, where things live

# (strategy, precision, layout) per optimizer and step; the fp32 ones are held to the reference.
CASES = [(s, "fp32", "chunk") for s in STRATEGIES] + [
    ("optim_grads_params", "bf16", "chunk"),
    ("optim_grads_params", "bf16_grads", "chunk"),
    ("optim_grads", "fp32", "ragged"),
]
POLICIES = {"fp32": fsdp.MixedPrecisionPolicy(), "bf16": BF16, "bf16_grads": BF16_GRADS}


def _build(model, strategy, precision, layout, offload, optimizer):
    layout_ctx = fsdp.layout_policy(layout) if layout != "chunk" else contextlib.nullcontext()
    with layout_ctx:
        m = shard(copy.deepcopy(model), True, sharding_strategy=strategy, mp_policy=POLICIES[precision],
                  offload_policy=offload)
    if optimizer == "flat":
        return m, fsdp.FlatAdamW(m, lr=1e-2, weight_decay=0.1, chunk_numel=CHUNK)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _state_values(opt) -> list[torch.Tensor]:
    """Every state tensor of the optimizer, as plain local tensors, in a fixed order."""
    out = []
    for p in (p for g in opt.param_groups for p in g["params"]):  # param order (not the state dict's)
        s = opt.state.get(p, {})
        for name in sorted(s):
            v = s[name]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out.append(getattr(v, "_local_tensor", v).detach().clone())
    return out


def _recording(opt, into: list):
    """``opt`` whose every step appends the state it leaves, read as soon as ``step()`` returns."""
    step = opt.step

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        into.append(_state_values(opt))
        return out

    opt.step = recorded
    return opt


def _same_states(a: list, b: list) -> bool:
    return len(a) == len(b) > 0 and all(len(x) == len(y) > 0 and all(map(torch.equal, x, y)) for x, y in zip(a, b))


def _where(m, opt, optimizer: str, pin: bool, seen: dict) -> None:
    """Before a step: the state on the host (pinned as asked), weights and grads on the device,
    the parameters and grads views of main / main_grad."""
    for g in _groups(m):
        home = g.offload.optim_state
        main = g.main.local_buffer
        seen.setdefault("weights_not_host", []).append(not home.is_pinned(main) and g.compute_device == g.main.device)
        for p in g.sharded_params:
            seen.setdefault("param_is_main", []).append(_storage(p) == _storage(main))
            grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            if grad is not None:
                same = _storage(grad) == _storage(g.grads.main_grad.local_buffer) or grad.dtype != g.dtypes.main_grad
                seen.setdefault("grad_is_main_grad", []).append(same and not home.is_pinned(grad._local_tensor))
            if optimizer == "torch":
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        local = v._local_tensor
                        seen.setdefault("state_on_host", []).append(local.device.type == "cpu" and _storage(v) != _storage(main))
                        seen.setdefault("state_pinned_as_asked", []).append(home.is_pinned(local) == pin)
        if optimizer == "flat" and main in opt.state:
            for name, v in opt.state[main].items():
                if isinstance(v, torch.Tensor):
                    seen.setdefault("state_on_host", []).append(v.device.type == "cpu" and _storage(v) != _storage(main))
                    seen.setdefault("state_pinned_as_asked", []).append(home.is_pinned(v) == pin)


def _parity(model, batches, pin: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy, precision, layout in CASES:
        for optimizer in ("flat", "torch"):
            base, base_opt = _build(model, strategy, precision, layout, TorchOffloadPolicy(), optimizer)
            base_states: list = []
            train(base, batches, rank=rank, world=world, make_opt=lambda params: _recording(base_opt, base_states))
            for step in ("device", "host"):
                policy = fsdp.OptimizerStateOffloadPolicy(pin_memory=pin, step=step)
                m, opt = _build(model, strategy, precision, layout, policy, optimizer)
                seen: dict = {}
                states: list = []
                train(m, batches, rank=rank, world=world, make_opt=lambda params: _recording(opt, states),
                      before_step=lambda mod: _where(mod, opt, optimizer, pin, seen))
                transfers = [g.offload.optim_state.transfers for g in _groups(m)]
                largest_state = max(g.main.local_buffer.numel() for g in _groups(m))
                out[(strategy, precision, layout, optimizer, step)] = {
                    "state": full_state(m),
                    "same_weights": _bitwise(full_state(m), full_state(base)),
                    "same_state": _same_states(states, base_states),  # after every step
                    "seen": {k: all(v) for k, v in seen.items()},
                    "largest_upload": max(t.largest_upload for t in transfers),
                    "largest_state": largest_state,
                    "copies": sum(t.uploads + t.downloads for t in transfers),
                    "synchronized": sum(t.synchronized for t in transfers),
                }
    return out


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_state_offload_equals_no_offload_bitwise_and_lives_on_the_host(pin: bool) -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    with moving_from_local(), deferred_transfers():
        results = run_ranks(_parity, 2, model, batches, pin, backend="threaded", timeout=300)
    expected_seen = {"weights_not_host", "param_is_main", "grad_is_main_grad", "state_on_host", "state_pinned_as_asked"}
    for key, r in results[0].items():
        strategy, precision, layout, optimizer, step = key
        diff = max_diff(r["state"], ref)
        print(f"{key}: bitwise weights {r['same_weights']}, state {r['same_state']}; max|d| vs reference "
              f"{diff:.3g}; largest upload {r['largest_upload']} of {r['largest_state']}; {r['seen']}")
        assert r["same_weights"] and r["same_state"], key
        assert r["seen"].keys() == expected_seen and all(r["seen"].values()), (key, r["seen"])
        if precision == "fp32":
            assert diff <= 1e-5, (key, diff)
        if pin:  # every copy was non-blocking, and the host waited for each
            assert r["copies"] > 0 and r["synchronized"] == r["copies"], (key, r["copies"], r["synchronized"])
            if optimizer == "flat" and step == "device":  # streamed: one chunk of one state per upload
                assert r["largest_upload"] <= CHUNK < r["largest_state"], key
            if step == "host":  # the state never goes to the device
                assert r["largest_upload"] <= (CHUNK if optimizer == "flat" else r["largest_state"]), key
        else:
            assert r["copies"] == 0, key  # pageable: synchronous copies, nothing deferred


def _hsdp(model, batches) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for optimizer in ("flat", "torch"):
        states = {}
        for step in (None, "device", "host"):
            policy = TorchOffloadPolicy() if step is None else fsdp.OptimizerStateOffloadPolicy(step=step)
            m = shard(copy.deepcopy(model), True, mesh=mesh, offload_policy=policy)
            make = (lambda params, m=m: fsdp.FlatAdamW(m, lr=1e-2, chunk_numel=CHUNK)) if optimizer == "flat" else None
            train(m, batches, rank=rank, world=world, micro=2, make_opt=make)
            states[step] = full_state(m)
        out[optimizer] = (_bitwise(states["device"], states[None]), _bitwise(states["host"], states[None]))
    return out


def test_hsdp_2x2_state_offload_equals_no_offload() -> None:
    with moving_from_local(), deferred_transfers():
        results = run_ranks(_hsdp, 4, make_model(), make_batches(2), backend="threaded", timeout=180)
    assert results == [{"flat": (True, True), "torch": (True, True)}] * 4, results


class _OwnAdamW(torch.optim.AdamW):
    """A subclass: fsdp cannot know its step treats each parameter alone, so it gets the whole step."""


def _device_state_at_once(model, batches) -> dict:
    """``step="device"`` with torch.optim: the most offloaded state buffers on the device at once
    (counted as the groups make them), and the weights against no offload."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = shard(copy.deepcopy(model), True)
    train(base, batches, rank=rank, world=world)
    out = {}
    for cls in (torch.optim.AdamW, _OwnAdamW):
        m = shard(copy.deepcopy(model), True, offload_policy=fsdp.OptimizerStateOffloadPolicy(step="device"))
        made: list = []
        peak = [0]
        for g in _groups(m):
            def sibling(*args, _make=g.sibling, **kwargs):
                buf = _make(*args, **kwargs)
                made.append(buf)
                peak[0] = max(peak[0], sum(not b.is_storage_released() for b in made if b.dtype == torch.float32))
                return buf
            g.sibling = sibling
        opt = cls(m.parameters(), lr=1e-2, weight_decay=0.1)

        def counted(model, made=made):
            made.clear()  # count within the step only (grad_in and reduction temporaries are gone by now)

        train(m, batches, rank=rank, world=world, make_opt=lambda params: opt, before_step=counted)
        out[cls.__name__] = (peak[0], _bitwise(full_state(m), full_state(base)), len(_groups(m)))
    return out


def test_torch_optim_device_step_holds_one_groups_state_at_once() -> None:
    """torch's own AdamW is stepped one fsdp group at a time: its two states of one group on the
    device at once; an unknown subclass gets the whole step (all groups' states at once). Both
    train exactly as without offload."""
    with moving_from_local(), deferred_transfers():
        results = run_ranks(_device_state_at_once, 2, make_model(), make_batches(3), backend="threaded")
    (alone, same_alone, groups), (whole, same_whole, _) = results[0]["AdamW"], results[0]["_OwnAdamW"]
    assert same_alone and same_whole, results[0]
    assert groups >= 3 and alone == 2 and whole == 2 * groups, results[0]


# ----------------------------------------------------------------------------- buckets, errors


def _bucket(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    base = shard(copy.deepcopy(model), True)
    train(base, batches, rank=rank, world=world)
    for name, policy in (("state_host", fsdp.OptimizerStateOffloadPolicy(step="host")),
                         ("everything", fsdp.CPUOffloadPolicy(pin_memory=True))):
        m = copy.deepcopy(model)
        for block in m.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(m, buckets=[fsdp.Bucket("embed.*", offload_policy=policy)])
        opts = []
        train(m, batches, rank=rank, world=world, make_opt=lambda params: opts.append(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)) or opts[-1])
        embed = m.embed.weight
        state = opts[0].state[embed]["exp_avg"]._local_tensor
        group = embed._fsdp_group()
        transfers = getattr(group.offload, "transfers", None) or group.offload.optim_state.transfers
        others = [g for g in _groups(m) if g is not group]
        main_on_host = transfers.is_pinned(group.main.local_buffer)
        out[name] = (
            _bitwise(full_state(m), full_state(base)),
            # the bucket's state in the host memory its part allocated; with CPUOffloadPolicy the
            # main weights there too (the state, torch's zeros_like of them, on the host beside)
            transfers.is_pinned(state) and not main_on_host if name == "state_host" else main_on_host and state.device.type == "cpu",
            all(g.offload.optim_state is None and not g.offload.on_host for g in others),
        )
    return out


def test_a_bucket_offloads_its_own_parameters_only() -> None:
    model, batches = make_model(), make_batches(2)
    with moving_from_local(), deferred_transfers():
        results = run_ranks(_bucket, 2, model, batches, backend="threaded")
    assert results[0] == {"state_host": (True, True, True), "everything": (True, True, True)}, results[0]


def _host_step_refusals(model) -> list[str]:
    m = shard(copy.deepcopy(model), True, offload_policy=fsdp.OptimizerStateOffloadPolicy(step="host"))
    caught = []
    for opt, kwargs in ((torch.optim.AdamW(m.parameters()), {"closure": lambda: 0.0}),
                        (torch.optim.AdamW(m.parameters(), capturable=True), {})):
        try:
            opt.step(**kwargs)
        except RuntimeError as e:
            caught.append(str(e))
    try:  # refused when built (torch's own check would fail at the first step, with an assertion)
        fsdp.FlatAdamW(m, capturable=True)
    except ValueError as e:
        caught.append(str(e))
    # and before it changed the groups: param.grad still gets its cast copy for torch.optim
    caught.append(all(g.grads.cast_grads for g in _groups(m)))
    return caught


def test_host_step_refuses_a_closure_and_capturable() -> None:
    for caught in run_ranks(_host_step_refusals, 2, make_model(), backend="threaded"):
        *caught, groups_unchanged = caught
        assert len(caught) == 3 and "closure" in caught[0] and "capturable=True" in caught[1], caught
        assert "FlatOptimizer: param_groups[0] has capturable=True" in caught[2], caught
        assert all("step='device'" in c for c in caught)
        assert groups_unchanged is True


# ----------------------------------------------------------------------------- checkpoints


def _homes(opt, m) -> bool:
    """Every state tensor of ``opt`` lives in its group's host memory."""
    flat = isinstance(opt, fsdp.FlatOptimizer)
    for g in _groups(m):
        home = g.offload.optim_state
        if flat:
            values = [v for v in opt.state.get(g.main.local_buffer, {}).values() if isinstance(v, torch.Tensor)]
        else:
            values = [v._local_tensor for p in g.sharded_params for v in opt.state.get(p, {}).values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not values or not all(home.is_pinned(v) for v in values):
            return False
    return True


def _cloned(state_dict: dict) -> dict:
    """A torch.optim state dict with every tensor cloned. (Not ``copy.deepcopy``: torch's
    ``Tensor.__deepcopy__`` fails on a DTensor whose local tensor is a view at a nonzero storage
    offset, which host-buffer views are, as ``param.grad`` views of ``main_grad`` are.)"""
    state = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()} for k, s in state_dict["state"].items()}
    return {"state": state, "param_groups": copy.deepcopy(state_dict["param_groups"])}


def _checkpoint(model, batches, path: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    with moving_from_local(), deferred_transfers():
        for step in ("device", "host"):
            policy = fsdp.OptimizerStateOffloadPolicy(step=step)

            def build(offload=policy, flat=False):
                m = shard(copy.deepcopy(model), True, offload_policy=offload)
                opt = fsdp.FlatAdamW(m, lr=1e-2, chunk_numel=CHUNK) if flat else torch.optim.AdamW(m.parameters(), lr=1e-2)
                return m, opt

            def steps(m, opt, part):
                train(m, part, rank=rank, world=world, make_opt=lambda params: opt)

            for flat in (False, True):
                whole, whole_opt = build(flat=flat)
                steps(whole, whole_opt, batches)
                first, first_opt = build(flat=flat)
                steps(first, first_opt, batches[:2])
                targets = [("offload", policy)] + ([] if flat else [("plain", TorchOffloadPolicy())])
                if flat:  # this rank's flat shard, same world and layout
                    saved = copy.deepcopy(first_opt.state_dict())
                    first_model = {k: v.detach().clone() for k, v in first.state_dict().items()}
                else:
                    msd, osd = ckpt.get_state_dict(first, first_opt)
                    ckpt.save({"model": msd, "optim": osd}, f"{path}_{step}")
                for name, offload in targets:
                    m, opt = build(offload, flat)
                    steps(m, opt, batches[:1])  # state to overwrite
                    if flat:
                        m.load_state_dict(first_model)
                        opt.load_state_dict(copy.deepcopy(saved))  # other tensors: copied into the host memory
                    else:
                        msd, osd = ckpt.get_state_dict(m, opt)
                        state = {"model": msd, "optim": osd}
                        ckpt.load(state, f"{path}_{step}")
                        ckpt.set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                        if name == "offload":  # a load of other tensors (on a GPU: torch moves them to the device)
                            opt.load_state_dict(_cloned(opt.state_dict()))
                    homes = _homes(opt, m) if name == "offload" else None
                    steps(m, opt, batches[2:])
                    out[(step, "flat" if flat else "torch", name)] = (_bitwise(full_state(m), full_state(whole)), homes)
    return out


def test_checkpoint_of_offloaded_state_continues_bit_for_bit(tmp_path) -> None:
    results = run_ranks(_checkpoint, 2, make_model(), make_batches(4), str(tmp_path / "ck"), backend="gloo")
    assert results[0] == results[1]
    for key, (same, homes) in results[0].items():
        assert same, key
        assert homes is (True if key[2] == "offload" else None), key
    assert len(results[0]) == 6
