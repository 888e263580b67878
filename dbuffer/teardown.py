r"""Leave a distributed run cleanly: the one place where a process tears down ``torch.distributed``.

Every process this project starts (the tools' ranks, the test harness's gloo workers) ends through
:func:`shutdown` instead of calling ``dist.destroy_process_group()`` itself.

The failure it prevents: a gloo rank whose output is complete dies with SIGABRT ("terminate
called without an active exception"). A core dump of an aborted rank shows the main thread in
``Py_FinalizeEx`` and a gloo worker thread in ``~AsyncAllgatherWork`` (an ``all_gather_object``'s
work; DCP's collectives do the same) -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
``pthread_exit``: the work's tensors hold their Python objects, so dropping them needs the GIL; a
thread still waiting for it when finalisation begins is ended with ``pthread_exit``, whose forced
unwind meets the ``noexcept`` destructor, and ``std::terminate`` aborts the process.

That needs gloo's threads alive at exit, and after ``destroy_process_group()`` they are:
``torch.distributed`` drops its own references, but a ``DeviceMesh`` holds its groups
(``DeviceMesh._pg_registry``), and in torch 2.13 module-level caches keep the mesh after any
DTensor work:

* ``torch.distributed.tensor._redistribute._gen_transform_infos`` (``functools.cache`` keyed by
  ``DTensorSpec``\ s, which hold the mesh);
* ``torch.distributed.tensor._redistribute._planner_cache`` (each cached planner holds the mesh);
* ``torch.distributed.tensor._collective_utils.MeshTopoInfo.build_from_mesh`` (``lru_cache``
  keyed by the mesh);
* the C++ fast-path sharding-propagation cache (``torch._C._clear_DTensor_sharding_propagator_cache``);
* ``ShardingPropagator.propagate_op_sharding`` (a thread-local ``lru_cache``) and
  ``ShardingPropagator._propagate_tensor_meta_cached`` (keys and values hold ``DTensorSpec``\ s).

A group is also held without any mesh by ``torch.distributed.nn.functional``, whose functions
default to ``group=group.WORLD`` evaluated at import, when that import comes after
``init_process_group`` (see :func:`_unpin_default_groups`). ``_mesh_resources.mesh_stack`` holds a
mesh only inside ``with mesh:``.

What :func:`shutdown` guarantees, in order:

1. ``barrier``: every rank has reached it, and gloo's barrier first waits for all work this rank
   queued, so no peer is still sending and no collective is in flight. Waiting releases the GIL,
   so a worker finishing a work drops its tensors now.
2. Every group is destroyed, the caches above are cleared, the captured defaults reset, and (if a
   group is still referenced) ``gc.collect()`` runs: the last reference to each ``ProcessGroup``
   drops here, in a live interpreter, and its destructor (which releases the GIL) joins gloo's
   threads. Weak references to every group tell whether that happened: the return value
   (``tests/dbuffer/exit_race.py`` also checks, in real gloo ranks, that the OS thread count is
   back to what it was before ``init_process_group``).
3. With ``exit_code``, stdout and stderr are flushed and the process leaves through ``os._exit``:
   the interpreter never finalises, so not even a group that something else still holds (a mesh
   in a global, a traceback's frames, a cache a later torch adds) can abort the exit. ``atexit``
   handlers do not run: close your files first.

A process that never calls :func:`shutdown` (a framework's script: Hugging Face's ``Trainer``,
Lightning ``Fabric``, accelerate, which end as they like, destroying the process group or not,
keeping the model, its DTensors and the mesh in globals) is covered by :func:`exit_guard`, which
``import dbuffer`` registers with ``atexit``. Registered that early, it runs after every handler
registered later (``atexit`` runs them in reverse), just before the interpreter starts to
finalise, and does what (2) does without the barrier (a peer may have left already). Where a
group is still held after that (a model alive in a global keeps its mesh, which keeps its
groups), gloo's threads are alive, and the guard releases the GIL for 50 ms (a sleep): a worker
that finished its last work and asked for the GIL to drop it (within microseconds of the work's
end, the last collective having returned) is served then, in a live interpreter, and the exit
goes on. What is left: a collective still in flight at exit (an ``async_op=True`` work never
waited on, finishing after the guard), or a worker not scheduled for those 50 ms, can still hit
the race; :func:`shutdown` (whose barrier waits for every work) is the exit without it.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from typing import NoReturn, Optional, overload

import torch
import torch.distributed as dist

__all__ = ["clear_dtensor_caches", "exit_guard", "shutdown"]

_SERVE_WAITING_WORKERS = 0.05  # seconds the exit guard releases the GIL for while gloo's threads live


def clear_dtensor_caches() -> None:
    """Drop every DTensor cache known to hold a ``DeviceMesh`` (see the module docstring).

    Each is private torch API, looked up defensively: a cache torch renames is skipped here, and
    :func:`shutdown`'s weak-reference check (and its test) then reports the group as still alive.
    Only the calling thread's part of the thread-local Python sharding cache is cleared.
    """
    from torch.distributed.tensor import _collective_utils, _redistribute, _sharding_prop
    from torch.distributed.tensor._api import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = (
        getattr(_redistribute._gen_transform_infos, "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(_collective_utils.MeshTopoInfo.build_from_mesh, "cache_clear", None),
        getattr(propagator.propagate_op_sharding, "cache_clear", None),
        getattr(_sharding_prop.ShardingPropagator._propagate_tensor_meta_cached, "cache_clear", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
    )
    for clear in clears:
        if clear is not None:
            clear()


def _unpin_default_groups() -> None:
    """Replace the process groups ``torch.distributed.nn.functional``'s defaults captured by None.

    Its functions are declared ``group=group.WORLD``, evaluated at import. Imported after
    ``init_process_group`` (``autograd.Function.apply`` imports ``torch._dynamo`` on first use,
    which imports ``torch.distributed.fsdp``, ``_shard``, then this module: any first DTensor
    ``from_local`` does), they hold that default group forever. Called once every group is
    destroyed, so each group found there is stale; ``None`` is what they hold when imported
    before ``init_process_group``, and means the same: the default group of the moment.
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


