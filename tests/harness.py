"""Run one function on N ranks and collect each rank's result.

One entry point, :func:`run_ranks`, with three backends:

* ``"gloo"``: real processes talking gloo over loopback, their rendezvous store listening on
  127.0.0.1 only (``tests.models.rendezvous.loopback_store``). Spawning a process and importing torch
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
that does not finish within ``timeout`` seconds fails it with :class:`RankTimeout`; a gloo worker
process that dies or exits during a call fails it with :class:`RankDied`, naming the rank and the
signal or exit code.

Gloo workers end through :func:`dbuffer.teardown.shutdown` (barrier, destroy, ``os._exit``), so a
clean close exits 0. :func:`shutdown_pools` (``tests/conftest.py`` calls it at the end of the
session, and fails the run on a bad exit) returns how each worker ended, and also reports workers
found dead between calls.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist

from dbuffer.teardown import shutdown
from tests.models.rendezvous import loopback_store

# Loopback only: tests never talk to another host.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

__all__ = ["RankDied", "RankError", "RankTimeout", "WorkerExit", "run_ranks", "shutdown_pools"]

DEFAULT_TIMEOUT = 120.0
_GRACE_AFTER_ERROR = 2.0  # other ranks get this long to finish once one rank has failed
_EXIT_TIMEOUT = 30.0  # a worker told to stop must have exited by then


class RankError(RuntimeError):
    """A rank raised; the message holds the rank number and its traceback."""


class RankTimeout(RankError):
    """Some ranks did not finish in time (a hang, or a peer that died inside a collective)."""


class RankDied(RankError):
    """A gloo worker process ended during a call: a crash, a signal, an ``os._exit``."""


@dataclass(frozen=True)
class WorkerExit:
    """How one gloo worker process ended: ``exitcode`` as multiprocessing gives it (``-N``:
    killed by signal N), or None when it did not exit within ``_EXIT_TIMEOUT`` of being told to."""

    world_size: int
    rank: int
    exitcode: Optional[int]

    @property
    def clean(self) -> bool:
        return self.exitcode == 0

    def __str__(self) -> str:
        if self.exitcode is None:
            how = f"did not exit within {_EXIT_TIMEOUT:.0f} s of being told to stop (killed)"
        elif self.exitcode < 0:
            try:
                how = f"died with {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"died with signal {-self.exitcode}"
        else:
            how = f"exited with code {self.exitcode}"
        return f"rank {self.rank} of {self.world_size} (gloo) {how}"


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



@contextlib.contextmanager
def spy_collectives(*names: str) -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Record ``(collective, ranks of its group)`` for every ``dbuffer.collectives`` call named
    in ``names`` that this process makes inside the block (dbuffer.collectives is the only caller
    of c10d, so this sees all of fsdp's communication). The patch is process-wide: use it in gloo
    workers, not under the threaded backend, where every rank shares the module."""
    from dbuffer import collectives

    seen: list[tuple[str, tuple[int, ...]]] = []
    real = {name: getattr(collectives, name) for name in names}

    def spy(name: str):
        def run(*args, **kwargs):
            group = next(a for a in (*args, *kwargs.values()) if isinstance(a, dist.ProcessGroup))
            seen.append((name, tuple(dist.get_process_group_ranks(group))))
            return real[name](*args, **kwargs)

        return run

    for name in names:
        setattr(collectives, name, spy(name))
    try:
        yield seen
    finally:
        for name, fn in real.items():
            setattr(collectives, name, fn)

def _raise_first_error(errors: dict[int, str], what: str) -> None:
    rank = min(errors)
    others = f" (ranks {sorted(errors)} failed)" if len(errors) > 1 else ""
    raise RankError(f"rank {rank} of {what} raised{others}:\n{errors[rank]}")


