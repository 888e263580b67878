"""Files written before fsdp/ moved into subpackages still load: DCP checkpoints saved by
``fsdp.checkpoint.save`` and pickled sharded parameters (``RowShardedDTensor``), both made by the
code at 92f3820 (tests/data/make_legacy_checkpoints.py) after two AdamW steps on two ranks.
Loaded into today's fully_shard, in the layout they were saved from and in the other one, the
weights equal the ones saved bit for bit, and training continues from them. Their ``.checksums``
predates the format that also covers ``.metadata``, so ``fsdp.checkpoint.load`` refuses them
unless asked explicitly (``allow_unverified=True``: the data files are still verified)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import fsdp.checkpoint as ckpt
from dbuffer import RowShardedDTensor
from fsdp.group.layout_choice import layout_policy
from tests.fsdp.models import full_state, make_batches, make_model, train
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "legacy_92f3820")


def _load_legacy(saved: str, into: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    with layout_policy(into):
        m = shard(copy.deepcopy(make_model(seed=7)), True)  # other values than the saved ones
    opts: list = []
    make_opt = lambda ps: opts.append(torch.optim.AdamW(ps, lr=1e-2)) or opts[-1]  # noqa: E731
    opt = make_opt(list(m.parameters()))
    msd, osd = ckpt.get_state_dict(m, opt)
    path = os.path.join(DATA, saved)
    try:  # its .checksums predates the one that also covers .metadata: loading it is explicit
        ckpt.load({"model": msd, "optim": osd}, path)
    except ckpt.CheckpointError as e:
        refused = "allow_unverified=True" in str(e)
    else:
        refused = False
    ckpt.load({"model": msd, "optim": osd}, path, allow_unverified=True)  # its data files are still verified
    ckpt.set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
    want = torch.load(os.path.join(DATA, f"{saved}_full.pt"))
    have = full_state(m)
    out = {"same": all(torch.equal(have[k], want[k]) for k in want) and have.keys() == want.keys(), "refused": refused}
    steps = {k: int(s["step"]) for k, s in opt.state_dict()["state"].items()}
    out["steps"] = sorted(set(steps.values()))
    train(m, make_batches(1, seed=5), rank=rank, world=world, make_opt=lambda ps: opt)
    out["trained"] = any(not torch.equal(full_state(m)[k], want[k]) for k in want)
    return out


@pytest.mark.parametrize("saved,into", [("chunk", "chunk"), ("row", "row"), ("row", "chunk"), ("chunk", "row")])
def test_a_checkpoint_saved_before_the_restructuring_loads_bit_for_bit(saved, into) -> None:
    results = run_ranks(_load_legacy, 2, saved, into, backend="gloo")
    assert results[0] == results[1]
    assert results[0]["refused"]  # without the explicit argument: a CheckpointError naming it
    assert results[0]["same"] and results[0]["trained"]
    assert results[0]["steps"] == [2]  # the optimizer state came along (two steps taken)


def _unpickle(_: None):
    rank = dist.get_rank()
    try:
        params = torch.load(os.path.join(DATA, f"row_params_rank{rank}.pt"), weights_only=False)
    except AttributeError as exc:  # what an older torch says of the newer torch's DeviceMesh
        return str(exc)
    want = torch.load(os.path.join(DATA, "row_full.pt"))
    kinds = {type(p) for p in params.values()}
    full = {k: p.full_tensor() for k, p in params.items()}  # every rank, in the same order
    return RowShardedDTensor in kinds and all(torch.equal(full[k], want[k]) for k in want)


def _torch_reads_the_pickled_meshes() -> bool:
    """The pickles were written under torch 2.13, whose DeviceMesh pickles name its
    ``torch.distributed._mesh_layout._FlatLayout``; torch reads a DeviceMesh only where it has
    that class (2.13+): pickles of torch's objects do not load into an older torch."""
    from torch.distributed import _mesh_layout

    return hasattr(_mesh_layout, "_FlatLayout")


def test_pickled_row_sharded_parameters_unpickle_and_are_exact() -> None:
    results = run_ranks(_unpickle, 2, None, backend="gloo")
    if _torch_reads_the_pickled_meshes():
        assert results == [True, True]
    else:  # torch 2.11 / 2.12: torch's own unpickling of the mesh fails, before any of ours runs
        assert all("_FlatLayout" in r and "_mesh_layout" in r for r in results), results
