"""Run one function on N ranks and collect each rank's result.

One entry point, :func:`run_ranks`, with three backends:

* ``"gloo"``: real processes talking gloo over loopback. Spawning a process and importing torch
  costs seconds on a small machine, so workers are kept alive across tests in one pool per world
  size. A pool whose test failed or hung is torn down and rebuilt on next use, so no test inherits
  a half-finished collective.
* ``"threaded"``: torch's threaded process group; N ranks are threads of this process moving real
  data. Fast, and the only way to run worlds of 4 and 8 on two cores. The ranks share the global
  RNG and autograd state: build models before calling, pass them in, and copy inside ``fn``.
* ``"fake"``: torch's fake process group; this process plays rank ``fake_rank`` of a world of any
  size. Shapes and memory are real, collective *values* are meaningless.

``fn`` runs with the default process group initialised (``dist.get_rank()`` works) and receives
``*args``. For gloo it must be picklable by reference (a module-level function) and so must its
arguments and result. An exception on any rank fails the call with that rank's traceback; a rank
that does not finish within ``timeout`` seconds fails it with :class:`RankTimeout`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

# Loopback only: tests never talk to another host.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

__all__ = ["RankError", "RankTimeout", "run_ranks", "shutdown_pools"]

DEFAULT_TIMEOUT = 120.0
_GRACE_AFTER_ERROR = 2.0  # other ranks get this long to finish once one rank has failed


class RankError(RuntimeError):
    """A rank raised; the message holds the rank number and its traceback."""


class RankTimeout(RankError):
    """Some ranks did not finish in time (a hang, or a peer that died inside a collective)."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
    fake_rank: int = 0,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of a ``world_size`` world; return the results by rank.

    With ``backend="fake"`` only rank ``fake_rank`` runs, and the list holds its one result.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "gloo":
        return _gloo_pool(world_size).run(fn, args, timeout)
    if backend == "threaded":
        return _run_threaded(fn, world_size, args, timeout)
    if backend == "fake":
        return [_run_fake(fn, world_size, fake_rank, args)]
    raise ValueError(f"backend must be 'gloo', 'threaded' or 'fake', got {backend!r}")


def _raise_first_error(errors: dict[int, str], what: str) -> None:
    rank = min(errors)
    others = f" (ranks {sorted(errors)} failed)" if len(errors) > 1 else ""
    raise RankError(f"rank {rank} of {what} raised{others}:\n{errors[rank]}")


# ----------------------------------------------------------------------------- gloo processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn, sys_path: list[str]) -> None:
    """Body of one gloo worker: join the group once, then serve calls until told to stop."""
    sys.path[:] = sys_path
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args = message
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:  # report everything, including assertion failures
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class _GlooPool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world_size = world_size
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, child, list(sys.path)),
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = _Deadline(timeout)
        pending = set(range(self.world_size))
        while pending:
            ready = mp.connection.wait([self.conns[r] for r in pending], deadline.left())
            if not ready:
                break
            for conn in ready:
                rank = self.conns.index(conn)
                pending.discard(rank)
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", f"worker process died (exit code {self.procs[rank].exitcode})"
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
                    deadline.shorten(_GRACE_AFTER_ERROR)
        if pending or errors:
            self.close(kill=True)
        if errors:
            _raise_first_error(errors, f"{self.world_size} (gloo)")
        if pending:
            raise RankTimeout(
                f"ranks {sorted(pending)} of {self.world_size} (gloo) did not finish within "
                f"{timeout:.0f} s; the worker pool was torn down and will be rebuilt"
            )
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        _POOLS.pop(self.world_size, None)
        for conn, proc in zip(self.conns, self.procs):
            if not kill:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class _Deadline:
    def __init__(self, seconds: float) -> None:
        import time

        self._clock = time.monotonic
        self.at = self._clock() + seconds

    def left(self) -> float:
        return max(0.0, self.at - self._clock())

    def shorten(self, seconds: float) -> None:
        self.at = min(self.at, self._clock() + seconds)


_POOLS: dict[int, _GlooPool] = {}


def _gloo_pool(world_size: int) -> _GlooPool:
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world_size] = _GlooPool(world_size)
    return pool


def shutdown_pools() -> None:
    """Stop every gloo worker (called at the end of the test session)."""
    for pool in list(_POOLS.values()):
        pool.close()


# ----------------------------------------------------------------------------- threads


def _run_threaded(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    hung: list[int] = []
    abandoned = threading.Event()
    store = dist.HashStore()

    def body(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(*args)
        except BaseException as exc:
            if not isinstance(exc, SystemExit):  # SystemExit: woken by a peer's failure or timeout
                errors[rank] = traceback.format_exc()
            ProcessLocalGroup.exception_handle(exc)  # wake ranks blocked in a collective
        finally:
            if not abandoned.is_set():  # a thread released after a timeout must not touch
                dist.destroy_process_group()  # whatever process group exists by then

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [
            threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in threads:
            t.start()
        deadline = _Deadline(timeout)
        for t in threads:
            t.join(deadline.left())
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            ProcessLocalGroup.exception_handle(RankTimeout())  # release ranks waiting on peers
            for t in threads:
                t.join(1.0)
    finally:
        abandoned.set()
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        _raise_first_error(errors, f"{world_size} (threaded)")
    if hung:
        raise RankTimeout(
            f"ranks {hung} of {world_size} (threaded) did not finish within {timeout:.0f} s"
        )
    return [results[r] for r in range(world_size)]


# ----------------------------------------------------------------------------- fake


def _run_fake(fn: Callable[..., Any], world_size: int, rank: int, args: tuple) -> Any:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"fake_rank must be in [0, {world_size}), got {rank}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()

