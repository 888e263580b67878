"""CPU offload as a GPU runs it, on the CPU (``tests/models/device_standins.py``).

On a CUDA mesh two things differ from a CPU mesh, and both are driven here:

* ``DTensor.from_local`` moves a host tensor to the mesh's device: a parameter or gradient view
  built through it is a device *copy* of the host buffer (the optimizer then updates the copy,
  gathers read weights that never change, ``.grad`` is a snapshot of uninitialised memory).
  :func:`moving_from_local` makes it copy here too.
* ``pin_memory=True``: host buffers are pinned and every copy is non-blocking, done only when
  its event is waited for. :class:`DeferredTransfers` pins on the CPU and defers each copy until
  the host synchronizes it (a download's destination reads NaN until then).

Offloaded training under both equals the single-process model on the global batch and torch
FSDP2 with its ``CPUOffloadPolicy`` in the same run, for every strategy, both layouts, pinned and
pageable, fp32 and bf16 compute, micro-batches; and everything sits where FSDP2 puts it: each
sharded parameter is a view of the host ``main`` buffer (same storage), each ``.grad`` a view of
the host ``main_grad``, optimizer state on the host; pinned where asked. With
``persistent_param_shard=False`` the host model shard cast for each gather is freed only after
the non-blocking upload from it settled (the stand-in checks every upload's source at its
settle), and training equals the persistent run's and the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp
from dbuffer import DBuffer, ElementShardedDTensor, Owned, compute_ragged_layout
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks
from tests.models.device_standins import deferred_transfers, moving_from_local


def _storage(t: torch.Tensor) -> int:
    return getattr(t, "_local_tensor", t).untyped_storage()._cdata


CASES = [
    # (strategy, micro-batches, bf16 compute, torch.chunk layout)
    ("optim_grads_params", 1, False, False),
    ("optim_grads_params", 2, False, True),
    ("optim_grads_params", 1, True, False),
    ("optim_grads", 1, False, False),
    ("optim", 2, False, False),
    ("no_shard", 1, False, False),
]


def _offload_runs(model, batches, pin: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy, micro, bf16, chunk in CASES:
        kw = dict(sharding_strategy=strategy, offload_policy=fsdp.CPUOffloadPolicy(pin_memory=pin))
        if bf16:
            kw["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if chunk:
            kw["shard_placement_fn"] = lambda p: Shard(p.dim() - 1)
        m = shard(copy.deepcopy(model), True, **kw)
        groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule) for g in mod._fsdp_state.groups]
        seen = {}

        def where(model, groups=groups, seen=seen) -> None:  # after backward, before the step
            for g in groups:
                transfers = g.offload.transfers
                for p, grad_view in zip(g.sharded_params, g.grads.main_grad_views):
                    local = p._local_tensor
                    seen.setdefault("param_is_main", []).append(_storage(p) == _storage(g.main.local_buffer))
                    seen.setdefault("grad_is_main_grad", []).append(
                        p.grad is not None and _storage(p.grad) == _storage(g.grads.main_grad.local_buffer)
                    )
                    seen.setdefault("on_host", []).append(local.device.type == "cpu" and p.grad._local_tensor.device.type == "cpu")
                    seen.setdefault("pinned_as_asked", []).append(
                        transfers.is_pinned(local) == pin and transfers.is_pinned(p.grad._local_tensor) == pin
                    )

        opts = []
        train(m, batches, rank=rank, world=world, micro=micro, before_step=where,
              make_opt=lambda params: opts.append(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)) or opts[-1])
        state_on_host = all(
            t._local_tensor.device.type == "cpu" for s in opts[0].state.values() for t in s.values() if isinstance(t, DTensor)
        )
        out[(strategy, micro, bf16, chunk)] = (full_state(m), {k: all(v) for k, v in seen.items()}, state_on_host)
    m = copy.deepcopy(model)
    for block in m.blocks:
        torch_fully_shard(block, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    torch_fully_shard(m, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    train(m, batches, rank=rank, world=world)
    out["fsdp2"] = full_state(m)
    return out


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_offload_trains_right_where_from_local_would_copy(pin: bool) -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    with moving_from_local() as copies, deferred_transfers() as made:
        results = run_ranks(_offload_runs, 2, model, batches, pin, backend="threaded")
    r = results[0]
    fsdp2 = r.pop("fsdp2")
    print(f"from_local copies: {copies[0]}; FSDP2 max|d| vs reference {max_diff(fsdp2, ref):.3g}")
    for key, (state, seen, state_on_host) in r.items():
        to_ref, to_fsdp2 = max_diff(state, ref), max_diff(state, fsdp2)
        print(f"{key}: max|d| vs reference {to_ref:.3g}, vs FSDP2 {to_fsdp2:.3g}; {seen}")
        assert all(seen.values()) and seen.keys() == {"param_is_main", "grad_is_main_grad", "on_host", "pinned_as_asked"}, (key, seen)
        assert state_on_host, key
        if key[2]:  # bf16 compute: close to the fp32 reference, as test_offload holds it
            assert to_ref < 5e-2, (key, to_ref)
        else:
            assert to_ref <= 1e-5 and to_fsdp2 <= 1e-5, (key, to_ref, to_fsdp2)
    if pin:  # every copy was non-blocking and the host waited for each one
        assert sum(t.downloads for t in made) > 0 and sum(t.uploads for t in made) > 0
        assert sum(t.synchronized for t in made) == sum(t.downloads + t.uploads for t in made)


def _lean_shard_offload(model, batches) -> dict:
    """ZeRO-3 under pinned offload with a bf16 model shard cast on the host for each gather
    (``persistent_param_shard=False``) and freed after it, micro-batches (host accumulation
    settles too); then the same with the persistent shard, and without offload."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, persistent, offload in (("lean", False, True), ("persistent", True, True), ("no offload", False, False)):
        kw = dict(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, persistent_param_shard=persistent))
        if offload:
            kw["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=True)
        m = shard(copy.deepcopy(model), True, **kw)
        groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule) for g in mod._fsdp_state.groups]
        train(m, batches, rank=rank, world=world, micro=2)
        out[name] = full_state(m)
        if name == "lean":  # a model shard on the host, cast for each gather and freed after it
            out["lean groups"] = [(g.offload.on_host and g.offload.pin, g.weights.lean_model,
                                   g.weights.model.is_storage_released()) for g in groups]
    return out


