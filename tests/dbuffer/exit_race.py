"""Reproduce the abort at exit of a gloo rank, many times, from one ``import torch``.

    python tests/dbuffer/exit_race.py [--trials N] [--unguarded-trials U] [--parallel P] [--forced] MODE [MODE ...]

Each trial forks two ranks. They join a gloo group, do DTensor work on a 1-D ``DeviceMesh`` (after
which only torch's caches hold the mesh and, through it, the process group), an all-reduce, a
broadcast and ``all_gather_object`` calls, end as MODE says, and leave by ``sys.exit`` through a
full interpreter finalisation, as a spawned rank does:

* ``destroy``: ``dist.destroy_process_group()`` alone (what every tool did before), then
  ``dbuffer.teardown.exit_guard`` at exit (``import dbuffer`` registers it).
* ``exit``: what a framework's script does: the mesh and a DTensor kept in a global, no
  ``destroy_process_group``, then the exit guard.
* ``kept-destroy``: the mesh and a DTensor kept, ``destroy_process_group``, then the exit guard
  (which can free nothing here: only its release of the GIL serves the waiting worker).
* ``unguarded-destroy``, ``unguarded-exit``: the same without the exit guard (unregistered): the
  recipes as they abort.
* ``shutdown``: ``dbuffer.teardown.shutdown()``, then finalisation; the rank exits 3 if shutdown
  could not confirm that every process group is garbage, 4 if the process still has more OS
  threads than before ``init_process_group`` (gloo's, the store's).
* ``shutdown-exit``: the mesh is also kept in a global (nothing can free it), then
  ``dbuffer.teardown.shutdown(0)``.

The race: a gloo worker thread drops a finished work; the work's tensors hold their Python
objects, so it asks for the GIL. If it is still waiting when finalisation begins, ``take_gil``
ends the thread with ``pthread_exit`` inside the work's ``noexcept`` destructor, and
``std::terminate`` aborts the process (SIGABRT). Unaided the window is narrow: the main thread
must keep the GIL from the worker's request until finalisation starts (dropping a tensor, any
blocking call, or a 5 ms switch request hands it over first; once finalisation has started, torch
skips the decref instead). About one launch in four of the plain recipe (spawned ranks, a kept
mesh, ``destroy_process_group``) hits it on this 2-core machine.

``--forced`` makes it likely in every trial without changing the mechanism (not certain: under
load, some forced trials still end cleanly, the worker having got the GIL before finalisation): rank 0 leaves one
all-gather unwaited (rank 1 joins it 0.3 s after rank 0 starts its teardown), runs the other
``atexit`` hooks early (the exit guard, where the mode has it, is registered again to run at
exit, as it does last in a real exit), and spins holding the GIL (switch interval 60 s, gc off)
until gloo's worker, done with the all-gather, has asked for the GIL (a new Python thread state
appears). A global whose ``__del__`` sleeps then releases the GIL during finalisation, as the
destruction of a mesh or group that lived until then does. After :func:`shutdown` no gloo
thread is left, so there is nothing to wait for and the spin is skipped.

Forking after importing torch and ``torch._dynamo`` (which DTensor imports on first use; no thread
exists yet) makes a trial cost a fraction of a fresh interpreter; ``P`` trials run at once, of any of the modes
given (a mode's trials start in order, the next mode's as slots free up).
(Imported before ``init_process_group``, ``torch.distributed.nn.functional`` captures no group
here; ``test_teardown.py`` covers that case in-process.) Prints one JSON line per mode: trials,
aborted (trials in which a rank died of SIGABRT), failed (other bad exits, as "trial/rank:
status"), as each mode's last trial ends.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (DTensor imports it on first use: once here, not per rank)
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402

from dbuffer.teardown import exit_guard, shutdown  # noqa: E402

MODES = ("destroy", "exit", "kept-destroy", "unguarded-destroy", "unguarded-exit", "shutdown", "shutdown-exit")
WORLD = 2
_KEPT: list = []  # shutdown-exit: a mesh that outlives everything
_RELEASER: object = None  # --forced: see _ReleaseGILWhenFinalised


def _thread_states() -> int:
    """Python thread states of this interpreter; pybind makes one for a C++ thread taking the GIL."""
    api = ctypes.pythonapi  # a PyDLL: calls keep the GIL
    api.PyInterpreterState_Get.restype = ctypes.c_void_p
    api.PyInterpreterState_ThreadHead.argtypes = api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    api.PyInterpreterState_ThreadHead.restype = api.PyThreadState_Next.restype = ctypes.c_void_p
    count, state = 0, api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get())
    while state:
        count, state = count + 1, api.PyThreadState_Next(state)
    return count


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _ReleaseGILWhenFinalised:
    """Kept in a global: its ``__del__`` runs while the interpreter clears modules, and releases
    the GIL for up to 10 s, time for a waiting gloo worker to be scheduled (it aborts the process)."""

    def __init__(self) -> None:
        self.sleep = time.sleep  # module globals may be None by the time __del__ runs

    def __del__(self) -> None:
        for _ in range(100):
            self.sleep(0.1)


def _work(rank: int, mode: str) -> None:
    """The recipe's communication; its tensors die with this frame (dropping a tensor releases
    the GIL, which would hand it to a waiting gloo worker too early in ``--forced`` runs)."""
    mesh = init_device_mesh("cpu", (WORLD,))
    full = torch.arange(64.0).reshape(8, 8)
    x = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal((x * 2).redistribute(mesh, [Replicate()]).to_local(), full * 2)
    if mode in ("shutdown-exit", "exit", "kept-destroy", "unguarded-exit"):
        _KEPT.extend([mesh, x])  # as a framework keeps its model, its DTensors and the mesh
    del x, mesh  # from here on only torch's caches (and _KEPT) hold the mesh
    t = torch.full((256,), float(rank))
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    for i in range(4):
        out: list = [None] * WORLD
        dist.all_gather_object(out, {"rank": rank, "i": i, "payload": list(range(64))})


def _rank(rank: int, port: int, mode: str, forced: bool, go: tuple[int, int]) -> int:
    """One rank's work and teardown; returns its exit status (``sys.exit`` follows)."""
    torch.set_num_threads(1)
    guarded = mode in ("destroy", "exit", "kept-destroy")
    if forced or not guarded:
        atexit.unregister(exit_guard)  # forced: registered again where it would run, last
    threads = _os_threads()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    _work(rank, mode)
    states = _thread_states()
    if forced:  # rank 0 leaves an all-gather unwaited; rank 1 joins it as rank 0 tears down
        outputs = [torch.zeros(256) for _ in range(WORLD)]
        if rank == 0:
            sys.setswitchinterval(60.0)  # from now on this thread keeps the GIL unless it blocks
            gc.collect()  # (or a collection frees something whose destructor releases it)
            gc.disable()
            dist.all_gather(outputs, torch.zeros(256), async_op=True)
            del outputs  # only the work holds the tensors, and they hold their Python objects
            os.write(go[1], b"x")
        else:
            select.select([go[0]], [], [], 30.0)
            time.sleep(0.3)  # by then rank 0's destroy_process_group has returned (or its
            # shutdown waits in the barrier, which waits for this all-gather)
            dist.all_gather(outputs, torch.ones(256))
    status = 0
    if mode in ("destroy", "kept-destroy", "unguarded-destroy"):
        dist.destroy_process_group()
    elif mode in ("exit", "unguarded-exit"):
        pass  # the framework ends without touching torch.distributed
    elif mode == "shutdown":
        released = shutdown()
        status = 0 if released and _os_threads() == threads else 3 if not released else 4
    else:
        shutdown(0)
    if forced and rank == 0 and _os_threads() > threads:  # gloo's threads outlived the teardown
        atexit._run_exitfuncs()  # now, not during the exit: some of them block, releasing the GIL
        if guarded:
            atexit.register(exit_guard)  # the last hook of a real exit: the only one left
        deadline = time.monotonic() + 30.0
        while _thread_states() == states and time.monotonic() < deadline:
            pass  # holding the GIL while gloo's worker finishes the all-gather and asks for it
        global _RELEASER
        _RELEASER = _ReleaseGILWhenFinalised()
    return status


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_trial(mode: str, forced: bool) -> tuple[list[int], tuple[int, int]]:
    """Fork one trial's ranks; in a forked rank, raise SystemExit instead of returning."""
    port, go, pids = _free_port(), os.pipe(), []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            try:
                status = _rank(rank, port, mode, forced, go)
            except BaseException:
                import traceback

                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            raise SystemExit(status)  # unwinds to the top: a full finalisation
        pids.append(pid)
    return pids, go


