"""Distributed Muon through ``fully_shard``: the 2-D weights in an ``Owned()`` bucket (each matrix
whole on one rank, owners balanced), everything else packed ``Shard(0)``; the result equals
single-device Muon on the same global batch, bit for bit, in fp32.

Why bit for bit is possible: each rank's forward/backward on its slice computes exactly what a
single device computes for that slice as a micro-batch. The reference accumulates the slices'
gradients in rank order with each loss scaled by 1/world (a power of two, so the scaling is
exact): ``((g0 + g1) + g2 + g3) / world``. fsdp reduces the same sum in the same order (gloo's
all-to-all path below 2 MiB and torch's threaded group both add chunks in rank order) and
divides once. Newton-Schulz then runs on the whole matrix on its owner, as on the single device.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp
from dbuffer import Owned
from fsdp.optim.muon import Muon
from tests.fsdp.models import full_state, loss_fn, make_batches, make_model
from tests.harness import run_ranks

STEPS = 4
MATRICES = ["gate.weight", "up.weight", "down.weight"]  # names are relative to the sharded module


def _muon(model) -> Muon:
    """Muon for the blocks' and the head's matrices; AdamW for the rest (the embedding too, as
    usual for Muon: its rows are looked up, not multiplied)."""
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not n.startswith("embed")], "use_muon": None},  # 2-D: Muon
        {"params": [p for n, p in named if n.startswith("embed")], "use_muon": False},
    ]
    return Muon(groups, lr=0.02, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01)


def _single_device(model, batches, world: int) -> list[dict]:
    """Muon on one device; each global batch as ``world`` micro-batches, in rank order."""
    m = copy.deepcopy(model)
    opt = _muon(m)
    states = []
    for x, y in batches:
        for xm, ym in zip(x.chunk(world), y.chunk(world)):
            (loss_fn(m, xm, ym) / world).backward()
        opt.step()
        opt.zero_grad()
        states.append(full_state(m))
    return states


def _distributed(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = copy.deepcopy(model)
    owned = fsdp.Bucket(MATRICES, placement=Owned())
    for block in m.blocks:
        fsdp.fully_shard(block, buckets=[owned])
    fsdp.fully_shard(m, buckets=[fsdp.Bucket("head.weight", placement=Owned())])
    # the matrices live whole on their owners: all rows on one rank, none elsewhere
    owners = {}
    for name, p in m.named_parameters():
        if p.dim() == 2 and not name.startswith("embed"):
            rows = torch.tensor([p.to_local().shape[0]])
            everyone = [torch.zeros_like(rows) for _ in range(world)]
            dist.all_gather(everyone, rows)
            owners[name] = [int(r) for r in everyone]
    opt = _muon(m)
    states = []
    for x, y in batches:
        per = x.shape[0] // world
        loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
        states.append(full_state(m))
    return {"owners": owners, "states": states}


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_owned_bucket_muon_equals_single_device_bit_for_bit(backend, world) -> None:
    model, batches = make_model(blocks=3), make_batches(STEPS)
    want = _single_device(model, batches, world)
    got = run_ranks(_distributed, world, model, batches, backend=backend)[0]
    for name, rows in got["owners"].items():
        full = dict(model.named_parameters())[name].shape[0]
        assert sorted(rows) == [0] * (world - 1) + [full], (name, rows)
    assert len({rows.index(max(rows)) for rows in got["owners"].values()}) == min(world, len(got["owners"]))
    for step, (a, b) in enumerate(zip(got["states"], want)):
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, (step, differ)
    # and Muon moved the weights (the comparison is not between two untouched models)
    assert not torch.equal(want[-1]["head.weight"], model.head.weight.detach())


# ----------------------------------------------------------------------------- checkpoints


def _build(model):
    m = copy.deepcopy(model)
    for block in m.blocks:
        fsdp.fully_shard(block, buckets=[fsdp.Bucket(MATRICES, placement=Owned())])
    fsdp.fully_shard(m, buckets=[fsdp.Bucket("head.weight", placement=Owned())])
    return m, _muon(m)


def _steps(m, opt, batches) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for x, y in batches:
        per = x.shape[0] // world
        loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def _save_then_continue(model, batches, path: str):
    from tests.fsdp.test_checkpoint import _full, _save

    m, opt = _build(model)
    _steps(m, opt, batches[:2])
    _save(m, opt, path)
    saved = _full(m, opt)
    _steps(m, opt, batches[2:])
    return saved, full_state(m)


def _load_then_continue(other, batches, path: str):
    from tests.fsdp.test_checkpoint import _full, _load

    m, opt = _build(other)
    _load(m, opt, path)
    loaded = _full(m, opt)
    _steps(m, opt, batches[2:])
    return loaded, full_state(m)


def test_owned_muon_checkpoint_resumes_exactly_and_reshards(tmp_path) -> None:
    """Muon's state is laid out like its Owned parameters, so DCP saves it on the owners and
    loads it onto other owners (world 4) exactly; resuming on the same world continues the
    uninterrupted run bit for bit."""
    from tests.fsdp.test_checkpoint import _diff

    model, other, batches = make_model(blocks=3), make_model(seed=5, blocks=3), make_batches(4)
    path = str(tmp_path / "c")
    first = run_ranks(_save_then_continue, 2, model, batches, path)
    saved, uninterrupted = first[0]
    assert saved[1]["state"] and all("momentum_buffer" in s or "exp_avg" in s for s in saved[1]["state"].values())
    again = run_ranks(_load_then_continue, 2, other, batches, path)[0]
    assert _diff(saved, again[0]) == []
    assert all(torch.equal(again[1][k], uninterrupted[k]) for k in uninterrupted)
    moved = run_ranks(_load_then_continue, 4, other, batches, path)[0]  # other owners
    assert _diff(saved, moved[0]) == []
