"""tools/kit/comm_replay.py: a recorded step's c10d calls replay alone, as the same calls."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tools.kit import comm_replay
from tools.kit.comm import CommCounter


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(ValueError, match="no calls"):
        comm_replay.Replay([])


def test_record_keeps_shapes_not_tensors() -> None:
    x = torch.ones(3, 4, dtype=torch.bfloat16)
    call = comm_replay.record("all_gather", {"tensor_list": [x, x], "tensor": x, "async_op": True}, True)
    spec = comm_replay.TensorSpec((3, 4), torch.bfloat16)
    assert call.arguments == {"tensor_list": [spec, spec], "tensor": spec, "async_op": True}


def _step(rank: int) -> None:
    """A step's communication: one all-gather, then three point-to-point exchanges (fp32, bf16,
    fp32 again)."""
    world, peer = dist.get_world_size(), 1 - dist.get_rank()
    out = torch.empty(world * 6)
    dist.all_gather_into_tensor(out, torch.full((6,), float(rank)))
    for numel, dtype in ((100, torch.float32), (40, torch.bfloat16), (100, torch.float32)):
        works = [dist.isend(torch.ones(numel, dtype=dtype), peer), dist.irecv(torch.empty(numel, dtype=dtype), peer)]
        for w in works:
            w.wait()


def _record_and_replay() -> dict:
    rank = dist.get_rank()
    counter = CommCounter()
    counter.install()
    try:
        with counter.counting("step"), counter.recording() as trace:
            _step(rank)
        replay = comm_replay.Replay(trace)
        with counter.counting("replay"):
            replay.run()
    finally:
        counter.uninstall()
    return {"names": [c.name for c in trace], "new_op": [c.new_op for c in trace],
            "stats": counter.stats, "pool_bytes": replay.nbytes}


def test_replay_makes_the_recorded_calls_and_holds_one_operation_at_a_time() -> None:
    for res in run_ranks(_record_and_replay, 2, backend="gloo", timeout=60):
        assert res["names"] == ["all_gather_into_tensor"] + ["isend", "irecv"] * 3
        assert res["new_op"] == [True] + [True, False] * 3
        assert res["stats"]["replay"] == res["stats"]["step"]
        assert res["stats"]["step"]["ops"] == 4 and res["stats"]["step"]["calls"] == 7
        # One tensor per argument slot of an operation and shape: the second fp32 exchange reuses
        # the first one's tensors, so the pool holds each distinct operation once.
        assert res["pool_bytes"] == 4 * (12 + 6) + 4 * (100 + 100) + 2 * (40 + 40)
