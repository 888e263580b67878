"""Side streams and events for fsdp's collectives, on any device through torch's device module.

**One set per device, shared.** :meth:`CommStreams.for_device` gives every group on a device the
same high-priority ``all_gather`` and ``reduce_scatter`` streams (as in FSDP2: short copies should
not queue behind compute), like FSDP2's root-shared comm context (``share_comm_ctx``);
:class:`~fsdp.unit.root.RootContext` lists those its tree uses.

**Device-generic.** Streams and events come from ``torch.get_device_module(device)``; devices
without a stream API (CPU, meta) get ``torch.cpu``'s no-op stand-ins (``enabled`` False), so a CPU
run executes every line a GPU run does, asynchrony coming from ``async_op=True`` alone.

**Ordering protocol** (FSDP2's, with events; fsdp never calls ``record_stream``):

1. *All-gather.* ``launch(all_gather)``: the side stream waits for the current stream, so the gather
   reads the shard written there and runs after every earlier copy-out of a buffer it overwrites.
   The target is allocated before; the ``Pending`` handle keeps source and target alive.
2. *Copy-out.* ``wait(all_gather)``: the current stream waits for the latest launch's event, then
   the handle (c10d orders it after the collective; a custom comm copies its output there), then
   copies out. The next gather into that buffer waits for this stream at launch: after the copy-out.
3. *Reduce-scatter.* ``launch(reduce_scatter)`` waits for ``grad_in``'s packing on the current
   stream; temporaries are allocated on the side stream and folded into ``main_grad`` inside the
   launch when :meth:`wait_is_free` (as FSDP2 does), freeing them at once, else after
   ``wait(reduce_scatter)`` and the handle, as in 2. Either way the current stream is ordered after
   the launch before ``main_grad`` is read or zeroed and ``grad_in`` freed (on that stream).
4. *All-reduce* (HSDP replicas, ``no_shard`` / ``optim``): in the same launch, the same ordering.
5. *Memory read across streams.* A side-stream allocation read on the current stream and dropped (a
   custom comm's staging buffer) returns to the side stream's pool: :meth:`after_read` makes each
   side stream's next launch wait for the read. Launching-stream memory read in a launch and freed
   by resizing right after (an offload download of ``grad_in``): see :meth:`launcher_waits`.
6. *Host.* Pinned-host copies record events the host synchronizes before touching that memory
   (:mod:`fsdp.compose.offload`); a post-optimizer event (``set_post_optim_event``) is waited for by
   the all-gather stream, or by the host without real streams (:meth:`gathers_wait`).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import torch

if TYPE_CHECKING:
    from dbuffer import Pending

__all__ = ["CommStreams", "DeviceEvent", "DeviceStream"]

_CACHE: dict[torch.device, "CommStreams"] = {}
_LOCK = threading.Lock()
_HIGH_PRIORITY = -1  # FSDP2's priority for its all-gather and reduce-scatter streams


def _device_module(device: torch.device) -> ModuleType:
    """``torch.cuda``, ``torch.xpu``, ...; ``torch.cpu``'s stand-ins without streams or events."""
    try:
        module = torch.get_device_module(device)
    except RuntimeError:  # meta, or a backend without a registered module
        return torch.cpu
    if not all(hasattr(module, name) for name in ("Stream", "Event", "current_stream", "stream")):
        return torch.cpu
    return module


class DeviceStream(Protocol):
    """A device module's stream (``torch.cuda.Stream``, ``torch.xpu.Stream``, ``torch.cpu``'s)."""

    def wait_stream(self, stream: DeviceStream) -> None:
        """Work queued here from now on runs after the work queued on ``stream`` so far."""

    def wait_event(self, event: DeviceEvent) -> None:
        """Work queued here from now on runs after ``event``."""


class DeviceEvent(Protocol):
    """A device module's event (``torch.cuda.Event``, ``torch.cpu``'s stand-in) or ``torch.Event``."""

    def record(self, stream: Optional[DeviceStream] = None) -> None:
        """Mark the point ``stream`` (default: the current stream) has reached."""

    def synchronize(self) -> None:
        """Block the host until the work before the recorded point is done."""


class CommStreams:
    """The comm streams of one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = _device_module(device)
        self.enabled = self.module is not torch.cpu
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
        # A device's streams: a deep-copied or unpickled module shares them, as every unit does.
        return CommStreams.for_device, (self.device,)

    def current(self) -> DeviceStream:
        return self.module.current_stream(self.device)

    def record(self, stream: Optional[DeviceStream] = None) -> DeviceEvent:
        """An event recorded now on ``stream`` (default: the current stream)."""
        event = self.module.Event()
        event.record(self.current() if stream is None else stream)
        return event

    def launch(self, stream: Optional[DeviceStream]) -> "_Launch":
        """Run the ``with`` body on ``stream`` after the current stream and :meth:`after_read`'s reads."""
        return _Launch(self, stream)

    def run_on(self, stream: DeviceStream, fn: Callable[[], None]) -> None:
        """Run ``fn`` on ``stream``, ordered after and before the current stream (a user's hook)."""
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
        """Whether waiting for ``pending`` is free for the host (real streams, or it completed)."""
        return self.enabled or pending.is_completed()

    def after_read(self, event: DeviceEvent) -> None:
        """Each side stream's next launch waits for ``event``, which ends a read on this stream."""
        reader = self.current()
        for reads in self._reads.values():
            reads[reader] = event

    def launcher_waits(self, event: DeviceEvent) -> None:
        """The launching stream waits for ``event`` when the open launch ends (now if none is)."""
        frames = self._frames()
        if frames:
            frames[-1].append(event)
        else:
            self.current().wait_event(event)

    def gathers_wait(self, event: DeviceEvent) -> None:
        """The next gathers start after ``event``: the all-gather stream (or host) waits for it."""
        if self.enabled:
            self.all_gather.wait_event(event)
        else:
            event.synchronize()

    def _frames(self) -> list:
        frames = getattr(self._launches, "frames", None)
        if frames is None:
            frames = self._launches.frames = []
        return frames


class _Launch:
    """:meth:`CommStreams.launch`'s context, a class rather than a generator (six a unit a step):
    the protocol's launch, line for line; the launch's event is recorded only if the body ran."""

    __slots__ = ("streams", "stream", "origin", "handed_back", "frames", "context")

    def __init__(self, streams: CommStreams, stream: Optional[DeviceStream]) -> None:
        self.streams, self.stream = streams, stream

    def __enter__(self) -> None:
        streams, stream = self.streams, self.stream
        if stream is None:
            return
        self.origin = streams.current()
        stream.wait_stream(self.origin)
        reads = streams._reads[id(stream)]
        for event in reads.values():
            stream.wait_event(event)
        reads.clear()
        self.handed_back, self.frames = [], streams._frames()
        self.frames.append(self.handed_back)
        self.context = streams.module.stream(stream)
        try:
            self.context.__enter__()
        except BaseException:
            self._end()
            raise

    def __exit__(self, kind, exc, tb) -> None:
        if self.stream is not None:
            try:
                self.context.__exit__(kind, exc, tb)
                if kind is None:
                    self.streams._last_launch[id(self.stream)] = self.streams.record(self.stream)
            finally:
                self._end()

    def _end(self) -> None:
        self.frames.pop()
        for event in self.handed_back:
            self.origin.wait_event(event)
