"""FSDP2's ``reshard_after_forward=n`` (fsdp/post_forward.py), on 4 gloo ranks with n = 2.

* After a block's forward its gathered weights are freed and the rank keeps exactly 1/n of them;
  the backward gather of those blocks runs in groups of n ranks (all-gathers spied on: group sizes
  during backward), after backward nothing is kept.
* Training equals the single-process reference on the global batch and, bit for bit, the same
  model with ``reshard_after_forward=True`` (the same numbers, another gather).
* A unit whose weights the optimizer changed since forward is gathered fully again (the slice
  is stale): checked by a forward, an optimizer step, then a backward of a fresh forward.
* An ``Owned()`` bucket keeps no slice (its tensors lie whole on their owners: no ``Shard(0)``
  slice for n ranks): it reshards fully after forward and gathers fully in backward, beside
  packed groups of the same units that keep theirs, and trains as the single process does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp
from dbuffer import Owned
from fsdp.group.layout_choice import layout_policy
from fsdp.group.layouts import ChunkedLayout
from fsdp.group.unsharded_state import Unsharded
from tests.fsdp.models import full_state, loss_fn, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks, spy_collectives

N = 2


def _post_forward(model, batches, layout: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    with layout_policy(layout):
        m = shard(copy.deepcopy(model), True, reshard_after_forward=N)
        ref_true = shard(copy.deepcopy(model), True, reshard_after_forward=True)
    groups = [g for block in m.blocks for g in block._fsdp_state.groups]
    assert all(g.unsharder.post_forward is not None for g in groups)
    assert all(isinstance(g.layout, ChunkedLayout) == (layout == "chunk") for g in groups)
    x, y = batches[0]
    per = x.shape[0] // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    loss = loss_fn(m, x, y)
    out["kept"] = [
        (g.unsharder.unsharded.state is Unsharded.SLICE_KEPT and not g.unsharder.post_forward.buffer.is_storage_released(),
         g.weights.unsharded.is_storage_released(),
         g.unsharder.post_forward.buffer.local_buffer.numel() * N == g.unsharder.post_forward.unsharded.layout.total_numel)
        for g in groups
    ]
    with spy_collectives("all_gather") as seen:
        loss.backward()
    out["backward_gather_sizes"] = sorted({len(ranks) for _, ranks in seen})
    out["emptied"] = all(g.unsharder.unsharded.state is Unsharded.SHARDED and g.unsharder.post_forward.buffer.is_storage_released()
                         for g in groups)
    m.zero_grad(set_to_none=True)

    # A step between forward and backward makes the kept slices stale: gathered fully again.
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    loss = loss_fn(m, x, y)
    opt.step()  # marks every group stale, values unchanged (lr 0)
    with spy_collectives("all_gather") as seen:
        loss.backward()
    out["stale_gather_sizes"] = sorted({len(ranks) for _, ranks in seen})
    m.zero_grad(set_to_none=True)

    train(m, batches, rank=rank, world=world)
    train(ref_true, batches, rank=rank, world=world)
    out["weights"] = full_state(m)
    out["equal_to_true"] = max_diff(full_state(m), full_state(ref_true))
    return out


@pytest.mark.parametrize("layout", ["chunk", "row"])
def test_reshard_after_forward_n_keeps_a_slice_and_gathers_in_n_ranks(layout: str) -> None:
    """FSDP2's torch.chunk pieces (the default) and Megatron's row-atomic layout."""
    model, batches = make_model(), make_batches(3)
    want = reference(model, batches)
    for r in run_ranks(_post_forward, 4, model, batches, layout):
        assert r["kept"] and all(all(flags) for flags in r["kept"]), r["kept"]
        assert r["backward_gather_sizes"] == [N], r["backward_gather_sizes"]
        assert r["emptied"]
        assert r["stale_gather_sizes"] == [4], r["stale_gather_sizes"]
        assert r["equal_to_true"] == 0.0
        assert max_diff(r["weights"], want) < 1e-5


MATRICES = ["gate.weight", "up.weight", "down.weight"]  # each block's Owned() bucket


def _owned_bucket(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {}
    for reshard in (N, True):
        m = copy.deepcopy(model)
        for block in m.blocks:
            fsdp.fully_shard(block, reshard_after_forward=reshard, buckets=[fsdp.Bucket(MATRICES, placement=Owned())])
        built[reshard] = fsdp.fully_shard(m, reshard_after_forward=reshard)
    m = built[N]
    groups = [g for block in m.blocks for g in block._fsdp_state.groups]
    owned = [isinstance(g.placements.sharded[-1], Owned) for g in groups]
    out: dict = {"owned": owned, "slices": [g.unsharder.post_forward is not None for g in groups]}
    gathers = {id(g): [] for g in groups}  # per group, in backward: "full" or "slice"
    for g in groups:
        for obj, attr, kind in ((g.unsharder, "_all_gather", "full"), (g.unsharder.post_forward, "gather", "slice")):
            if obj is not None:
                real = getattr(obj, attr)
                setattr(obj, attr, lambda *a, real=real, kind=kind, seen=gathers[id(g)], **k: seen.append(kind) or real(*a, **k))
    x, y = batches[0]
    per = x.shape[0] // world
    loss = loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
    out["after_forward"] = [(g.unsharder.unsharded.state.name, g.weights.unsharded.is_storage_released()) for g in groups]
    for seen in gathers.values():
        seen.clear()
    loss.backward()
    out["backward_gathers"] = [sorted(set(gathers[id(g)])) for g in groups]
    m.zero_grad(set_to_none=True)
    for r in (N, True):
        train(built[r], batches, rank=rank, world=world)
    out["weights"] = full_state(m)
    out["equal_to_true"] = max_diff(full_state(m), full_state(built[True]))
    return out


def test_an_owned_bucket_reshards_fully_beside_slices_and_trains_right() -> None:
    """``reshard_after_forward=2`` on 4 ranks with an ``Owned()`` bucket per block (fully_shard
    raised building a ``Shard(0)`` slice of an owned layout before)."""
    model, batches = make_model(), make_batches(3)
    want = reference(model, batches)
    for r in run_ranks(_owned_bucket, 4, model, batches):
        assert any(r["owned"]) and not all(r["owned"]), r["owned"]  # both kinds in every block
        assert r["slices"] == [not o for o in r["owned"]], r
        assert r["after_forward"] == [("SHARDED", True) if o else ("SLICE_KEPT", True) for o in r["owned"]], r
        assert r["backward_gathers"] == [["full"] if o else ["slice"] for o in r["owned"]], r
        assert r["equal_to_true"] == 0.0
        assert max_diff(r["weights"], want) < 1e-5


def _refuses_a_non_factor(model) -> bool:
    with pytest.raises(ValueError, match="factor of the shard group's size"):
        shard(copy.deepcopy(model), True, reshard_after_forward=3)
    return True


def test_reshard_after_forward_int_is_validated() -> None:
    assert all(run_ranks(_refuses_a_non_factor, 4, make_model()))


def _an_old_model_alive_on_some_ranks(model, batches) -> dict:
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    old = shard(copy.deepcopy(model), True, mesh=mesh, reshard_after_forward=N)
    train(old, batches[:1], rank=rank, world=world)
    if rank % 2:  # these ranks free the old model (and whatever only it kept alive); the others keep it
        del old
        gc.collect()
    new = shard(copy.deepcopy(model), True, mesh=mesh, reshard_after_forward=N)
    train(new, batches, rank=rank, world=world)
    views = mesh.__dict__["_fsdp_post_forward_views"]  # one view, on the mesh itself
    assert list(views) == [N] and views[N].mesh.shape == (world // N, N)
    assert not copy.deepcopy(mesh).__dict__.get("_fsdp_post_forward_views")  # process groups do not travel
    return full_state(new)


def test_a_model_alive_on_some_ranks_only_changes_nothing_for_the_next_one() -> None:
    """The (W/n, n) view of a mesh is built collectively the first time; whether a later
    fully_shard builds it again must not depend on what each rank's garbage collector freed
    (a view cached only while some unit used it: ranks that dropped their model built a new
    view alone and hung)."""
    model, batches = make_model(), make_batches(2)
    want = reference(model, batches)
    for state in run_ranks(_an_old_model_alive_on_some_ranks, 4, model, batches, timeout=60):
        assert max_diff(state, want) < 1e-5