def _trials(modes: list[str], trials: dict[str, int], parallel: int, forced: bool):
    """Run ``trials[mode]`` trials of each mode, at most ``parallel`` at once across the modes (in the
    order given: a mode's trials start before the next mode's); yields each mode's result (with
    the seconds from its first trial's start to its last one's end) as its last trial ends."""
    queue = [(mode, trial) for mode in modes for trial in range(trials[mode])]
    results = {mode: {"mode": mode, "forced": forced, "trials": trials[mode], "aborted": 0, "failed": []} for mode in modes}
    started, left = {}, dict(trials)
    running: dict[int, tuple[tuple[str, int], int]] = {}  # pid -> ((mode, trial), rank)
    statuses: dict[tuple[str, int], dict[int, int]] = {}  # (mode, trial) -> rank -> wait status
    pipes = {}
    while queue or running:
        while queue and len(pipes) < parallel:
            mode, trial = queue.pop(0)
            started.setdefault(mode, time.monotonic())
            pids, pipes[mode, trial] = _start_trial(mode, forced)
            running.update({pid: ((mode, trial), rank) for rank, pid in enumerate(pids)})
            statuses[mode, trial] = {}
        pid, status = os.wait()
        if pid not in running:
            continue
        job, rank = running.pop(pid)
        mode, trial = job
        statuses[job][rank] = status
        if len(statuses[job]) < WORLD:
            continue
        go = pipes.pop(job)
        os.close(go[0])
        os.close(go[1])
        by_rank = [statuses[job][r] for r in range(WORLD)]
        abort = [os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGABRT for s in by_rank]
        results[mode]["aborted"] += any(abort)
        results[mode]["failed"] += [f"{trial}/{r}: {_describe(s)}" for r, s in enumerate(by_rank) if s and not abort[r]]
        left[mode] -= 1
        if not left[mode]:
            yield {**results[mode], "seconds": round(time.monotonic() - started[mode], 1)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="+", choices=MODES)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--unguarded-trials", type=int, default=None, help="trials of the unguarded modes (default: --trials)")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--forced", action="store_true", help="make every destroy-only trial abort (see above)")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    unguarded = args.trials if args.unguarded_trials is None else args.unguarded_trials
    trials = {mode: unguarded if mode.startswith("unguarded") else args.trials for mode in args.modes}
    for result in _trials(args.modes, trials, args.parallel, args.forced):
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
