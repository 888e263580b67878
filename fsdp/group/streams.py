"""Side streams and events for fsdp's collectives, on any device through torch's device module.

**One set per device, shared.** :meth:`CommStreams.for_device` hands every group on a device the
same object: an ``all_gather`` and a ``reduce_scatter`` stream, high priority as in FSDP2 (their
short copies should not queue behind compute kernels). Every unit of every tree on that device
uses them, which is what FSDP2's comm context shared by the root (and ``share_comm_ctx``) gives;
the root's :class:`~fsdp.unit.root.RootContext` lists the ones its tree uses.

**Device-generic.** Streams and events come from ``torch.get_device_module(device)``: real ones on
CUDA and XPU; on the CPU, ``torch.cpu``'s stand-ins (``Stream``, ``Event``, ``stream()``,
``current_stream()``: no-ops kept for device-generic code), so a CPU run (gloo, threaded) executes
every line below that a GPU run does, and asynchrony comes from ``async_op=True`` alone. The meta
device and devices without a stream API get the CPU's stand-ins too. ``enabled``: the streams are
real.

**Ordering protocol** (FSDP2's, with events; fsdp calls ``record_stream`` nowhere):

1. *All-gather.* ``launch(all_gather)``: the all-gather stream first waits for the current
   (compute) stream, so the gather reads the shard written there (the cast model shard, an
   offload upload) and runs after every earlier copy-out of a buffer it overwrites; then the
   collective is queued there. Its target's storage was allocated before the launch; the
   ``Pending`` handle keeps source and target referenced until waited. The launch ends by
   recording an event on the stream.
2. *Copy-out.* ``wait(all_gather)``: the current stream waits for the event of the latest
   all-gather launch (the work queued on the side stream; a later launch of another group is
   waited for too, which costs only that launch's copy-in); then the handle is waited (c10d's
   ``wait`` orders the current stream after the collective itself; a custom comm copies its
   output there, and one that returned no work is ordered by the event alone), then copies the
   gathered values into place (chunked groups, extensions' post-all-gather) and the parameters
   are used. The next gather into that buffer is launched later, and its launch waits for the
   current stream: it cannot overwrite the buffer before the copy-out read it (FSDP2 makes its
   all-gather streams wait for a copy-out event for the same reason).
3. *Reduce-scatter.* The gradients are packed into ``grad_in`` on the current stream;
   ``launch(reduce_scatter)`` waits for it and queues the collective, whose temporaries are
   allocated on that stream. A result in a temporary is divided and folded into ``main_grad``
   inside the same launch when :meth:`wait_is_free` (FSDP2 accumulates on its side stream too),
   so the temporary, that stream's memory, is freed at once; otherwise after
   ``wait(reduce_scatter)`` and then the handle's wait, as in 2. ``wait(reduce_scatter)`` orders
   the current stream after the launch either way before anything reads or zeroes
   ``main_grad``. ``grad_in`` is freed then, on the stream it was allocated on, which has waited
   for the reduction.
4. *All-reduce* (HSDP across replicas, ``no_shard`` / ``optim``'s unsharded gradients): on the
   reduce-scatter stream, in the same launch (one ``redistribute``), so one ordering covers both.
5. *Memory read across streams.* Instead of ``record_stream``:
   a side-stream allocation read on the current stream and then dropped (a custom comm object's
   staging buffer) goes back to that side stream's pool; :meth:`after_read` records the read's
   event, which each side stream's next launch waits for before its work can reuse the memory.
   Memory of the launching stream read by work queued inside a launch, which its owner may free
   right after by resizing its storage (no reference can delay that: an offload download of
   ``grad_in``), is handed to :meth:`launcher_waits`: the launching stream waits for that work
   when the launch ends.
6. *Host.* Non-blocking copies between pinned host memory and the device record events that the
   host synchronizes before it touches that host memory (:mod:`fsdp.compose.offload`). A
   post-optimizer event (FSDP2's ``set_post_optim_event``) is waited for by the all-gather stream;
   without real streams, by the host (:meth:`gathers_wait`).
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol

import torch

if TYPE_CHECKING:
    from dbuffer import Pending

__all__ = ["CommStreams", "DeviceEvent", "DeviceStream"]

_CACHE: dict[torch.device, "CommStreams"] = {}
_LOCK = threading.Lock()
_HIGH_PRIORITY = -1  # FSDP2's priority for its all-gather and reduce-scatter streams


def _device_module(device: torch.device) -> ModuleType:
    """``torch.cuda``, ``torch.xpu``, ...; ``torch.cpu`` (stand-ins) for the CPU, meta and any
    device whose module lacks streams or events."""
    try:
        module = torch.get_device_module(device)
    except RuntimeError:  # meta, or a backend without a registered module
        return torch.cpu
    if not all(hasattr(module, name) for name in ("Stream", "Event", "current_stream", "stream")):
        return torch.cpu
    return module


class DeviceStream(Protocol):
    """A stream of a device module: ``torch.cuda.Stream``, ``torch.xpu.Stream``, ``torch.cpu``'s stand-in."""

    def wait_stream(self, stream: DeviceStream) -> None:
        """Work queued here from now on runs after the work queued on ``stream`` so far."""

    def wait_event(self, event: DeviceEvent) -> None:
        """Work queued here from now on runs after ``event``."""


