"""Memory of a piece of work, at the level of tensor storages (no allocator hooks, so on CPU too).

:class:`StorageTracker` (a ``TorchDispatchMode`` plus a hook on ``UntypedStorage.resize_``)
counts the live bytes of the untyped storages it is given or that an operator run under it reads
or writes (DTensors and other wrapper subclasses by their inner tensors, c10d operators included)
and their peak. :func:`live_storages` finds every storage a Python-visible tensor of the process
holds (through ``gc``), so a step's account can start from everything a method created since it
was built (:meth:`StorageTracker.track_new`). :class:`DeviceTracker` also keeps the peak of what is not
in host memory (an offloading method's device peak, on a CPU run). Memory a c10d backend
allocates inside a collective (gloo's staging buffers) is not a torch storage and is not seen.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def local_tensors(x: Any) -> list[torch.Tensor]:
    """Plain tensors behind ``x``: itself, or the inner tensors of a subclass (DTensor)."""
    if not isinstance(x, torch.Tensor):
        return []
    if type(x) is torch.Tensor or type(x) is torch.nn.Parameter or not hasattr(x, "__tensor_flatten__"):
        return [x]
    names, _ = x.__tensor_flatten__()
    out: list[torch.Tensor] = []
    for name in names:
        out.extend(local_tensors(getattr(x, name)))
    return out


class StorageTracker(TorchDispatchMode):
    """Live bytes of the untyped storages a piece of work owns or touches, and their peak.

    Storages enter the account when :meth:`track` is given a tensor holding them or when an
    operator run under this mode reads or writes them; each is counted once, at its current size
    (refreshed whenever an operator touches it or ``UntypedStorage.resize_`` changes it), and
    leaves the account when it is freed (a weak reference). ``peak`` is the largest total seen
    after any operator or resize.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list] = {}  # storage cdata -> [weakref, counted nbytes]
        self.current = 0
        self.peak = 0
        self._orig_resize = None

    def track(self, *objs: Any) -> None:
        """Count the storages of these tensors (any pytree of them) from now on."""
        self.track_storages(local.untyped_storage() for t in tree_flatten(list(objs))[0]
                            for local in local_tensors(t))

    def track_storages(self, storages) -> None:
        for st in storages:
            self._account(st)
        self._note_peak()

    def _note_peak(self) -> None:
        """After a change of the account: keep the peak."""
        self.peak = max(self.peak, self.current)

    def track_new(self, before: dict[int, torch.UntypedStorage]) -> None:
        """Count every storage alive now (after ``gc.collect()``) that ``before``, a
        :func:`live_storages` snapshot, does not hold: what was created since. The caller keeps
        ``before`` alive until then, so that no new storage can reuse an old one's identity."""
        gc.collect()
        self.track_storages(st for key, st in live_storages().items() if key not in before)

    def _account(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        entry = self._live.get(key)
        nbytes = st.nbytes()
        if entry is None:
            self._live[key] = [weakref.ref(st, self._make_release(key)), nbytes]
            self.current += nbytes
        elif entry[1] != nbytes:
            self.current += nbytes - entry[1]
            entry[1] = nbytes

    def _make_release(self, key: int) -> Callable:
        def release(_ref) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]

        return release

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                for local in local_tensors(t):
                    self._account(local.untyped_storage())
        self._note_peak()
        return out

    def __enter__(self):
        tracker = self
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st, size):
            result = orig(st, size)
            tracker._account(st)
            tracker._note_peak()
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


class DeviceTracker(StorageTracker):
    """A :class:`StorageTracker` that also keeps ``device_peak``: the largest total of the
    storages that ``on_host()`` (asked after every operator and resize: the set of storage
    identities, ``UntypedStorage._cdata``, living in host memory at that moment) does not name.
    On a CPU run, where host and "device" memory are one, this separates what an offloading
    method keeps on the host from what a GPU would hold; a storage that moves between the two
    (FSDP2's gradient, a reduction's output until it is ``param.grad`` on the host) is counted
    where ``on_host`` says it is at each moment."""

    def __init__(self, on_host: Callable[[], set]) -> None:
        super().__init__()
        self._on_host = on_host
        self.device_peak = 0

    def _note_peak(self) -> None:
        super()._note_peak()
        host = self._on_host()
        host_bytes = sum(entry[1] for key, entry in self._live.items() if key in host)
        self.device_peak = max(self.device_peak, self.current - host_bytes)


def live_storages() -> dict[int, torch.UntypedStorage]:
    """Every storage some Python-visible tensor of this process holds (DTensors by their local
    tensors), by storage identity."""
    out: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: no __class__ lookups on proxies
            for local in local_tensors(obj):
                try:
                    st = local.untyped_storage()
                except (RuntimeError, NotImplementedError):  # a wrapper without storage
                    continue
                out.setdefault(st._cdata, st)
    return out


def release_library_caches() -> None:
    """Start a measurement from a clean slate: free dbuffer's idle collective scratch (public API)."""
    collectives = sys.modules.get("dbuffer.collectives")
    if collectives is not None:
        collectives.release_workspaces()
