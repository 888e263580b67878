"""torch's own full-state-dict loaders on fsdp's flat layouts, as accelerate and Lightning call them.

Hugging Face accelerate and Lightning Fabric load a full checkpoint with
``torch.distributed.checkpoint.state_dict.set_model_state_dict`` / ``set_optimizer_state_dict``
and ``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``, which cut each full
tensor where ``torch.chunk`` would. fsdp's row-atomic, ragged and Owned layouts hold other rows
(or element runs cut mid-row), so before :mod:`dbuffer.full_load` this failed with "The size of
tensor a (16) must match the size of tensor b (8)". Each layout here, at world 2 and 4 (where
the tiny model's flat pieces differ from ``torch.chunk``'s on some rank), loads a checkpoint
written by single-process training (an independent reference), with and without
``broadcast_from_rank0``, model and optimizer, and must give the checkpoint's tensors bit for bit
on every rank, the same as torch FSDP2 loading the same dicts, keep the optimizer state in the
parameters' own pieces, export the same dicts again (``get_*_state_dict(full_state_dict=True,
cpu_offload=True)``) and then train as FSDP2 does from there (bit for bit at world 2). The
default layout (``torch.chunk`` pieces) runs the same checks at world 2.

Gloo, not threaded ranks: torch's broadcast path asks the process group for its device types,
which the threaded group does not have.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import fsdp
from dbuffer import Owned, full_load
from fsdp.group.layout_choice import layout_policy
from tests.fsdp.models import TinyLM, full_state, loss_fn, make_batches, make_model, max_diff, train
from tests.fsdp.test_checkpoint import _diff
from tests.harness import run_ranks

LAYOUTS = ("chunk", "row", "ragged", "owned")
MATRICES = ["gate.weight", "up.weight", "down.weight"]
EXPORT = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _ours(model, layout: str):
    m = copy.deepcopy(model)
    if layout == "row HSDP 2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        with layout_policy("row"):
            for block in m.blocks:
                fsdp.fully_shard(block, mesh=mesh)
            return fsdp.fully_shard(m, mesh=mesh)
    if layout == "owned":  # the blocks' matrices and the head whole on their owners, the rest row-atomic
        with layout_policy("row"):
            for block in m.blocks:
                fsdp.fully_shard(block, buckets=[fsdp.Bucket(MATRICES, placement=Owned())])
            return fsdp.fully_shard(m, buckets=[fsdp.Bucket("head.weight", placement=Owned())])
    with layout_policy(layout):
        for block in m.blocks:
            fsdp.fully_shard(block)
        return fsdp.fully_shard(m)


def _fsdp2(model, layout: str):
    from torch.distributed.fsdp import fully_shard

    m = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if "HSDP" in layout else None
    for block in m.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _checkpoint(other, batches):
    """A full checkpoint from single-process AdamW training: plain tensors, FQN-keyed optimizer
    state (what torch's full state dicts hold)."""
    m = copy.deepcopy(other)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    train(m, batches, make_opt=lambda params: opt)
    return m.state_dict(), get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))


def _shape_differs_from_chunk(m) -> bool:
    """Whether this rank's piece of some parameter has another shape than the one torch's
    loaders cut for it (DTensor's ``torch.chunk`` piece): where their copy failed."""
    return any(
        tuple(p.to_local().shape) != compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[0]
        for p in m.parameters()
    )