class DeviceEvent(Protocol):
    """An event of a device module (``torch.cuda.Event``, ``torch.cpu``'s stand-in) or ``torch.Event``."""

    def record(self, stream: Optional[DeviceStream] = None) -> None:
        """Mark the point ``stream`` (default: the current stream) has reached."""

    def synchronize(self) -> None:
        """Block the host until the work before the recorded point is done."""


class CommStreams:
    """The comm streams of one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = _device_module(device)
        self.enabled = self.module is not torch.cpu  # real streams
        where = {"device": device} if self.enabled and device.index is not None else {}
        self.all_gather: DeviceStream = self.module.Stream(priority=_HIGH_PRIORITY, **where)
        self.reduce_scatter: DeviceStream = self.module.Stream(priority=_HIGH_PRIORITY, **where)
        self._last_launch: dict[int, DeviceEvent] = {}  # id(side stream) -> event ending its latest launch
        self._reads: dict[int, dict[DeviceStream, DeviceEvent]] = {id(self.all_gather): {}, id(self.reduce_scatter): {}}
        self._launches = threading.local()  # per thread: the open launches' handed-back events

    @classmethod
    def for_device(cls, device: torch.device) -> "CommStreams":
        with _LOCK:
            if device not in _CACHE:
                _CACHE[device] = cls(device)
            return _CACHE[device]

    def __reduce__(self):
        # A device's streams: a deep-copied (or pickled and loaded) module shares them, as every
        # unit does.
        return CommStreams.for_device, (self.device,)

    # ------------------------------------------------------------------ events

    def current(self) -> DeviceStream:
        return self.module.current_stream(self.device)

    def record(self, stream: Optional[DeviceStream] = None) -> DeviceEvent:
        """An event recorded now on ``stream`` (default: the current stream)."""
        event = self.module.Event()
        event.record(self.current() if stream is None else stream)
        return event

    # ------------------------------------------------------------------ launch / wait

    @contextlib.contextmanager
    def launch(self, stream: Optional[DeviceStream]) -> Iterator[None]:
        """Run the enclosed launch on ``stream``, after the work already queued on the current
        stream and the reads recorded by :meth:`after_read`; record the event that ends it."""
        if stream is None:
            yield
            return
        origin = self.current()
        stream.wait_stream(origin)
        reads = self._reads[id(stream)]
        for event in reads.values():
            stream.wait_event(event)
        reads.clear()
        handed_back: list[DeviceEvent] = []
        frames = self._frames()
        frames.append(handed_back)
        try:
            with self.module.stream(stream):
                yield
            self._last_launch[id(stream)] = self.record(stream)
        finally:
            frames.pop()
            for event in handed_back:
                origin.wait_event(event)

    def run_on(self, stream: DeviceStream, fn: Callable[[], None]) -> None:
        """Run ``fn`` with ``stream`` current, after the work queued on the current stream so far,
        and order the current stream after it (a user's all-reduce hook on its own stream)."""
        origin = self.current()
        stream.wait_stream(origin)
        with self.module.stream(stream):
            fn()
        origin.wait_stream(stream)

    def wait(self, stream: Optional[DeviceStream]) -> None:
        """Order the current stream after the latest launch on ``stream``."""
        event = self._last_launch.get(id(stream)) if stream is not None else None
        if event is not None:
            self.current().wait_event(event)

    def wait_is_free(self, pending: Pending) -> bool:
        """Whether waiting for ``pending`` (a collective's handle) now costs the host nothing:
        with real streams the wait only orders the current stream after the collective; without,
        only if the collective has already completed (a query: it waits for nothing)."""
        return self.enabled or pending.is_completed()

    def after_read(self, event: DeviceEvent) -> None:
        """``event`` (on the reading stream) ends a read of memory a side stream allocated: each
        side stream's next launch waits for it first. One event per reading stream is kept: a
        later one on the same stream covers the earlier ones."""
        reader = self.current()
        for reads in self._reads.values():
            reads[reader] = event

    def launcher_waits(self, event: DeviceEvent) -> None:
        """``event`` ends work queued inside the open launch that reads memory of the launching
        stream: that stream waits for it when the launch ends (at once outside any launch)."""
        frames = self._frames()
        if frames:
            frames[-1].append(event)
        else:
            self.current().wait_event(event)

    def gathers_wait(self, event: DeviceEvent) -> None:
        """The next gathers start after ``event`` (FSDP2's ``set_post_optim_event``): the
        all-gather stream waits for it; without real streams the host does (a user's event is
        then the only thing to order against)."""
        if self.enabled:
            self.all_gather.wait_event(event)
        else:
            event.synchronize()

    def _frames(self) -> list:
        frames = getattr(self._launches, "frames", None)
        if frames is None:
            frames = self._launches.frames = []
        return frames
