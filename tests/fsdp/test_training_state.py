"""Training states (fsdp/unit/training_state.py) and the root context (fsdp/unit/root.py): the
states a step moves every unit through, the moves refused with an error naming the unit, and
what only the root holds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from fsdp.unit.training_state import ALLOWED, TrainingState, TrainingStateError, check_transition
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks

S = TrainingState
WORLD = 2


def test_the_table_refuses_exactly_the_moves_that_would_break_a_step() -> None:
    refused = {(a, b) for a in S for b in S if b not in ALLOWED[a]}
    assert refused == {
        (S.FORWARD, S.PRE_BACKWARD),  # a backward under the unit's running forward
        (S.FORWARD, S.POST_BACKWARD),
        (S.PRE_BACKWARD, S.FORWARD),  # a forward after a backward that never ended
        (S.POST_BACKWARD, S.FORWARD),
    }
    for a in S:  # reset_iter_state and the end of backward return every unit to IDLE
        assert S.IDLE in ALLOWED[a] and a in ALLOWED[a]
    for a, b in refused:
        with pytest.raises(RuntimeError) as err:
            check_transition("'blocks.1' (FSDPBlock)", a, b)
        assert isinstance(err.value, TrainingStateError)
        message = str(err.value)
        assert "'blocks.1' (FSDPBlock)" in message and f"from {a.name} to {b.name}" in message, message
        assert "reset_iter_state()" in message, message


def _local(x: torch.Tensor, y: torch.Tensor):
    rank, per = dist.get_rank(), x.shape[0] // dist.get_world_size()
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _reference_grads(model, x, y) -> dict[str, torch.Tensor]:
    """One process, the global batch: what the ranks' averaged gradients must equal."""
    ref = copy.deepcopy(model)
    loss_fn(ref, x, y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _grad_error(m, ref) -> float:
    got = {n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    return max(float((got[n] - ref[n]).abs().max()) for n in ref)


def _states_of_a_step(model, x, y) -> dict:
    xl, yl = _local(x, y)
    m = shard(copy.deepcopy(model), True)
    units = [m._fsdp_state] + [b._fsdp_state for b in m.blocks]
    block = m.blocks[0]._fsdp_state
    seen: dict = {}

    def note(key: str, what):
        def hook(*args) -> None:  # returns None: leaves outputs and gradients as they are
            seen.setdefault(key, what())

        return hook

    # inside block 0's forward and its backward (hooks of a module of that unit)
    m.blocks[0].down.register_forward_hook(note("in forward", lambda: block.training_state))
    m.blocks[0].down.register_full_backward_hook(note("in backward", lambda: block.training_state))
    # the embedding's output gradient comes last: by then the blocks' gradients are reduced
    blocks_done = note("blocks done", lambda: [b._fsdp_state.training_state for b in m.blocks])
    m.embed.register_forward_hook(lambda module, inputs, out: out.register_hook(blocks_done) and None)
    loss = loss_fn(m, xl, yl)
    seen["after forward"] = [u.training_state for u in units]
    loss.backward()
    seen["after backward"] = [u.training_state for u in units]
    return seen


def test_a_step_moves_every_unit_through_its_states() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    for seen in run_ranks(_states_of_a_step, WORLD, model, x, y, backend="threaded", timeout=60):
        assert seen["in forward"] is S.FORWARD and seen["in backward"] is S.PRE_BACKWARD, seen
        assert seen["blocks done"] == [S.POST_BACKWARD] * 2, seen
        assert seen["after forward"] == [S.IDLE] * 3 and seen["after backward"] == [S.IDLE] * 3, seen


class _Failure(Exception):
    pass


def _forward_after_failed_backward(model, x, y, ref) -> dict:
    xl, yl = _local(x, y)
    m = shard(copy.deepcopy(model), True)
    out: dict = {}
    real_forward = m.blocks[0].forward

    def failing_forward(h):  # its output's gradient raises: the backward stops half-way
        h = real_forward(h)
        h.register_hook(lambda g: (_ for _ in ()).throw(_Failure("backward")))
        return h

    m.blocks[0].forward = failing_forward
    with pytest.raises(_Failure):
        loss_fn(m, xl, yl).backward()
    m.blocks[0].forward = real_forward
    out["left"] = [m._fsdp_state.training_state, m.blocks[1]._fsdp_state.training_state]
    try:  # no reset_iter_state(): the next forward is refused before anything runs
        loss_fn(m, xl, yl)
        out["refused"] = None
    except TrainingStateError as e:
        out["refused"] = str(e)
    m.reset_iter_state()
    out["after reset"] = [u.training_state for u in m._fsdp_state.units]
    m.zero_grad()
    loss_fn(m, xl, yl).backward()
    out["grads"] = _grad_error(m, ref)
    return out


def test_a_forward_after_a_failed_backward_is_refused_until_reset_iter_state() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    for r in run_ranks(_forward_after_failed_backward, WORLD, model, x, y, ref, backend="threaded", timeout=60):
        # the root's backward began (PRE_BACKWARD); block 1's gradients were reduced (POST_BACKWARD)
        assert r["left"] == [S.PRE_BACKWARD, S.POST_BACKWARD], r
        message = r["refused"]
        assert message is not None and "'<root>' (FSDPTinyLM)" in message, r
        assert "from PRE_BACKWARD to FORWARD" in message and "reset_iter_state()" in message, r
        assert r["after reset"] == [S.IDLE] * 3, r
        assert r["grads"] < 1e-5, r


def _root_context(model, x, y, ref) -> dict:
    xl, yl = _local(x, y)
    m = shard(copy.deepcopy(model), True)
    root, blocks = m._fsdp_state, [b._fsdp_state for b in m.blocks]
    # Root-only knobs set on a unit before the first forward: only a root keeps them
    m.blocks[0].set_is_last_backward(False)  # dropped: block 0 will not be a root
    m.blocks[1].set_reduce_scatter_max_input_buffers(3, recurse=False)  # the largest bound applies
    loss_fn(m, xl, yl).backward()
    out = {
        "root holds": (root.root_ctx is not None, root.units == [root, *blocks]),
        "blocks hold": [(b.root_ctx, b.units, b.root is root) for b in blocks],
        "bound": root.root_ctx.max_reductions_in_flight,
        "attached": all(p.grad is not None for p in m.parameters()),
    }
    # Set on a unit of an initialised tree, a root knob reaches the root (as in FSDP2)
    m.zero_grad()
    m.blocks[1].set_is_last_backward(False)
    loss_fn(m, xl, yl).backward()
    out["deferred"] = all(p.grad is None for p in m.parameters())
    m.finish_grad_sync()
    out["grads"] = _grad_error(m, ref)
    loss_fn(m, xl, yl)  # the second grad-enabled forward: the order is complete
    out["order"] = [u.fqn for u in root.root_ctx.forward_order]
    return out


def test_only_the_root_holds_the_tree_and_its_knobs() -> None:
    model, (x, y) = make_model(), make_batches(1)[0]
    ref = _reference_grads(model, x, y)
    for r in run_ranks(_root_context, WORLD, model, x, y, ref, backend="threaded", timeout=60):
        assert r["root holds"] == (True, True), r
        assert r["blocks hold"] == [(None, [], True)] * 2, r
        assert r["bound"] == 3 and r["attached"], r
        assert r["deferred"] and r["grads"] < 1e-5, r
        assert r["order"] == ["", "blocks.0", "blocks.1"], r
