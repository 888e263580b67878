"""Several ranks as threads of this process: torch's threaded process group, real data moving.

    from tests.models.threads import run_threaded

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
still running. :func:`launch` is the launcher itself, which ``tests/harness.py``'s ``"threaded"``
backend uses too (tools may not import the tests' harness; both may import this folder), with what the threaded group needs on
torch 2.11 (:func:`threaded_world_compat`, :func:`restore_autograd_threads`, the thread-cache and
CUDA-guard steps). It uses private torch switches (thread isolation, the threaded group's
install): on a torch without them the error says which is missing.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from dbuffer.teardown import clear_dtensor_caches

__all__ = ["Outcome", "ThreadedRankError", "launch", "restore_autograd_threads", "run_threaded",
           "threaded_world_compat"]


class ThreadedRankError(RuntimeError):
    """A threaded rank raised or hung; ``details``: the tracebacks of the ranks that failed."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


@dataclass
class Outcome:
    """How a threaded world ended: results and failures (one line, traceback) by rank, and the
    ranks still running at the deadline."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)


def run_threaded(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``fn(*args)`` on ``world`` threaded ranks; their results by rank (see the module docstring)."""
    outcome = launch(fn, world, args, timeout)
    if outcome.errors:
        errors = outcome.errors
        rank = min(errors)
        details = "\n".join(f"rank {r}:\n{errors[r][1]}" for r in sorted(errors))
        raise ThreadedRankError(f"rank {rank} of {world} (threaded) raised {errors[rank][0]}", details)
    if outcome.hung:
        raise ThreadedRankError(f"ranks {outcome.hung} of {world} (threaded) did not finish within {timeout:.0f} s")
    return [outcome.results[r] for r in range(world)]


def launch(fn: Callable[..., Any], world: int, args: tuple, timeout: float,
           timeout_error: Callable[[], BaseException] = TimeoutError) -> Outcome:
    """Run ``fn(*args)`` on ``world`` rank threads of one threaded default group and report how
    each ended; raises nothing for a rank's failure (the callers word it). ``timeout_error``
    builds the exception that wakes ranks still waiting on peers at the deadline."""
    from torch.testing._internal.distributed import multi_threaded_pg
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if isolation is None:
        raise ThreadedRankError(f"torch {torch.__version__} has no _set_thread_isolation_mode: "
                                "cannot run threaded ranks")
    threaded_world_compat(multi_threaded_pg)
    _set_cuda_guard_once()
    # DTensor's process-wide redistribute caches key on meshes by value, and a mesh of this run
    # equals one of an earlier run: torch 2.11 would reuse a plan holding that run's (reset)
    # groups, whose collectives then pair ranks wrongly. Each run starts without them.
    clear_dtensor_caches()
    outcome = Outcome()
    abandoned = threading.Event()
    store = dist.HashStore()

    def body(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            outcome.results[rank] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - every rank's failure is reported
            if not isinstance(exc, SystemExit):  # SystemExit: woken by a peer's failure or timeout
                outcome.errors[rank] = (f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc)
                                        else type(exc).__name__, traceback.format_exc())
            ProcessLocalGroup.exception_handle(exc)  # wake ranks blocked in a collective
        finally:
            # Not dbuffer.teardown.shutdown: this rank's group is thread-local and has no worker
            # threads, while shutdown is process-wide (it clears torch's caches under the other
            # ranks' feet, and its barrier would wait for a rank that failed).
            if not abandoned.is_set():  # a thread released after a timeout must not touch
                dist.destroy_process_group()  # whatever process group exists by then
            _drop_thread_caches()

    isolation(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        outcome.hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if outcome.hung:
            ProcessLocalGroup.exception_handle(timeout_error())  # release ranks waiting on peers
            for t in threads:
                t.join(1.0)
    finally:
        abandoned.set()
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        restore_autograd_threads(multi_threaded_pg)
        isolation(False)
    return outcome


def threaded_world_compat(module: Any) -> None:
    """Make torch's threaded test group (``module``: ``multi_threaded_pg``) match the
    ``torch.distributed`` it runs under. torch 2.11's ``destroy_process_group`` clears
    ``_world.comms`` (the torchcomm communicators), which its own per-thread world
    (``ThreadLocalWorld``) does not have; here each thread gets an empty list of its own, as
    torch 2.13 gives it. Nothing where the attribute exists."""
    world = module.ThreadLocalWorld
    if hasattr(world, "comms"):
        return

    def comms(self) -> list:
        local = world._world
        if not hasattr(local, "comms"):
            local.comms = []
        return local.comms

    world.comms = property(comms)


def restore_autograd_threads(module: Any) -> None:
    """torch 2.11's ``_uninstall_threaded_pg`` leaves autograd's device threads off (the
    install turned them off); restore them as torch 2.13's uninstall does. Nothing where the
    uninstall already did (``module._ctx_manager`` is None then)."""
    ctx = getattr(module, "_ctx_manager", None)
    if ctx is not None:
        ctx.__exit__(None, None, None)
        module._ctx_manager = None


_THREAD_CACHES_LOCK = threading.Lock()


def _drop_thread_caches() -> None:
    """Empty this rank thread's DTensor fast-path sharding cache (thread-local) before the
    thread ends, one rank at a time.

    Otherwise each thread's cache is destroyed as the thread exits, under a process-wide C++
    mutex, and destroying a cached tensor releases the GIL: with torch 2.11, two rank threads
    ending together deadlock (one holds the mutex and waits for the GIL, the other holds the GIL
    and waits for the mutex). Emptied here, under a lock that serialises the ranks, nothing is
    left to destroy at exit."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        with _THREAD_CACHES_LOCK:
            clear()


def _set_cuda_guard_once() -> None:
    """Install the no-op CUDA device guard once, here, before the rank threads start.

    Without a usable GPU, every ``FakeTensorMode`` entry (DTensor's sharding propagation enters
    one for each op it has not seen) calls ``torch._C._ensureCUDADeviceGuardSet()``, which with
    a CUDA build of torch 2.11 crashes (SIGSEGV) when rank threads first call it together. Once
    set, later calls find it set. Nothing on a machine with a GPU (torch does not call it then)."""
    if not torch.cuda.is_available():
        torch._C._ensureCUDADeviceGuardSet()
