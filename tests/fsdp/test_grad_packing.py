"""A unit's gradients go into its reduction buffer in one op per group (one dispatch and, on a
GPU, one launch, however many parameters the group has): FSDP2's ``_chunk_cat`` in the chunked
layout, a foreach copy in the flat one; where a layout cannot (a parameter split along another
dim), each parameter takes its own copy. Gradients are checked against one process on the
global batch."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.harness import run_ranks


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward(model, x, y, layout: str, shard_dim: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = copy.deepcopy(model)
    kw = {} if shard_dim == 0 else {"shard_placement_fn": lambda p: Shard(shard_dim) if p.ndim > 1 else None}
    with fsdp.layout_policy(layout):
        for block in m.blocks:
            fsdp.fully_shard(block, **kw)
        fsdp.fully_shard(m, **kw)
    per = x.shape[0] // world
    loss = loss_fn(m, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
    with _Ops() as ops:
        loss.backward()
    groups = sum(len(mod._fsdp_state.groups) for mod in m.modules() if isinstance(mod, fsdp.FSDPModule))
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return {"ops": ops.counts, "groups": groups, "grads": grads}


@pytest.mark.parametrize("layout,shard_dim", [("chunk", 0), ("auto", 0), ("chunk", 1)])
def test_one_foreach_write_per_group_and_exact_gradients(layout, shard_dim) -> None:
    model, ((x, y),) = make_model(), make_batches(1)
    ref = copy.deepcopy(model)
    loss_fn(ref, x, y).backward()
    for out in run_ranks(_backward, 2, model, x, y, layout, shard_dim, backend="threaded"):
        foreach, chunk_cat = out["ops"]["_foreach_copy_"], out["ops"]["_chunk_cat"]
        if shard_dim == 0:  # every group written at once: chunked by _chunk_cat, flat by a foreach copy
            one_op = chunk_cat if layout == "chunk" else foreach
            assert one_op == out["groups"] and foreach + chunk_cat == one_op, (foreach, chunk_cat, out["groups"])
        else:  # dim-1 pieces are strided: a copy per parameter
            assert foreach == chunk_cat == 0 and out["ops"]["copy_"] >= sum(1 for _ in model.parameters())
        for n, p in ref.named_parameters():
            assert torch.allclose(out["grads"][n], p.grad, atol=1e-6, rtol=1e-5), n


def _micro_batches_with_graph(model, x, y) -> dict:
    """Two micro-batches, the first without gradient sync (the second adds its gradients into
    the kept reduction buffer), each backward keeping a graph (``create_graph=True``: autograd
    runs the hooks with grad mode on)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = copy.deepcopy(model)
    for block in m.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(m)
    for j, (xs, ys) in enumerate(_micro(x, y, rank, world)):
        m.set_requires_gradient_sync(j == 1)
        loss_fn(m, xs, ys).backward(create_graph=True)
    reducers = [g.grads for mod in m.modules() if isinstance(mod, fsdp.FSDPModule) for g in mod._fsdp_state.groups]
    graphs = [b.local_buffer.requires_grad for r in reducers for b in (r.grad_in, r.main_grad)]
    return {"grads": {n: p.grad.full_tensor() for n, p in m.named_parameters()}, "graphs": graphs}


def _micro(x, y, rank: int, world: int) -> list:
    """This rank's two micro-batches (rank-major halves of its share of the global batch)."""
    per = x.shape[0] // world
    mine = (x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
    return [(t[: per // 2] for t in mine), (t[per // 2:] for t in mine)]


def test_micro_batch_gradients_add_without_a_graph_under_create_graph() -> None:
    model, ((x, y),) = make_model(), make_batches(1)
    ref = copy.deepcopy(model)
    for j in range(2):  # micro-batch j of every rank, as one global batch
        xs, ys = (torch.cat([list(_micro(x, y, r, 2)[j])[i] for r in range(2)]) for i in range(2))
        loss_fn(ref, xs, ys).backward()
    for out in run_ranks(_micro_batches_with_graph, 2, model, x, y, backend="threaded"):
        assert out["graphs"] and not any(out["graphs"]), out["graphs"]  # no buffer joined a graph
        for n, p in ref.named_parameters():
            assert not out["grads"][n].requires_grad, n
            assert torch.allclose(out["grads"][n], p.grad, atol=1e-6, rtol=1e-5), n


def _row_views_over_steps(model, x, y) -> bool:
    """Two steps of a sharded model; then each group's ``[shards, shard_numel]`` row views (the
    copy-out's source, the gradients' target) are the objects the steps used and still views of
    their buffers' storage, which every step released and reallocated."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = copy.deepcopy(model)
    for block in m.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(m)
    per = x.shape[0] // world
    groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule) for g in mod._fsdp_state.groups]
    seen = []
    for _ in range(2):
        loss_fn(m, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        seen.append([(g.layout.gathered_rows(g.weights.gathered), g.layout._grad_rows_of(g.grads.grad_in))
                     for g in groups])
    for g, (first, second) in zip(groups, zip(*seen)):
        assert first[0] is second[0] and first[1] is second[1], "a row view made again"
        for rows, buf in zip(first, (g.weights.gathered, g.grads.grad_in)):
            buf.reallocate_storage()
            assert rows.untyped_storage()._cdata == buf.local_buffer.untyped_storage()._cdata
            assert rows.data_ptr() == buf.local_buffer.data_ptr() and rows.numel() == buf.local_buffer.numel()
    return True


def test_row_views_are_made_once_and_stay_views_of_their_buffers() -> None:
    model, ((x, y),) = make_model(), make_batches(1)
    assert all(run_ranks(_row_views_over_steps, 2, model, x, y, backend="threaded"))
