"""Weights only forward reads (fsdp/group/forward_only.py): a unit that keeps its weights after
forward (the root) frees its ``nn.Embedding`` weight, unless something could read it in backward.

Each case trains against one process on the global batch (tests/fsdp/models.py's reference), and
checks the storage itself: the unsharded buffer of the root's group shrinks to the bytes before
the embedding, or keeps every byte.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import fsdp
from fsdp.group.bucket import plan_buckets
from fsdp.group.policy import MixedPrecisionPolicy, parse_strategy
from tests.fsdp.models import TinyLM, full_state, loss_fn, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks


def test_the_plan_puts_forward_only_parameters_last_inside_each_group() -> None:
    """Inside a default group the forward-only parameters go last (stable); a ``bucket_size``
    split still cuts in registration order, so each group holds what it held before."""
    names = ["embed.weight", "norm.weight", "head.weight", "other.weight"]
    params = [torch.zeros(16, 4), torch.zeros(4), torch.zeros(16, 4), torch.zeros(3, dtype=torch.float64)]
    only = [True, False, False, False]
    mesh = torch.distributed.device_mesh.DeviceMesh.__new__(torch.distributed.device_mesh.DeviceMesh)  # not read
    plan = plan_buckets(names, params, [], mesh, parse_strategy("optim_grads_params"), MixedPrecisionPolicy(), None,
                        forward_only=only)
    assert [[names[k] for k in spec.members] for spec in plan] == [
        ["norm.weight", "head.weight", "embed.weight"], ["other.weight"]]
    split = plan_buckets(names, params, [], mesh, parse_strategy("optim_grads_params"), MixedPrecisionPolicy(),
                         16 * 4 * 4 + 4 * 4, forward_only=only)
    assert [[names[k] for k in spec.members] for spec in split] == [
        ["norm.weight", "embed.weight"], ["head.weight"], ["other.weight"]]


def _root_group(model) -> "fsdp.group.param_group.ParameterGroup":
    [group] = [g for g in model._fsdp_state.groups if any(i.fqn == "embed.weight" for i in g.infos)]
    return group


def _storage_after_forward(model, x, y) -> tuple[int, int, int, bool, torch.Tensor]:
    """Forward and loss; then the root group's unsharded storage bytes, the full buffer's bytes,
    the bytes before the embedding, whether ``embed.weight`` is registered sharded, and the loss."""
    loss = loss_fn(model, x, y)
    group = _root_group(model)
    buffer = group.weights.unsharded.local_buffer
    embed = group.unsharded_params[[i.fqn for i in group.infos].index("embed.weight")]
    prefix = embed.storage_offset() * buffer.element_size()
    return (buffer.untyped_storage().nbytes(), buffer.numel() * buffer.element_size(), prefix,
            isinstance(model.embed.weight, DTensor), loss)


def _train_and_watch(model, batches, micro: int, build) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = build(copy.deepcopy(model))
    seen = []
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        per = x.shape[0] // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            *facts, loss = _storage_after_forward(m, xm, ym)
            seen.append(tuple(facts))
            (loss / micro).backward()
        opt.step()
        opt.zero_grad()
    return {"seen": seen, "weights": full_state(m)}


def _units(model, **kw):
    for block in model.blocks:
        fsdp.fully_shard(block, **kw)
    return fsdp.fully_shard(model, **kw)


@pytest.mark.parametrize("layout,offload", [("chunk", False), ("row", False), ("ragged", False), ("chunk", True)])
def test_the_root_frees_its_embedding_after_forward_and_trains_exactly(layout, offload) -> None:
    """Every micro-batch's forward ends with the root's storage cut to the bytes before the
    embedding (the embedding registered sharded), and training matches one process; also with
    everything else on the host (CPUOffloadPolicy: the gathered weights are the device's)."""
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches, world=1)

    def build(m):
        with fsdp.layout_policy(layout):
            return _units(m, **({"offload_policy": fsdp.CPUOffloadPolicy()} if offload else {}))

    for out in run_ranks(_train_and_watch, 2, model, batches, 2, build, backend="threaded"):
        for nbytes, full, prefix, sharded in out["seen"]:
            assert 0 < prefix < full and nbytes == prefix and sharded, out["seen"]
        assert max_diff(out["weights"], ref) <= 1e-5


