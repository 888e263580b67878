"""The debug mode for mismatched collectives (``DBUFFER_DEBUG_COLLECTIVES``, dbuffer/debug.py):
a rank that skips a collective or a forward makes every rank raise a clear error naming the call
within seconds instead of hanging until the process-group timeout; off, nothing is checked."""

from __future__ import annotations

import contextlib
import copy
import re
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fsdp
from dbuffer import DBuffer, debug, distribute_tensors
from fsdp import checkpoint as ckpt
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.harness import run_ranks

SHAPES = [(5, 3), (4,)]


@contextlib.contextmanager
def _debug_mode(enabled: bool, timeout: float):
    """Switch the mode on this rank; restore the previous setting (the suite may run with
    DBUFFER_DEBUG_COLLECTIVES=1) afterwards."""
    was, was_timeout = debug.ENABLED, debug.TIMEOUT
    debug.set_enabled(enabled, timeout=timeout)
    try:
        yield
    finally:
        debug.set_enabled(was, timeout=was_timeout)


def _buffers():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    buf = distribute_tensors([torch.randn(s, generator=g) for s in SHAPES], mesh, [Shard(0)])
    return buf, DBuffer(mesh, [Replicate()], SHAPES, torch.float32)


def _skip_one_collective() -> tuple:
    """Rank 1 skips the second all-gather: rank 0 must not wait for the process-group timeout."""
    with _debug_mode(True, 2.0):
        buf, out = _buffers()
        buf.allgather(0, out=out)  # call #0: both ranks
        if dist.get_rank() == 1:
            return None, 0.0
        start = time.monotonic()
        try:
            buf.allgather(0, out=out)  # call #1: rank 0 only
        except debug.CollectiveMismatchError as exc:
            return str(exc), time.monotonic() - start
        return "no error", 0.0


def test_a_skipped_collective_names_the_rank_and_the_call() -> None:
    (message, seconds), (nothing, _) = run_ranks(_skip_one_collective, 2, backend="gloo", timeout=60)
    assert nothing is None
    found = re.search(r"rank\(s\) \[1\] of process group .* did not reach call #(\d+) within 2 s", message)
    assert found, message
    seq = int(found.group(1))  # building the buffers may have run collectives of its own
    assert f"This rank (0) is at #{seq}: all_gather torch.float32" in message, message  # what rank 0 was doing
    assert "allgather <- test_debug.py" in message  # and where it was called from
    assert f"agreed on was #{seq - 1}: all_gather" in message and "(the last call rank(s) [1] made" in message, message
    assert seconds < 10, seconds


def _skip_one_forward(model, batches) -> str:
    """Rank 0 runs an extra evaluation forward; then both train a step. Every rank must raise,
    naming the call where they diverged."""
    with _debug_mode(True, 20.0):
        m = copy.deepcopy(model)
        for block in m.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(m)
        x, y = batches[0]
        if dist.get_rank() == 0:
            with torch.no_grad():
                m(x)
        try:
            loss_fn(m, x, y).backward()
        except debug.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"


def test_a_skipped_forward_raises_on_every_rank() -> None:
    start = time.monotonic()
    messages = run_ranks(_skip_one_forward, 2, make_model(), make_batches(1), backend="gloo", timeout=60)
    assert time.monotonic() - start < 30
    for message in messages:
        assert "different collectives at call #" in message, message
        assert "rank(s) [0]: " in message and "rank(s) [1]: " in message, message
        # where each rank was: rank 0 gathering the first block for its second forward, rank 1
        # already gathering the second block for its first backward (same sizes: told apart by
        # the units' labels), each with the fsdp call that launched it
        lines = dict(re.findall(r"rank\(s\) \[(\d)\]: (.*)", message))
        assert lines["0"].startswith("all_gather") and "of fsdp unit 'blocks.0'" in lines["0"], message
        assert lines["1"].startswith("all_gather") and "of fsdp unit 'blocks.1'" in lines["1"], message
        assert all("unshard" in line.split("called from")[1] for line in lines.values()), message
        assert "The last call all ranks agreed on was #" in message
        assert "same calls in the same order" in message
    assert messages[0] == messages[1]


def _skip_one_save(path: str) -> str:
    """Rank 1 skips a checkpoint save (whose own collectives are DCP's) and goes on."""
    with _debug_mode(True, 20.0):
        buf, out = _buffers()
        try:
            if dist.get_rank() == 0:
                ckpt.save({"u": torch.arange(4.0)}, path)
            buf.allgather(0, out=out)
        except debug.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"


def test_a_skipped_save_raises_on_every_rank(tmp_path) -> None:
    path = str(tmp_path / "ck")
    messages = run_ranks(_skip_one_save, 2, path, backend="gloo", timeout=60)
    for message in messages:
        assert f"rank(s) [0]: fsdp.checkpoint.save {path!r}" in message, message
        assert "rank(s) [1]: all_gather" in message, message
    assert not (tmp_path / "ck").exists() and not (tmp_path / ("ck" + ckpt.PARTIAL)).exists()  # raised before DCP


def _debug_off_and_on_agree(model, batches) -> list:
    """Off (the default): the check is never called. On, with every rank doing the same: the
    same results, bit for bit."""
    real = debug.check

    def never(*args):
        raise AssertionError("debug.check called while the mode is off")

    results = []
    for enabled in (False, True):
        debug.check = real if enabled else never
        with _debug_mode(enabled, 20.0):
            m = copy.deepcopy(model)
            for block in m.blocks:
                fsdp.fully_shard(block)
            fsdp.fully_shard(m)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for x, y in batches:
                loss_fn(m, x, y).backward()
                opt.step()
                opt.zero_grad()
            results.append([p.full_tensor() for p in m.parameters()])
        debug.check = real
    return [all(torch.equal(a, b) for a, b in zip(*results))]


def test_debug_mode_off_is_not_called_and_on_changes_nothing() -> None:
    assert run_ranks(_debug_off_and_on_agree, 2, make_model(), make_batches(2), backend="gloo", timeout=60) == [[True]] * 2