# ----------------------------------------------------------------------------- gloo processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn, sys_path: list[str]) -> NoReturn:
    """Body of one gloo worker: join the group once, serve calls until told to stop, then leave
    through :func:`dbuffer.teardown.shutdown` (exit code 0 when told to stop, 1 when orphaned)."""
    sys.path[:] = sys_path
    torch.set_num_threads(1)
    # the rendezvous on loopback only (torch's tcp:// store would listen on every interface)
    dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank, world_size=world_size)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the test process is gone; peers may be too: no barrier
            shutdown(1, barrier=False)
        if message is None:
            break
        fn, args = message
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:  # report everything, including assertion failures
            conn.send(("error", traceback.format_exc()))
    shutdown(0)  # every worker was told to stop: they meet at the barrier


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
        deaths: dict[int, WorkerExit] = {}
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
                except (EOFError, OSError):  # the process is gone: how?
                    self.procs[rank].join(timeout=5)
                    deaths[rank] = WorkerExit(self.world_size, rank, self.procs[rank].exitcode)
                    deadline.shorten(_GRACE_AFTER_ERROR)
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
                    deadline.shorten(_GRACE_AFTER_ERROR)
        if pending or errors or deaths:
            self.close(kill=True)
        if deaths:
            also = "".join(f"\nrank {r} raised:\n{errors[r]}" for r in sorted(errors))
            raise RankDied(
                f"{', '.join(str(deaths[r]) for r in sorted(deaths))} during "
                f"{getattr(fn, '__name__', fn)!s}(); the worker pool was torn down and will be rebuilt{also}"
            )
        if errors:
            _raise_first_error(errors, f"{self.world_size} (gloo)")
        if pending:
            raise RankTimeout(
                f"ranks {sorted(pending)} of {self.world_size} (gloo) did not finish within "
                f"{timeout:.0f} s; the worker pool was torn down and will be rebuilt"
            )
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> list[WorkerExit]:
        """Stop the workers and return how they ended. ``kill``: at once, after a failed call (the
        test has already failed: only workers that were already dead are returned). Otherwise tell
        them to stop and return every worker's exit; if one is already dead, only it is returned
        and the others are killed (their teardown's barrier would wait for it)."""
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]
        exits = [WorkerExit(self.world_size, r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
        kill = kill or bool(exits)
        if not kill:
            for conn in self.conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = _Deadline(_EXIT_TIMEOUT)
        for rank, proc in enumerate(self.procs):
            if kill:
                proc.kill()
            proc.join(timeout=deadline.left())
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
                exits.append(WorkerExit(self.world_size, rank, None))
            elif not kill:
                exits.append(WorkerExit(self.world_size, rank, proc.exitcode))
        for conn in self.conns:
            conn.close()
        return sorted(exits, key=lambda e: e.rank)


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
_DIED_BETWEEN_CALLS: list[WorkerExit] = []  # reported by shutdown_pools


def _gloo_pool(world_size: int) -> _GlooPool:
    pool = _POOLS.get(world_size)
    if pool is not None and not all(p.is_alive() for p in pool.procs):
        _DIED_BETWEEN_CALLS.extend(e for e in pool.close() if not e.clean)
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = _GlooPool(world_size)
    return pool


def shutdown_pools(world_size: Optional[int] = None) -> list[WorkerExit]:
    """Stop the gloo workers (of every pool, or of ``world_size``'s) and return how each ended,
    by world size and rank, after any worker found dead between calls. Anything but exit code 0
    is a failure: ``tests/conftest.py`` fails the session on it."""
    chosen = [p for ws, p in sorted(_POOLS.items()) if world_size in (None, ws)]
    earlier = [e for e in _DIED_BETWEEN_CALLS if world_size in (None, e.world_size)]
    for e in earlier:
        _DIED_BETWEEN_CALLS.remove(e)
    return earlier + [e for pool in chosen for e in pool.close()]


# ----------------------------------------------------------------------------- threads


def _run_threaded(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    from tests.models.threads import launch

    outcome = launch(fn, world_size, args, timeout, timeout_error=RankTimeout)
    if outcome.errors:
        _raise_first_error({r: tb for r, (_, tb) in outcome.errors.items()}, f"{world_size} (threaded)")
    if outcome.hung:
        raise RankTimeout(
            f"ranks {outcome.hung} of {world_size} (threaded) did not finish within {timeout:.0f} s"
        )
    return [outcome.results[r] for r in range(world_size)]


# ----------------------------------------------------------------------------- fake


def _run_fake(fn: Callable[..., Any], world_size: int, rank: int, args: tuple) -> Any:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"fake_rank must be in [0, {world_size}), got {rank}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        return fn(*args)
    finally:
        shutdown(collect=False)  # drops torch's caches of the fake mesh; a fake group owns no threads

