"""Scratch memory that gloo's hand-built collectives reuse across calls (:mod:`dbuffer.collectives`).

A fresh large CPU buffer is mapped anew by glibc and faulted in page by page at every allocation;
a collective that takes its scratch from here pays that once.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["WorkspacePool"]


class WorkspacePool:
    """Scratch buffers reused across calls, so that a collective neither allocates nor faults in
    fresh memory each time. A buffer is held for the life of one collective and given back by its
    ``finish``; collectives in flight together get separate buffers. At most ``keep`` idle buffers
    per dtype are kept, the largest ones."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._idle: dict[torch.dtype, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements; its contents are undefined."""
        with self._lock:
            idle = self._idle.get(dtype)
            if idle:  # sorted largest first: the last one that fits is the smallest that fits
                for i in range(len(idle) - 1, -1, -1):
                    if idle[i].numel() >= numel:
                        base = idle.pop(i)
                        return base if base.numel() == numel else base[:numel]
        return torch.empty(numel, dtype=dtype, device="cpu")

    def give(self, workspace: torch.Tensor) -> None:
        base = workspace if workspace._base is None else workspace._base
        with self._lock:
            idle = self._idle.setdefault(base.dtype, [])
            idle.append(base)
            if len(idle) > 1:
                idle.sort(key=torch.Tensor.numel, reverse=True)
                del idle[self._keep :]

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
