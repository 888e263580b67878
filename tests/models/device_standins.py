"""Stand-ins for what only a GPU does, so that CPU tests take the branches a GPU takes.

A branch that only a GPU takes is a branch no test takes; each device-dependent decision goes
through a seam, and these drive the seams on the CPU:

* :func:`moving_from_local`: ``DTensor.from_local`` as it behaves on a mesh whose device type
  differs from its local tensor's (a host buffer on a CUDA mesh): it wraps a *copy*. A view-maker
  that goes through it stops being a view, as it would on a GPU (``dbuffer.view`` says why
  views are built without it).
* :class:`DeferredTransfers` (with :func:`deferred_transfers`): CPU offload's
  :class:`~fsdp.compose.offload.HostTransfers` with "pinned" host memory on the CPU and every
  non-blocking copy deferred to its completion: a device-to-host copy poisons its destination
  (NaN) until the host synchronizes the copy, and a host-to-device copy checks, when
  synchronized, that the host neither freed its source meanwhile (its storage gone, or moved:
  a source freed and given storage again at the same address escapes this) nor wrote it. Code
  that reads a host buffer before waiting for the copy into it, or frees or writes one a copy may
  still read, then fails on the CPU as it would (silently, at random) on a GPU.
* :class:`SyncCounter`: a dispatch mode counting the aten ops that need a device tensor's value on
  the host (``item``, ``nonzero``, ...): each one would stall the host on a GPU, where
  ``torch.cuda.set_sync_debug_mode("error")`` raises instead.

Imported by tests and by ``tools/gpu_check.py --cpu``.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp.compose import offload as offload_module
from fsdp.group.streams import CommStreams

__all__ = ["DeferredTransfers", "SYNCING", "SyncCounter", "deferred_transfers", "moving_from_local"]


@contextlib.contextmanager
def moving_from_local() -> Iterator[list[int]]:
    """Within the block, ``DTensor.from_local`` wraps a copy of its local tensor (differentiable,
    as ``local.to(device)`` is), as on a mesh of another device type. Yields a one-element list:
    how many calls copied (the whole process: threaded ranks share it)."""
    original = DTensor.from_local
    calls = [0]

    def from_local(local_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> DTensor:
        if not local_tensor.is_meta:
            calls[0] += 1
            local_tensor = local_tensor.clone()
        return original(local_tensor, *args, **kwargs)

    DTensor.from_local = staticmethod(from_local)  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        DTensor.from_local = original  # type: ignore[method-assign]


class _Deferred:
    """A copy in flight: ``finish`` runs when the host synchronizes it (once)."""

    def __init__(self, event: Any, finish: Callable[[], None], owner: "DeferredTransfers") -> None:
        self.event = event
        self._finish: Optional[Callable[[], None]] = finish
        self._owner = owner

    def synchronize(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
            self._owner.synchronized += 1
        self.event.synchronize()


class DeferredTransfers:
    """:class:`~fsdp.compose.offload.HostTransfers` as a GPU with ``pin_memory=True`` behaves,
    on the CPU (see the module docstring). Counts what it did: ``uploads``, ``downloads``
    (non-blocking copies of each direction), ``synchronized``, and ``largest_upload`` (the most
    elements one host-to-device copy moved). ``freed_sources`` counts the uploads whose source
    was freed before they were synchronized (each also raises ``AssertionError`` then, instead
    of reading freed memory)."""

    def __init__(self, compute_device: torch.device, pin_memory: bool) -> None:
        self.pinned = pin_memory
        self.streams = CommStreams.for_device(compute_device)
        self._host: dict[int, torch.Tensor] = {}  # storage -> a tensor on it (kept: no reuse of the key)
        self.uploads = self.downloads = self.synchronized = self.largest_upload = self.freed_sources = 0

    def host_tensor(self, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        t = (torch.zeros if zero else torch.empty)(numel, dtype=dtype)
        if self.pinned:
            self._host[_storage_key(t)] = t
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        return _storage_key(t) in self._host

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[_Deferred]:
        if not self.pinned:
            dst.copy_(src)
            return None
        event = self.streams.record()
        if self.is_pinned(dst):  # device -> host: the host sees it once synchronized
            value = src.detach().clone()
            dst.fill_(float("nan") if dst.is_floating_point() else -1)
            self.downloads += 1
            return _Deferred(event, lambda: dst.copy_(value), self)
        dst.copy_(src)  # host -> device: the device reads it in stream order
        before = src.detach().clone()
        self.uploads += 1
        self.largest_upload = max(self.largest_upload, src.numel())
        address, nbytes = src.untyped_storage().data_ptr(), src.untyped_storage().nbytes()

        def check_source_untouched() -> None:
            storage = src.untyped_storage()
            if storage.nbytes() != nbytes or storage.data_ptr() != address:  # reading it would read freed memory
                self.freed_sources += 1
                raise AssertionError(
                    "the host freed a host buffer while a non-blocking upload from it may still "
                    "have been reading it (settle() before freeing)"
                )
            if not torch.equal(src, before):
                raise AssertionError(
                    "the host wrote a host buffer while a non-blocking upload from it may still "
                    "have been reading it (settle() before writing)"
                )

        return _Deferred(event, check_source_untouched, self)


@contextlib.contextmanager
def deferred_transfers() -> Iterator[list[DeferredTransfers]]:
    """Within the block, offload groups built by ``fully_shard`` get :class:`DeferredTransfers`;
    yields the list of those made, in order."""
    made: list[DeferredTransfers] = []
    original = offload_module.TRANSFERS

    def factory(device: torch.device, pin_memory: bool) -> DeferredTransfers:
        made.append(DeferredTransfers(device, pin_memory))
        return made[-1]

    offload_module.TRANSFERS = factory
    try:
        yield made
    finally:
        offload_module.TRANSFERS = original


def _storage_key(t: torch.Tensor) -> int:
    """The storage's identity (stable across resizes: a released buffer keeps its storage object)."""
    return t.untyped_storage()._cdata


# aten ops whose result on the host depends on a device tensor's values: each one waits for the device.
SYNCING = {
    "aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
    "aten.is_nonzero.default", "aten.equal.default", "aten._assert_async.msg", "aten.unique_dim.default",
    "aten._unique2.default", "aten.allclose.default",
}


class SyncCounter(TorchDispatchMode):
    """Counts the syncing aten ops run under it, by name and the innermost project frame that
    made them. torch.optim's own ``step.item()`` is skipped: its step counter is a host tensor
    on every device (not ``capturable``), so it never waits for one."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in SYNCING:
            stack = traceback.extract_stack()
            if not any("torch/optim/" in f.filename for f in stack[-6:]):
                where = next((f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}" for f in reversed(stack)
                              if "/fsdp/" in f.filename or "/dbuffer/" in f.filename or "/tests/" in f.filename), "?")
                key = f"{name} at {where}"
                self.calls[key] = self.calls.get(key, 0) + 1
        return func(*args, **(kwargs or {}))
