"""Optimizer state on the host, weights and grads on the device: ``OptimizerStateOffloadPolicy``.

Such a group's :class:`OptimStateOffload` part is a :class:`~fsdp.group.residence.NoOffload` whose
``optim_state`` (a :class:`HostOptimState`) keeps the state for :mod:`fsdp.optim` in host memory
(:class:`~fsdp.compose.offload.HostTransfers`) and steps the flat shard in chunks:

* :meth:`HostOptimState.device_pass`: chunk ``i + 1``'s states upload on the all-gather stream (the
  step runs no gathers) while chunk ``i`` steps on the current stream, which waits for the upload's
  event and downloads right after; two device slots alternate. The host synchronizes an upload
  before queueing the download into that host range (keeps the CPU stand-in exact).
* :meth:`HostOptimState.host_pass`: chunk ``i + 1``'s weights and gradients download into host
  scratch while the host steps chunk ``i``; the host waits for the copies before it reads or
  reuses a slot.

:meth:`HostOptimState.settle`, called at the end of each step, waits for every tracked copy, so
the host never touches state a copy may still use.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import DBuffer
from fsdp.compose import offload as _offload
from fsdp.compose.offload import Completion, HostTransfers, OptimizerStateOffloadPolicy, host_dbuffer
from fsdp.group.residence import Chunk, NoOffload
from fsdp.group.streams import CommStreams

__all__ = ["HostOptimState", "OptimStateOffload"]


class HostOptimState:
    """A group's optimizer state in host memory: an :class:`fsdp.group.residence.OptimStateHome`."""

    def __init__(self, policy: OptimizerStateOffloadPolicy, compute_device: torch.device) -> None:
        self.step_on = policy.step
        self.compute_device = compute_device
        self.transfers: HostTransfers = _offload.TRANSFERS(compute_device, policy.pin_memory)
        self.streams = CommStreams.for_device(compute_device)
        self._pending: list[Completion] = []
        self._scratch: dict[tuple, torch.Tensor] = {}  # host_pass's slots, kept: pinning is slow

    @property
    def pin(self) -> bool:
        """Whether host memory is pinned and the copies non-blocking."""
        return self.transfers.pinned

    def host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D host tensor in the transfers' memory."""
        return self.transfers.host_tensor(numel, dtype, True)

    def host_buffer(self, mesh: DeviceMesh, placements: Sequence, shapes: Sequence, dtype: torch.dtype, layout) -> DBuffer:
        """A zeroed host DBuffer in the transfers' memory (a sibling of a group's ``main``)."""
        return host_dbuffer(self.transfers, mesh, placements, shapes, dtype, layout)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in memory :meth:`host_tensor` gives (pinned where it pins)."""
        return self.transfers.is_pinned(t)

    def _slot(self, key: tuple, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = self._scratch.get(key)
        if t is None or t.numel() < numel or t.dtype != dtype:
            t = self._scratch[key] = self.transfers.host_tensor(numel, dtype, False)
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on the current stream, tracked until :meth:`settle`."""
        self._track(self.transfers.copy(dst, src))

    def _track(self, done: Optional[Completion]) -> Optional[Completion]:
        if done is not None:
            self._pending.append(done)
        return done

    @staticmethod
    def _wait(done: Optional[Completion]) -> None:
        if done is not None:
            done.synchronize()

    def settle(self) -> None:
        """Block the host until every copy to or from this part's host memory is done."""
        pending, self._pending = self._pending, []
        for done in pending:
            done.synchronize()

    @torch.no_grad()
    def device_pass(self, states: Sequence[torch.Tensor], chunks: Sequence[Chunk], fn: Callable) -> None:
        """``fn(chunk, views)`` for each chunk, ``views[j]`` a device copy of
        ``states[j][chunk.start:chunk.end]`` that goes back to the host after ``fn``."""
        chunks = [c for c in chunks if c.numel > 0]
        if not chunks:
            return
        self.settle()  # the last step's downloads into the states
        width = max(c.numel for c in chunks)
        slots = [[torch.empty(width, dtype=s.dtype, device=self.compute_device) for s in states] for _ in range(2)]
        streams = self.streams

        def upload(i: int) -> tuple:
            c, slot = chunks[i], slots[i % 2]
            with streams.launch(streams.all_gather):  # after the last step and download of the slot
                done = [self.transfers.copy(slot[j][: c.numel], s[c.start : c.end]) for j, s in enumerate(states)]
                event = streams.record()
            return event, [self._track(d) for d in done]

        ahead = upload(0)
        for i, c in enumerate(chunks):
            event, uploads = ahead
            if i + 1 < len(chunks):
                ahead = upload(i + 1)  # overlaps this chunk's step
            streams.current().wait_event(event)
            views = [slot[: c.numel] for slot in slots[i % 2]]
            fn(c, views)
            for j, s in enumerate(states):
                self._wait(uploads[j])  # its source range is written next
                self.copy(s[c.start : c.end], views[j])

    @torch.no_grad()
    def host_pass(
        self, weights: torch.Tensor, grads: torch.Tensor, states: Sequence[torch.Tensor], chunks: Sequence[Chunk],
        fn: Callable,
    ) -> None:
        """``fn(chunk, w, g, views)`` on the host for each chunk: ``w`` / ``g`` host copies of the
        device ``weights`` / ``grads`` chunk (``w`` copied back after), ``views`` the states'."""
        chunks = [c for c in chunks if c.numel > 0]
        if not chunks:
            return
        self.settle()  # the last pass's uploads out of the slots
        width = max(c.numel for c in chunks)
        w_slots = [self._slot(("w", k), width, weights.dtype) for k in range(2)]
        g_slots = [self._slot(("g", k), width, grads.dtype) for k in range(2)]
        returning: list[Optional[Completion]] = [None, None]  # the upload out of each weight slot

        def fetch(i: int) -> list:
            c, k = chunks[i], i % 2
            self._wait(returning[k])  # the slot is written next
            returning[k] = None
            w = self.transfers.copy(w_slots[k][: c.numel], weights[c.start : c.end])
            g = self.transfers.copy(g_slots[k][: c.numel], grads[c.grad_start : c.grad_start + c.numel])
            return [w, g]

        ahead = fetch(0)
        for i, c in enumerate(chunks):
            fetched = ahead
            if i + 1 < len(chunks):
                ahead = fetch(i + 1)  # overlaps this chunk's host step
            for done in fetched:
                self._wait(done)
            k = i % 2
            w, g = w_slots[k][: c.numel], g_slots[k][: c.numel]
            fn(c, w, g, [s[c.start : c.end] for s in states])
            returning[k] = self._track(self.transfers.copy(weights[c.start : c.end], w))


class OptimStateOffload(NoOffload):
    """A group's offload part under :class:`~fsdp.compose.offload.OptimizerStateOffloadPolicy`."""

    def __init__(self, policy: OptimizerStateOffloadPolicy, compute_device: torch.device) -> None:
        self.optim_state = HostOptimState(policy, compute_device)

    def settle(self) -> None:
        self.optim_state.settle()
