"""DBuffer.prepare_redistribute: a redistribute checked and planned once, run many times.

Each prepared move is compared with the plain ``redistribute`` of the same values into a fresh
buffer (an independent path: no prepared object, a new out), on every kind of step, a two-step
HSDP plan and an Owned layout; the result lives in ``out``'s storage; bad arguments raise at
``prepare_redistribute``, a released ``out`` at the run, both before any collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer import DBuffer, Owned, PreparedSlot
from dbuffer import collectives
from tests.harness import run_ranks

SHAPES = [(5, 3), (4,), (2, 2), (7,)]
S, R, P = Shard(0), Replicate(), Partial("sum")


def _fill(buf: DBuffer, shift: float) -> None:
    n = buf.local_buffer.numel()
    buf.local_buffer.copy_(torch.arange(n, dtype=buf.dtype) * 0.5 + 100 * dist.get_rank() + shift)


def _moves(mesh2d, mesh1d) -> list[tuple[DBuffer, tuple]]:
    """(source, target placements) for every kind of step and a plan of two steps."""
    owned = DBuffer(mesh1d, [Owned()], SHAPES, torch.float32)
    return [
        (DBuffer(mesh1d, [S], SHAPES, torch.float32), (R,)),  # all-gather
        (DBuffer(mesh1d, [P], SHAPES, torch.float32), (S,)),  # reduce-scatter
        (DBuffer(mesh1d, [P], SHAPES, torch.float32), (R,)),  # all-reduce
        (DBuffer(mesh1d, [R], SHAPES, torch.float32), (S,)),  # local scatter
        (DBuffer(mesh1d, [S], SHAPES, torch.float32), (S,)),  # no step: a copy
        (DBuffer(mesh2d, [P, P], SHAPES, torch.float32), (R, S)),  # HSDP: reduce-scatter, then all-reduce
        (owned, (R,)),  # Owned: gathered from its owners
        (DBuffer(mesh1d, [P], SHAPES, torch.float32, layout=owned.layout), (Owned(),)),  # reduced to the owners
    ]


def _prepared_equals_redistribute() -> bool:
    world = dist.get_world_size()
    mesh1d = init_device_mesh("cpu", (world,))
    mesh2d = init_device_mesh("cpu", (2, world // 2))
    for source, target in _moves(mesh2d, mesh1d):
        out = source.sibling(target)
        prepared = source.prepare_redistribute(target, out=out)
        storage = out.local_buffer.untyped_storage().data_ptr()
        for shift in (0.0, 3.0):  # the second run moves the new values: nothing of the first is kept
            _fill(source, shift)
            expected = source.redistribute(target)  # a fresh out: the independent path
            assert prepared.start().wait() is out
            assert torch.equal(out.local_buffer, expected.local_buffer), (source.placements, target, shift)
            assert out.local_buffer.untyped_storage().data_ptr() == storage, "the result is not in out's storage"
        _fill(source, 7.0)
        assert prepared.run() is out and torch.equal(out.local_buffer, source.redistribute(target).local_buffer)
    return True


def test_prepared_redistribute_equals_redistribute_on_every_kind_of_step() -> None:
    assert all(run_ranks(_prepared_equals_redistribute, 4, backend="threaded", timeout=120))


def _calls_made(mesh) -> int:
    """This rank's collectives launched on the mesh's group so far (dbuffer numbers each one)."""
    facts = collectives._FACTS.get(mesh.get_group(0))
    return 0 if facts is None else facts.calls.calls


def _bad_arguments_raise_before_any_collective() -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    source = DBuffer(mesh, [S], SHAPES, torch.float32)
    bad_outs = (
        (DBuffer(mesh, [S], SHAPES, torch.float32, layout=source.layout), "placements"),
        (DBuffer(mesh, [R], SHAPES, torch.float64, layout=source.layout), "dtype"),
        (torch.zeros(3), "not a DBuffer"),
    )
    before = _calls_made(mesh)  # the buffers' constructors check the ranks by a collective
    for out, words in bad_outs:
        with pytest.raises(ValueError, match=f"prepare_redistribute: out .*{words}"):
            source.prepare_redistribute((R,), out=out)
    with pytest.raises(ValueError, match="placements"):
        source.prepare_redistribute((R, R), out=source.sibling((R,)))
    out = source.sibling((R,))
    out.release_storage()
    prepared = source.prepare_redistribute((R,), out=out)  # may be prepared while released ...
    with pytest.raises(ValueError, match="released storage; call out.reallocate_storage"):
        prepared.start()  # ... but not run
    assert _calls_made(mesh) == before, "a collective ran before the error"
    out.reallocate_storage()
    _fill(source, 1.0)
    assert torch.equal(prepared.run().local_buffer, source.redistribute((R,)).local_buffer)
    return True


def test_bad_arguments_raise_before_any_collective() -> None:
    assert all(run_ranks(_bad_arguments_raise_before_any_collective, 2, backend="threaded", timeout=60))


def _release_waits_for_a_started_move() -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    source = DBuffer(mesh, [S], SHAPES, torch.float32)
    out = source.sibling((R,))
    _fill(source, 2.0)
    expected = source.redistribute((R,)).local_buffer.clone()
    pending = source.prepare_redistribute((R,), out=out).start()
    source.release_storage()  # waits for the gather in flight that reads it
    assert "_in_flight" not in source.__dict__ or not source.__dict__["_in_flight"]
    assert torch.equal(pending.wait().local_buffer, expected)
    return True


def test_releasing_a_buffer_waits_for_a_started_prepared_move() -> None:
    assert all(run_ranks(_release_waits_for_a_started_move, 2, backend="threaded", timeout=60))


def _slot_prepares_again_when_asked_otherwise() -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    source = DBuffer(mesh, [S], SHAPES, torch.float32)
    out, other = source.sibling((R,)), source.sibling((R,))
    slot = PreparedSlot()
    to_r = (R,)
    seen = []
    for target, placements in ((out, to_r), (out, to_r), (other, to_r), (other, (R,)), (out, to_r)):
        _fill(source, float(len(seen)))
        assert slot.start(source, placements, target).wait() is target
        assert torch.equal(target.local_buffer, source.redistribute((R,)).local_buffer)
        seen.append(slot._op)
    assert seen[0] is seen[1], "the same objects asked again: the prepared move is reused"
    assert len({id(op) for op in seen}) == 4, "another out, another placements object: prepared again"
    slot.clear()
    assert slot._op is None
    return True


def test_slot_reuses_a_prepared_move_only_for_the_same_objects() -> None:
    assert all(run_ranks(_slot_prepares_again_when_asked_otherwise, 2, backend="threaded", timeout=60))