def test_a_lean_host_model_shard_is_freed_only_after_its_upload_settled() -> None:
    """Freed at the end of its gather while the upload from it was in flight, the shard's
    pinned memory could be handed out and overwritten before the copy read it (the stand-in
    read freed memory: the process crashed); now each upload settles first."""
    model, batches = make_model(), make_batches(2)
    ref = reference(model, batches)
    with deferred_transfers() as made:
        results = run_ranks(_lean_shard_offload, 2, model, batches, backend="threaded")
    assert sum(t.uploads for t in made) > 0 and sum(t.freed_sources for t in made) == 0
    assert sum(t.synchronized for t in made) == sum(t.downloads + t.uploads for t in made)  # each one checked
    for r in results:
        assert r["lean groups"] and all(r["lean groups"]) and all(all(flags) for flags in r["lean groups"]), r["lean groups"]
        # the same bf16 casts of the same main weights, only later: the same training bit for bit
        assert max_diff(r["lean"], r["persistent"]) == 0.0 and max_diff(r["lean"], r["no offload"]) == 0.0
        assert max_diff(r["lean"], ref) < 5e-2  # bf16 compute: close to the fp32 reference, as above


def test_the_stand_in_catches_an_upload_source_freed_before_its_settle() -> None:
    """What the test above relies on: a host buffer freed while an upload from it is in flight
    fails at the settle (instead of the copy reading freed memory), and is counted."""
    from tests.models.device_standins import DeferredTransfers

    transfers = DeferredTransfers(torch.device("cpu"), pin_memory=True)
    src = transfers.host_tensor(8, torch.float32, zero=True)
    settled = transfers.copy(torch.empty(8), src)
    settled.synchronize()  # untouched: fine
    in_flight = transfers.copy(torch.empty(8), src)
    src.untyped_storage().resize_(0)  # what DBuffer.release_storage does
    with pytest.raises(AssertionError, match="freed a host buffer"):
        in_flight.synchronize()
    assert transfers.freed_sources == 1 and transfers.uploads == 2


def _copied_views() -> list[str]:
    """Every DTensor view of a DBuffer whose local tensor is not the buffer's own storage."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shapes = [(5, 3), (4,), (7, 2), (1, 9), (6, 4)]  # row pieces, chunk-like pieces, empty pieces
    copied = []
    for placements in ([Shard(0)], [Owned()], [Replicate()]):
        buf = DBuffer(mesh, placements, shapes, torch.float32)
        for k in range(len(shapes)):
            view = buf.get_dtensor(k)
            if _storage(view) != _storage(buf.local_buffer):
                copied.append(f"{placements} tensor {k} ({type(view).__name__})")
    ragged_shapes = [(3, 5), (3, 7)]  # the shard boundary (18) cuts a row of the second
    ragged = DBuffer(mesh, [Shard(0)], ragged_shapes, torch.float32, layout=compute_ragged_layout(ragged_shapes, 2))
    view = ragged.get_dtensor(1)
    assert isinstance(view, ElementShardedDTensor)
    if _storage(view) != _storage(ragged.local_buffer):
        copied.append("ragged tensor 1 (ElementShardedDTensor)")
    return copied


def test_dbuffer_dtensor_views_share_the_buffer_where_from_local_would_copy() -> None:
    with moving_from_local():
        results = run_ranks(_copied_views, 2, backend="threaded")
    assert results == [[], []], results


def test_pinned_memory_is_for_accelerators_only() -> None:
    from fsdp.compose.offload import DeviceTransfers, has_pinned_memory

    assert has_pinned_memory(torch.device("cuda", 0)) and has_pinned_memory(torch.device("xpu"))
    assert not has_pinned_memory(torch.device("cpu")) and not has_pinned_memory(torch.device("meta"))
    assert DeviceTransfers(torch.device("cuda", 0), True).pinned  # decided without touching the device
    assert not DeviceTransfers(torch.device("cuda", 0), False).pinned
    assert not DeviceTransfers(torch.device("cpu"), True).pinned


def test_device_choices_of_an_accelerator_mesh_without_one(monkeypatch) -> None:
    """The decisions a CUDA run takes, driven on the CPU: this rank's device of a CUDA mesh
    (the current device), and where the checkpoint's decision travels under NCCL."""
    from types import SimpleNamespace

    from dbuffer import mesh_device
    from fsdp.checkpoint.atomic import object_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert mesh_device(SimpleNamespace(device_type="cuda")) == torch.device("cuda", 3)
    assert mesh_device(SimpleNamespace(device_type="cpu")) == torch.device("cpu")
    assert mesh_device(SimpleNamespace(device_type="meta")) == torch.device("meta")
    assert object_device("nccl") == torch.device("cuda", 3)
    assert object_device("cpu:gloo,cuda:nccl") == torch.device("cpu") == object_device("gloo")