class _StashingMatmul(torch.autograd.Function):
    """``x @ w.t()`` that keeps ``w`` on ctx as a plain attribute (not save_for_backward): only
    a Python reference says backward will read it."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.w, None  # no gradient for w through this path


class _ReadsEmbedding(TinyLM):
    """TinyLM whose forward also reads the embedding weight in a way backward needs: through a
    view saved by autograd, the parameter itself saved, or a Python reference on ctx."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, tokens):
        logits = super().forward(tokens)
        h = self.embed(tokens) * 0.5
        if self.how == "view":
            extra = h @ self.embed.weight.t()
        elif self.how == "saved":
            extra = F.linear(h, self.embed.weight)
        else:
            extra = _StashingMatmul.apply(h, self.embed.weight)
        return logits + extra


@pytest.mark.parametrize("how", ["view", "saved", "stashed"])
def test_a_weight_backward_may_read_is_kept(how) -> None:
    """Read in a way backward needs, the embedding weight stays gathered (no byte freed) and the
    gradients are exact; freeing it would leave backward reading freed memory."""
    torch.manual_seed(0)
    model, batches = _ReadsEmbedding(how), make_batches(2)
    ref = reference(model, batches, world=1)
    for out in run_ranks(_train_and_watch, 2, model, batches, 1, _units, backend="threaded"):
        for nbytes, full, prefix, sharded in out["seen"]:
            assert nbytes == full and not sharded, (how, out["seen"])
        assert max_diff(out["weights"], ref) <= 1e-5


class _CheckpointedFront(TinyLM):
    """TinyLM whose forward recomputes its embedding in backward (activation checkpointing of a
    submodule of the root, not a unit of its own)."""

    def forward(self, tokens):
        x = checkpoint(self.embed, tokens, use_reentrant=False) * 1.0
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _watched(model, batches, build, losses: int = 1) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = build(copy.deepcopy(model))
    group = _root_group(m)
    freed = []
    orig = group.unsharder.release_forward_only

    def watch():
        orig()
        freed.append(group.unsharder.forward_only_freed())

    group.unsharder.release_forward_only = watch
    reads = []  # per embedding call: (inside backward, the weight it reads is sharded)
    m.embed.register_forward_pre_hook(lambda mod, args: reads.append(
        (torch._C._current_graph_task_id() != -1, isinstance(mod.weight, DTensor))))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        per = x.shape[0] // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        halves = list(zip(x.chunk(losses), y.chunk(losses)))
        total = sum(loss_fn(m, xm, ym) for xm, ym in halves) / losses  # every forward, then one backward
        total.backward()
        opt.step()
        opt.zero_grad()
    return {"freed": freed, "reads": reads, "weights": full_state(m)}


def test_a_recomputed_embedding_gathers_the_freed_weight_again() -> None:
    """The root frees its embedding after forward; activation checkpointing recomputes the
    embedding in backward, which gathers the root's group again for it: exact training."""
    model, batches = _CheckpointedFront(), make_batches(2)
    ref = reference(model, batches, world=1)
    for out in run_ranks(_watched, 2, model, batches, _units, backend="threaded"):
        assert out["freed"] == [True, True]
        assert out["reads"] == [(False, False), (True, False)] * 2  # the recomputation reads it gathered
        assert max_diff(out["weights"], ref) <= 1e-5


def test_two_forwards_before_a_backward_stop_the_freeing() -> None:
    """A second forward before backward finds the embedding freed and gathers the group again
    (once); from then on the group keeps it, as FSDP2 does, instead of a gather per forward."""
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches, world=1)
    for out in run_ranks(_watched, 2, model, batches, _units, 2, backend="threaded"):
        assert out["freed"] == [True, False, False, False, False, False], out["freed"]
        assert max_diff(out["weights"], ref) <= 1e-5


def test_reshard_after_forward_false_keeps_every_weight() -> None:
    """An explicit ``reshard_after_forward=False`` keeps the root's weights whole, as asked
    (pipeline stages run several forwards before their backwards)."""
    model, batches = make_model(), make_batches(2)

    def build(m):
        for block in m.blocks:
            fsdp.fully_shard(block)
        return fsdp.fully_shard(m, reshard_after_forward=False)

    for out in run_ranks(_train_and_watch, 2, model, batches, 1, build, backend="threaded"):
        for nbytes, full, prefix, sharded in out["seen"]:
            assert nbytes == full and not sharded, out["seen"]