@overload
def shutdown(exit_code: None = None, *, barrier: bool = True, collect: bool = True) -> bool: ...
@overload
def shutdown(exit_code: int, *, barrier: bool = True, collect: bool = True) -> NoReturn: ...


def shutdown(exit_code: Optional[int] = None, *, barrier: bool = True, collect: bool = True) -> bool:
    """End this process's part in ``torch.distributed``; with ``exit_code``, end the process too.

    Returns True when every process group that existed at the call is now garbage (so its gloo
    threads are joined), False when something outside torch's caches still holds one (a live
    mesh, a module sharded on it). ``barrier=False`` skips the barrier: use it on error paths,
    where a peer may never arrive. ``collect=False`` skips the ``gc.collect()`` that frees groups
    held in reference cycles (a tenth of a second in a big process; ``tools/plan_memory.py`` plans
    in a loop on fake groups, which own no threads). A failed barrier does not stop the teardown:
    it is re-raised afterwards (``exit_code=None``) or turns exit code 0 into 1. Safe to call
    with no group (it clears the caches, then returns True or exits).
    """
    failure: Optional[BaseException] = None
    groups: list[weakref.ReferenceType] = []
    if dist.is_available() and dist.is_initialized():
        groups = [weakref.ref(pg) for pg in dist.distributed_c10d._world.pg_map]
        if barrier and dist.get_world_size() > 1:
            try:
                dist.barrier()
            except Exception as exc:  # a peer died or timed out: still tear down what is ours
                failure = exc
        dist.destroy_process_group()
    clear_dtensor_caches()
    _unpin_default_groups()
    if collect and any(ref() is not None for ref in groups):
        gc.collect()  # meshes and modules in reference cycles
    released = all(ref() is None for ref in groups)
    if exit_code is None:
        if failure is not None:
            raise failure
        return released
    if failure is not None:
        print(f"dbuffer.teardown.shutdown: barrier failed: {failure!r}", file=sys.stderr)
        exit_code = exit_code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or replaced by None
            pass
    os._exit(exit_code)


def exit_guard() -> None:
    """What ``import dbuffer`` registers with ``atexit``: leave ``torch.distributed`` so that
    interpreter finalisation cannot abort (see the module docstring). Never raises."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a backend that fails to shut down: the rest still helps
        pass
    try:
        clear_dtensor_caches()
        _unpin_default_groups()
        if _gloo_threads():
            gc.collect()  # meshes and modules in reference cycles
        if _gloo_threads():  # a group something still holds: a worker may be waiting for the GIL
            time.sleep(_SERVE_WAITING_WORKERS)
    except Exception:
        pass


def _gloo_threads() -> bool:
    """Whether gloo's worker threads are alive in this process (Linux names them; elsewhere
    assumed alive)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().startswith("pt_gloo"):
                    return True
        except OSError:
            continue
    return False
