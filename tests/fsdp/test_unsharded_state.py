"""The unsharded weights' states (fsdp/group/unsharded_state.py): the table, and the states a
real step walks through for ZeRO-3 and ZeRO-2, each checked against the buffers (gathered
storage present or not), with the trained weights compared to one process on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp
from fsdp.group.unsharded_state import ALLOWED, Unsharded, UnshardedLife, UnshardedStateError
from tests.fsdp.models import full_state, loss_fn, make_batches, make_model, max_diff, reference
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks

U = Unsharded


def test_the_table_refuses_what_would_lose_a_gather_or_a_slice() -> None:
    refused = {(a, b) for a in U for b in U if b not in ALLOWED[a]}
    assert refused == {
        (U.SHARDED, U.GATHERED), (U.SHARDED, U.SLICE_KEPT),  # nothing gathered to hold or slice
        (U.GATHERING, U.GATHERING), (U.GATHERING, U.SHARDED),  # a gather in flight is waited for
        (U.GATHERING, U.SLICE_KEPT), (U.GATHERED, U.GATHERED),
        (U.SLICE_KEPT, U.SLICE_KEPT), (U.SLICE_KEPT, U.GATHERED),  # a slice is gathered first
        (U.SHARDED, U.FORWARD_ONLY_FREED), (U.GATHERING, U.FORWARD_ONLY_FREED),  # only kept weights lose a tail
        (U.SLICE_KEPT, U.FORWARD_ONLY_FREED), (U.FORWARD_ONLY_FREED, U.FORWARD_ONLY_FREED),
        (U.FORWARD_ONLY_FREED, U.GATHERED), (U.FORWARD_ONLY_FREED, U.SLICE_KEPT),  # the tail is gathered first
    }
    life = UnshardedLife("'w'")
    life.begin_gather()
    with pytest.raises(UnshardedStateError, match="of 'w' cannot go from GATHERING to SHARDED"):
        life.freed()
    life.gathered(3)
    assert life.is_current(3) and not life.is_current(4)
    life.keep_slice()
    assert life.version == 3 and not life.is_current(3)
    life.freed()
    assert life.version is None and life.state is U.SHARDED
    life.begin_gather()
    life.gathered(4)
    life.free_forward_only()
    assert life.version == 4 and not life.is_current(4)  # enough for backward, not for a forward
    with pytest.raises(UnshardedStateError, match="FORWARD_ONLY_FREED to SLICE_KEPT"):
        life.keep_slice()
    life.begin_gather()  # a recomputed forward gathers the whole group again


def _walk(model, batches, strategy: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True, sharding_strategy=strategy)
    blocks = [g for block in m.blocks for g in block._fsdp_state.groups]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    def seen() -> set:
        for g in blocks:  # the state's claim about the gathered storage, checked on the buffers
            assert g.weights.has_unsharded() == (g.unsharder.unsharded.state is U.GATHERED), g.unsharder.unsharded.state
        return {g.unsharder.unsharded.state for g in blocks}

    out: dict = {"built": seen(), "inside forward": set()}
    hooks = [block.register_forward_pre_hook(lambda mod, args: out["inside forward"].update(  # after fsdp's
        g.unsharder.unsharded.state for g in mod._fsdp_state.groups)) for block in m.blocks]
    for x, y in batches:
        per = x.shape[0] // world
        loss = loss_fn(m, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        out["between forward and backward"] = seen()
        loss.backward()
        out["after backward"] = seen()
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    out["weights"] = full_state(m)
    return out


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_a_step_walks_the_states(strategy: str) -> None:
    model, batches = make_model(), make_batches(2)
    ref = reference(model, batches)
    for out in run_ranks(_walk, 2, model, batches, strategy, backend="threaded"):
        assert out["inside forward"] == {U.GATHERED}
        if strategy == "optim_grads_params":
            assert out["built"] == out["between forward and backward"] == out["after backward"] == {U.SHARDED}
        else:  # ZeRO-2 keeps them gathered from the refresh to the next step
            assert out["between forward and backward"] == out["after backward"] == {U.GATHERED}
        assert max_diff(out["weights"], ref) <= 1e-5
