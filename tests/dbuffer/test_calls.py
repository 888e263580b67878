"""A failed collective names itself (dbuffer/calls.py): the call, its number and bytes, the label
it ran under, and whether the other ranks reported; labels nest and never leak."""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist

from dbuffer import CallLabel, CollectiveError, calls, collectives
from tests.harness import run_ranks


def _rank_1_skips_an_all_reduce() -> list[str]:
    """Rank 0 all-reduces (once waited for at the call, once through Pending.wait) on a group
    with a 2 s timeout; rank 1 never joins. Rank 0's errors, as text."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    calls.REPORT_WAIT, was = 1.0, calls.REPORT_WAIT
    found = []
    try:
        t = torch.ones(4)
        collectives.all_reduce(t, "sum", group)  # #0: both ranks
        if dist.get_rank() == 1:
            dist.barrier()  # on the default group: blocked elsewhere while rank 0 times out
            return found
        for async_op in (False, True):
            try:
                with CallLabel("the test's all-reduce"):
                    pending = collectives.all_reduce(t, "sum", group, async_op=async_op)
                pending.wait()
            except CollectiveError as exc:
                assert isinstance(exc, dist.DistBackendError) and isinstance(exc.__cause__, RuntimeError)
                found.append(str(exc))
        dist.barrier()
        return found
    finally:
        calls.REPORT_WAIT = was
        dist.destroy_process_group(group)


def test_a_failed_collective_names_its_call_label_bytes_and_the_silent_rank() -> None:
    found, nothing = run_ranks(_rank_1_skips_an_all_reduce, 2, backend="gloo", timeout=60)
    assert nothing == [] and len(found) == 2, found
    for seq, message in zip((1, 2), found):  # the sync call, then the async one's wait
        assert message.startswith(f"all_reduce #{seq} of the test's all-reduce, 16 B in, 16 B out on process group"), message
        assert re.search(r"timed out|timeout", message, re.IGNORECASE), message  # gloo's, as the cause
        assert "rank(s) [1]: no report within 1 s" in message, message
        assert "DBUFFER_DEBUG_COLLECTIVES=1" in message, message


def test_labels_nest_and_are_put_back() -> None:
    outer, inner = CallLabel("outer"), CallLabel("inner")
    assert calls.current_label() is None
    with outer:
        with inner:
            assert calls.current_label() is inner
        with outer:  # re-entered
            assert calls.current_label() is outer
        assert calls.current_label() is outer
    assert calls.current_label() is None
    try:
        with inner:
            raise ValueError("inside")
    except ValueError:
        pass
    assert calls.current_label() is None


def test_a_pending_without_a_call_raises_the_backend_error_as_it_is() -> None:
    class Broken:
        def wait(self):
            raise RuntimeError("backend says no")

    pending = calls.Pending([Broken()], lambda: None)
    try:
        pending.wait()
    except RuntimeError as exc:
        assert type(exc) is RuntimeError and str(exc) == "backend says no"
    else:
        raise AssertionError("expected the backend's error")
