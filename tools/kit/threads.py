"""Several ranks as threads of this process: torch's threaded process group, real data moving.

    from tools.kit.threads import run_threaded

    results = run_threaded(fn, 4, model, batches)   # fn(*args) on ranks 0..3; their results by rank

Each thread joins a ``"threaded"`` default group (``torch.testing._internal``'s multi-threaded
process group: every collective is a copy between the threads' tensors, on whatever device they
are), runs ``fn(*args)`` and leaves its group. All ranks may use one device, so one GPU can run
a world of 4 with real all-gathers and reduce-scatters (not NCCL's, the group's own copies).
Threads share the global RNG and autograd state: build models before the call, pass them in, copy
inside ``fn``.

A rank that raises makes :func:`run_threaded` raise :class:`ThreadedRankError`, whose message is one
line, ``rank R of W (threaded) raised Type: message``, and whose ``details`` hold every failed
rank's traceback; a world that does not finish within ``timeout`` raises it too, naming the ranks
still running. The same launcher as ``tests/harness.py``'s ``"threaded"`` backend (tools may not
import the tests' harness), using private torch switches (thread isolation, the threaded group's
install): on a torch without them the error says which is missing.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


class ThreadedRankError(RuntimeError):
    """A threaded rank raised or hung; ``details``: the tracebacks of the ranks that failed."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def run_threaded(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``fn(*args)`` on ``world`` threaded ranks; their results by rank (see the module docstring)."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if isolation is None:
        raise ThreadedRankError(f"torch {torch.__version__} has no _set_thread_isolation_mode: "
                                "cannot run threaded ranks")
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}  # rank -> (one line, traceback)
    abandoned = threading.Event()
    store = dist.HashStore()

    def body(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - every rank's failure is reported
            if not isinstance(exc, SystemExit):  # SystemExit: woken by a peer's failure
                errors[rank] = (f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc())
            ProcessLocalGroup.exception_handle(exc)  # wake ranks blocked in a collective
        finally:
            if not abandoned.is_set():
                dist.destroy_process_group()

    isolation(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            ProcessLocalGroup.exception_handle(TimeoutError())  # release ranks waiting on peers
            for t in threads:
                t.join(1.0)
    finally:
        abandoned.set()
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        isolation(False)
    if errors:
        rank = min(errors)
        details = "\n".join(f"rank {r}:\n{errors[r][1]}" for r in sorted(errors))
        raise ThreadedRankError(f"rank {rank} of {world} (threaded) raised {errors[rank][0]}", details)
    if hung:
        raise ThreadedRankError(f"ranks {hung} of {world} (threaded) did not finish within {timeout:.0f} s")
    return [results[r] for r in range(world)]
