"""Side streams for the collectives on CUDA, so gathers and reductions overlap compute.

On CPU (gloo, threaded) every method is a no-op and asynchrony comes from ``async_op=True``
alone. On CUDA (untested here: no GPU on the development machine):

* a collective is launched on its own stream after that stream waits for the current one, so it
  sees the inputs the compute stream produced (the gradients in ``grad_in``, the cast shard);
* ``wait`` makes the current stream wait for the side stream, so compute never reads a buffer
  a collective is still writing; buffers stay referenced by their ``Pending`` until then, so the
  caching allocator cannot hand their memory out early.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

__all__ = ["CommStreams"]

_CACHE: dict[torch.device, "CommStreams"] = {}


class CommStreams:
    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.all_gather: Optional[torch.cuda.Stream] = None
        self.reduce_scatter: Optional[torch.cuda.Stream] = None
        if self.enabled:
            self.all_gather = torch.cuda.Stream(device)
            self.reduce_scatter = torch.cuda.Stream(device)

    @classmethod
    def for_device(cls, device: torch.device) -> "CommStreams":
        if device not in _CACHE:
            _CACHE[device] = cls(device)
        return _CACHE[device]

    @contextlib.contextmanager
    def launch(self, stream: Optional["torch.cuda.Stream"]) -> Iterator[None]:
        """Run the enclosed launch on ``stream``, after the work already queued on the current one."""
        if not self.enabled or stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield

    def wait(self, stream: Optional["torch.cuda.Stream"]) -> None:
        """Order the current stream after everything queued on ``stream``."""
        if self.enabled and stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
