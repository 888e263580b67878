"""DBuffer.prepare_redistribute: a redistribute checked and planned once, run many times.

Each prepared move is compared with the plain ``redistribute`` of the same values into a fresh
buffer (an independent path: no prepared object, a new out), on every kind of step, a two-step
HSDP plan and an Owned layout; the result lives in ``out``'s storage; bad arguments raise at
``prepare_redistribute``, a released ``out`` at the run, both before any collective.
"""

from __future__ import annotations

import threading

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


def _bound_moves_are_exact(native_avg: bool) -> bool:
    """On a one-call backend (threaded) a prepared all-gather or reduce-scatter is bound once
    (:func:`dbuffer.collectives.bind`) and started without the per-call decisions: its values
    equal the sums and means computed here from every rank's known fill, it notes one call per
    start, and in debug mode it checks what the unbound function checks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    for source_pl, target, op in (((S,), (R,), None), ((P,), (S,), "sum"), ((Partial("avg"),), (S,), "avg")):
        source = DBuffer(mesh, list(source_pl), SHAPES, torch.float32)
        out = source.sibling(target)
        prepared = source.prepare_redistribute(target, out=out)
        assert prepared._bound is not None, "a single one-call step on a threaded group is bound"
        assert prepared._bound.divide == (op == "avg" and not native_avg)
        local = source.local_buffer.numel()
        ranks = torch.arange(world, dtype=torch.float32)
        index = torch.arange(local, dtype=torch.float32)
        for shift in (0.0, 5.0):
            _fill(source, shift)  # rank r holds index * 0.5 + 100 r + shift
            before = _calls_made(mesh)
            result = prepared.start().wait()
            assert result is out and _calls_made(mesh) == before + 1
            if op is None:  # every rank's shard, in rank order
                expected = (index * 0.5 + 100 * ranks[:, None] + shift).reshape(-1)
            else:  # this rank's chunk of the sum (mean) over the ranks
                chunk = out.local_buffer.numel()
                mine = index[rank * chunk : (rank + 1) * chunk]
                expected = world * (mine * 0.5 + shift) + 100 * ranks.sum()
                expected = expected / world if op == "avg" else expected
            torch.testing.assert_close(out.local_buffer, expected, rtol=0, atol=1e-5)
    return True


def test_a_bound_gather_or_reduction_is_exact_with_and_without_a_native_average(monkeypatch) -> None:
    for native_avg in (True, False):  # threaded has AVG; without it, a sum and a division at the wait
        monkeypatch.setattr(collectives, "_NATIVE_AVG_BACKENDS", ("nccl", "threaded") if native_avg else ("nccl",))
        assert all(run_ranks(_bound_moves_are_exact, 4, native_avg, backend="threaded", timeout=120))


def _fake_group_average() -> bool:
    group = dist.group.WORLD
    assert collectives.c10d_reduce_op("avg", group) == (dist.ReduceOp.AVG, False)
    source = DBuffer(init_device_mesh("cpu", (dist.get_world_size(),)), [Partial("avg")], SHAPES, torch.float32)
    prepared = source.prepare_redistribute([S], out=source.sibling((S,)))
    assert prepared._bound is not None and not prepared._bound.divide
    return True


def test_the_fake_group_averages_as_nccl_does_with_no_division_of_its_own() -> None:
    """torch's fake group (the host benchmarks' stand-in for NCCL, as FSDP2 uses it too) gets
    NCCL's native ``AVG``: a sum and a division there would be work no GPU run does."""
    assert run_ranks(_fake_group_average, 8, backend="fake") == [True]


_RECORDING = threading.local()  # per rank thread: the debug checks it made while recording


def _record_check(group, op: str, detail: str) -> None:
    seen = getattr(_RECORDING, "seen", None)
    if seen is not None:
        seen.append((op, detail))


def _debug_checks_of(start) -> list:
    _RECORDING.seen = []
    try:
        start()
        return _RECORDING.seen
    finally:
        _RECORDING.seen = None


def _bound_and_plain_debug_checks() -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for source_pl, target in (((S,), (R,)), ((Partial("avg"),), (S,))):
        source = DBuffer(mesh, list(source_pl), SHAPES, torch.float32)
        out = source.sibling(target)
        prepared = source.prepare_redistribute(target, out=out)
        bound = _debug_checks_of(lambda: prepared.start().wait())
        op = source_pl[0].reduce_op if target == (S,) else None
        group = mesh.get_group(0)
        plain = _debug_checks_of(lambda: (
            collectives.all_gather(out.local_buffer, source.local_buffer, group) if op is None
            else collectives.reduce_scatter(out.local_buffer, source.local_buffer, op, group)
        ))
        assert bound == plain and len(bound) == 1, (bound, plain)
    return True


def test_a_bound_move_checks_in_debug_mode_what_the_function_checks(monkeypatch) -> None:
    # set once for the whole process (the ranks are its threads); each rank records its own calls
    monkeypatch.setattr(collectives._debug, "check", _record_check)
    monkeypatch.setattr(collectives._debug, "ENABLED", True)
    assert all(run_ranks(_bound_and_plain_debug_checks, 2, backend="threaded", timeout=60))


def _not_bound() -> bool:
    world = dist.get_world_size()
    source = DBuffer(init_device_mesh("cpu", (world,)), [S], SHAPES, torch.float32)
    assert source.prepare_redistribute((R,), out=source.sibling((R,)))._bound is None
    one = DBuffer(init_device_mesh("cpu", (world, 1)), [R, S], SHAPES, torch.float32)
    assert one.prepare_redistribute((R, R), out=one.sibling((R, R)))._bound is None
    return True


def test_gloo_and_a_group_of_one_are_not_bound() -> None:
    """gloo's collectives take hand-built paths chosen per call, a group of one copies: both run
    the general path (exact there: the tests above on gloo's own suite of primitives)."""
    assert all(run_ranks(_not_bound, 2, backend="gloo", timeout=60))