def _load(m, opt, msd, osd, broadcast: bool) -> None:
    """torch's loaders, as accelerate and Lightning call them (only rank 0 passes the dicts when
    broadcasting); copies, since torch's loaders change the dicts they are given."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    if broadcast and dist.get_rank() != 0:
        msd, osd = {}, {}
    set_model_state_dict(m, copy.deepcopy(msd), options=options)
    set_optimizer_state_dict(m, opt, copy.deepcopy(osd), options=options)


def _every_layout(model, other, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    msd, osd = _checkpoint(other, batches[:2])
    out = {}
    layouts = LAYOUTS if world == 2 else LAYOUTS[1:] + ("row HSDP 2x2",)  # the default layout once
    for layout in layouts:
        for broadcast in (True, False):
            m = _ours(model, layout)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
            ref = _fsdp2(model, layout)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
            kinds = {type(p).__name__ for p in m.parameters()}
            moved = _shape_differs_from_chunk(m)
            _load(m, opt, msd, osd, broadcast)
            _load(ref, ref_opt, msd, osd, broadcast)
            loaded = full_state(m)
            # the optimizer state keeps the parameters' pieces (no layout mixing in later steps)
            same_pieces = all(
                type(s) is type(p) and s.to_local().shape == p.to_local().shape
                for p in m.parameters()
                for k, s in opt.state[p].items()
                if k != "step"
            )
            # (compared now: torch's export returns the live 0-D "step" tensors themselves)
            exported = (get_model_state_dict(m, options=EXPORT), get_optimizer_state_dict(m, opt, options=EXPORT))
            export_diff = _diff(exported, (msd, osd)) if rank == 0 else exported == ({}, {})
            train(m, batches[2:], rank=rank, world=world, make_opt=lambda params: opt)
            train(ref, batches[2:], rank=rank, world=world, make_opt=lambda params: ref_opt)
            out[(layout, broadcast)] = {
                "kinds": kinds,
                "shape differs from torch.chunk's": moved,
                "loaded vs checkpoint": _diff(loaded, {k: v.float() for k, v in msd.items()}),
                "optimizer state in the parameters' pieces": same_pieces,
                "export vs checkpoint": export_diff,
                "next step vs FSDP2": max_diff(full_state(m), full_state(ref)),
            }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_torch_full_state_dict_loaders_on_every_layout(world) -> None:
    model, other, batches = make_model(), make_model(seed=7), make_batches(3)
    results = run_ranks(_every_layout, world, model, other, batches)
    assert full_load.INSTALLED  # this torch's loaders are the ones dbuffer wraps
    for rank, table in enumerate(results):
        for (layout, broadcast), r in table.items():
            key = (world, rank, layout, broadcast)
            print(key, r)
            assert r["loaded vs checkpoint"] == [], key
            assert r["optimizer state in the parameters' pieces"], key
            assert r["export vs checkpoint"] in ([], True), key
            # bit for bit at world 2; at 4, fsdp's gloo reduce-scatter adds the four ranks'
            # gradients in another order than FSDP2's (the default layout too)
            assert r["next step vs FSDP2"] <= (0.0 if world == 2 else 1e-6), key
    for (layout, _), r in results[0].items():
        want = {"chunk": set(), "row": {"RowShardedDTensor"}, "owned": {"RowShardedDTensor"}}
        want["ragged"] = {"ElementShardedDTensor", "RowShardedDTensor"}
        want["row HSDP 2x2"] = want["row"]
        assert r["kinds"] - {"DTensor"} == want[layout], (layout, r["kinds"])
        # the flat layouts really cut elsewhere than torch.chunk on some rank (the failure's cause)
        assert any(t[(layout, True)]["shape differs from torch.chunk's"] for t in results) == (layout != "chunk")


def _meta_init(full, kind: str, how: str) -> list[str]:
    """FSDP2's meta-device flow: fully_shard under ``torch.device("meta")``, then a full state
    dict loaded with torch's loader (it ``load_state_dict(assign=True)``s its own DTensors) or as
    accelerate's ``cpu_ram_efficient_loading`` does (``distribute_tensor`` with each parameter's
    placements, ``load_state_dict(assign=True)``); the first forward adopts them."""
    with torch.device("meta"):
        m = TinyLM()
    with layout_policy(kind):
        for block in m.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(m)
    if how == "accelerate":
        params = dict(m.named_parameters())
        sharded = {
            k: nn.Parameter(distribute_tensor(v, params[k].device_mesh, params[k].placements)) for k, v in full.items()
        }
        m.load_state_dict(sharded, assign=True)
    else:
        broadcast = how == "broadcast_from_rank0"
        set_model_state_dict(
            m,
            dict(full) if dist.get_rank() == 0 or not broadcast else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast),
        )
    x, y = make_batches(1)[0]
    loss_fn(m, x, y).backward()  # the first forward adopts the loaded DTensors
    return _diff(full_state(m), {k: v.float() for k, v in full.items()})


def test_meta_init_then_full_state_dict() -> None:
    full = make_model(seed=7).state_dict()
    for kind in ("row", "ragged"):
        for how in ("broadcast_from_rank0", "every rank", "accelerate"):
            assert run_ranks(_meta_init, 2, full, kind, how) == [[], []], (kind, how)


def _wrong_shape(full) -> str:
    m = _ours(make_model(), "row")
    bad = {**full, "embed.weight": torch.zeros(16, 4)}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(ValueError, match="'embed.weight'") as exc:
        set_model_state_dict(m, bad if dist.get_rank() == 0 else {}, options=options)
    return str(exc.value)


def test_a_wrong_shape_raises_the_same_error_on_every_rank() -> None:
    messages = run_ranks(_wrong_shape, 2, make_model(seed=7).state_dict())
    assert messages[0] == messages[1] and "(16, 4)" in messages[0] and "(16, 8)" in messages[0], messages


def test_uninstall_puts_torchs_loaders_back_and_install_wraps_them_again() -> None:
    import torch.distributed._state_dict_utils as utils
    import torch.distributed.checkpoint.state_dict as sd

    assert full_load.INSTALLED
    wrapped_tensors, wrapped_state_dict = utils._distribute_tensors, utils._distribute_state_dict
    try:
        assert full_load.uninstall() and not full_load.INSTALLED
        assert utils._distribute_tensors is wrapped_tensors.__wrapped__
        assert not getattr(utils._distribute_tensors, "_dbuffer_full_load", False)
        assert sd._distribute_state_dict is utils._distribute_state_dict is wrapped_state_dict.__wrapped__
        assert not full_load.uninstall()  # nothing left to unwrap
    finally:
        assert full_load.install()
    assert full_load.INSTALLED and getattr(utils._distribute_tensors, "_dbuffer_full_load", False)
    assert sd._distribute_state_dict is utils._distribute_state_dict
    assert getattr(utils._distribute_state_dict, "_dbuffer_full_load", False)
