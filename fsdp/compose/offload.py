"""CPU offload: the main weights, main gradients and optimizer state of a unit live in host memory.

``fully_shard`` takes torch FSDP2's own policy classes. With :class:`CPUOffloadPolicy` a
:class:`~fsdp.group.param_group.ParameterGroup` keeps ``main``, ``main_grad`` and ``model`` (in the
compute dtype, so uploads move fewer bytes) on the host, and the optimizer steps on the CPU. A
gather uploads the shard to a device target and all-gathers from there; a reduction's result is
copied (added, for micro-batches) into ``main_grad``. :class:`OptimizerStateOffloadPolicy`
offloads the optimizer state only (:mod:`fsdp.compose.optim_state`).

Why the copies are safe on CUDA (``pin_memory=True``: pinned host buffers, ``non_blocking`` copies):

* an upload runs on the all-gather stream right before the gather that reads it; its target is
  allocated there and freed after the compute stream has waited for that stream;
* a download runs on the reduce-scatter stream after the reduction; its source may be ``grad_in``,
  freed right after on the compute stream, which therefore waits for the download's event before
  reusing the memory (see :mod:`fsdp.group.streams`);
* the host waits for the copies' events (:meth:`HostOffload.settle`) before touching a host buffer
  a copy may still use: before attaching, accumulating, zeroing or freeing gradients and before
  recasting or freeing model weights.

On a CPU mesh nothing is pinned (torch FSDP2 raises) and the copies run between host buffers.
Tests replace :data:`TRANSFERS` (the :class:`HostTransfers` seam) with a stand-in deferring
non-blocking copies until synchronized, so a read that skipped :meth:`HostOffload.settle` fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from dbuffer import DBuffer
from dbuffer.layout import Layout, RaggedLayout
from fsdp.group.streams import CommStreams, DeviceEvent

__all__ = [
    "CPUOffloadPolicy", "Completion", "DeviceTransfers", "HostOffload", "HostTransfers", "OffloadPolicy",
    "OptimizerStateOffloadPolicy", "TRANSFERS", "check_offload_policy", "has_pinned_memory", "host_dbuffer",
]

STEPS = ("device", "host")


@dataclass
class OptimizerStateOffloadPolicy(OffloadPolicy):
    """Offload only the optimizer state to host memory; the main weights and gradients stay on the
    compute device. Pass it as ``fully_shard``'s or a :class:`fsdp.Bucket`'s ``offload_policy``; it
    subclasses ``OffloadPolicy``, not ``CPUOffloadPolicy``, so torch FSDP2 offloads nothing for it.

    ``step="device"`` (default): the optimizer steps on the device, the state streamed in chunks
    (:class:`fsdp.FlatOptimizer`: ``chunk_numel``) or per fsdp group (``torch.optim``).
    ``step="host"``: it steps on the host, where the state lives, moving fewer bytes but computing
    on the host's cores. ``pin_memory``: page-locked host memory, non-blocking copies. After
    ``step()`` returns the state may be read and written freely.

    Raises ``ValueError`` for a ``step`` other than ``"device"`` / ``"host"`` and ``TypeError`` for
    a non-bool ``pin_memory``, when built (again in ``fully_shard``, before any collective). With
    ``step="host"`` a ``torch.optim`` step refuses a ``closure`` and ``capturable=True``
    (``RuntimeError``). Guarantee: training equals training without offload bit for bit where the
    step runs on the same kernels (always for ``step="device"``)."""

    pin_memory: bool = True
    step: str = "device"

    def __post_init__(self) -> None:
        _check_state_policy(self, "OptimizerStateOffloadPolicy")


def _check_state_policy(policy: OptimizerStateOffloadPolicy, what: str) -> None:
    if not isinstance(policy.pin_memory, bool):
        raise TypeError(f"{what}(pin_memory=...) must be a bool, got {policy.pin_memory!r}")
    if policy.step not in STEPS:
        raise ValueError(
            f"{what}(step=...) must be 'device' (the optimizer steps on the device, the states streamed "
            f"in and out) or 'host' (it steps on the host, where the states live), got {policy.step!r}"
        )


AnyOffload = Union[CPUOffloadPolicy, OptimizerStateOffloadPolicy]


def check_offload_policy(policy: object, what: str = "offload_policy") -> Optional[AnyOffload]:
    """The offload policy (None: none); raises ``TypeError`` / ``ValueError`` naming ``what``."""
    if isinstance(policy, CPUOffloadPolicy):
        if not isinstance(policy.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {policy.pin_memory!r}")
        return policy
    if isinstance(policy, OptimizerStateOffloadPolicy):
        _check_state_policy(policy, f"{what}=OptimizerStateOffloadPolicy")
        return policy
    if type(policy) is OffloadPolicy:
        return None
    raise TypeError(
        f"{what} must be torch.distributed.fsdp.OffloadPolicy() (no offload), CPUOffloadPolicy(pin_memory=...) "
        f"(everything on the host) or fsdp.OptimizerStateOffloadPolicy(pin_memory=..., step='device' | 'host') "
        f"(only the optimizer state on the host), got {policy!r}"
    )


class Completion(Protocol):
    """A non-blocking copy in flight between host and device."""

    event: DeviceEvent  # recorded on the stream the copy was queued on, right after it

    def synchronize(self) -> None:
        """Block the host until the copy is done."""


class HostTransfers(Protocol):
    """What offload needs of the link between host memory and the compute device."""

    pinned: bool  # host buffers are page-locked and copies non-blocking

    def host_tensor(self, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        """A 1-D host tensor (pinned when :attr:`pinned`), zeroed if ``zero``."""

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in memory :meth:`host_tensor` would give (pinned where it pins)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[Completion]:
        """Queue ``dst.copy_(src)`` on the current stream: a :class:`Completion`, None if done."""


def has_pinned_memory(device: torch.device) -> bool:
    """Whether page-locked host memory speeds up copies to ``device`` (not the CPU or meta)."""
    return device.type not in ("cpu", "meta")


class _EventCompletion:
    def __init__(self, event: DeviceEvent) -> None:
        self.event = event

    def synchronize(self) -> None:
        self.event.synchronize()


class DeviceTransfers:
    """torch's transfers: pinned memory, ``non_blocking`` copies ended by events (where it pins)."""

    def __init__(self, compute_device: torch.device, pin_memory: bool) -> None:
        self.compute_device = compute_device
        self.pinned = pin_memory and has_pinned_memory(compute_device)

    def host_tensor(self, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=dtype, device="cpu", pin_memory=self.pinned)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.pinned and t.is_pinned()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[Completion]:
        dst.copy_(src, non_blocking=self.pinned)
        if not self.pinned:
            return None
        return _EventCompletion(CommStreams.for_device(self.compute_device).record())


# Makes a group's transfers from (compute device, pin_memory); tests put a stand-in here.
TRANSFERS: Callable[[torch.device, bool], HostTransfers] = DeviceTransfers


def host_dbuffer(
    transfers: HostTransfers, mesh: DeviceMesh, placements: Sequence, shapes: Sequence[Sequence[int]],
    dtype: torch.dtype, layout: Optional[Union[Layout, RaggedLayout]], zero_fill: bool = True,
) -> DBuffer:
    """A host DBuffer whose local buffer is ``transfers``' memory (pinned where they pin)."""
    host = torch.device("cpu")
    plain = DBuffer(
        mesh, placements, shapes, dtype, host, layout=layout, zero_fill=False,
        check_ranks=False,  # a sibling of a buffer fully_shard checked
    )
    local = transfers.host_tensor(plain.local_buffer.numel(), dtype, zero_fill)
    return DBuffer(mesh, placements, shapes, dtype, host, layout=plain.layout, local_buffer=local, check_ranks=False)


class HostOffload:
    """One group's host buffers and copies: a :class:`~fsdp.group.residence.HostResidence`."""

    device = torch.device("cpu")
    on_host = True  # the group's other offload parts: fsdp.group.residence
    optim_state = None  # the optimizer state lives with the main weights, on the host

    def __init__(self, policy: CPUOffloadPolicy, compute_device: torch.device) -> None:
        self.compute_device = compute_device
        self.transfers: HostTransfers = TRANSFERS(compute_device, policy.pin_memory)
        self._pending: list[Completion] = []  # non-blocking copies that may still use host memory
        self._reads: list[torch.Tensor] = []  # device tensors the next recorded copy reads
        self._staging: Optional[DBuffer] = None  # the upload target (device), one per group

    @property
    def pin(self) -> bool:
        """Whether the host buffers are pinned and the copies non-blocking."""
        return self.transfers.pinned

    def buffer(
        self,
        mesh: DeviceMesh,
        placements: Sequence,
        shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        layout: Optional[Union[Layout, RaggedLayout]],
        zero_fill: bool = True,
    ) -> DBuffer:
        """A host DBuffer in the transfers' memory, zero-filled unless ``zero_fill=False``."""
        return host_dbuffer(self.transfers, mesh, placements, shapes, dtype, layout, zero_fill)

    def in_residence(self, buf: DBuffer) -> DBuffer:
        """``buf``, or if ``pin`` and it is unpinned a pinned copy (same values, released state)."""
        if not self.pin or self.transfers.is_pinned(buf.local_buffer):
            return buf
        released = buf.is_storage_released()
        out = self.buffer(buf.mesh, buf.placements, buf.shapes, buf.dtype, buf.layout, zero_fill=False)
        if released:
            out.release_storage()
        else:
            out.local_buffer.copy_(buf.local_buffer)
        return out

    @torch.no_grad()
    def upload(self, src: DBuffer, out: Optional[DBuffer] = None) -> DBuffer:
        """Copy host ``src`` into ``out`` or else the upload target (until :meth:`release_upload`),
        on the current stream: call it where the collective reading the result will run."""
        if out is None:
            staging = self._staging
            if staging is None or staging.dtype != src.dtype or tuple(staging.placements) != tuple(src.placements):
                staging = src.sibling(device=self.compute_device, zero_fill=False)
                self._staging = staging
            else:
                staging.reallocate_storage()
            out = staging
        self._track(self.transfers.copy(out.local_buffer, src.local_buffer))
        return out

    def release_upload(self) -> None:
        """Free the upload target once the gather that read it is waited for."""
        if self._staging is not None and not self._staging.is_storage_released():
            self._staging.release_storage()

    @torch.no_grad()
    def download(self, src: torch.Tensor, dst: torch.Tensor, add: bool) -> None:
        """Copy (or ``add``) device ``src`` into host ``dst``, on the current stream: non-blocking
        into pinned memory, an add via a blocking host temporary once ``dst``'s copies are done."""
        self.used_here(src)
        if add:
            self.settle()
            dst.add_(src.to(self.device, dst.dtype))
            return
        self._track(self.transfers.copy(dst, src))

    def used_here(self, t: torch.Tensor) -> None:
        """The next copy reads device ``t``, whose owner may free it right after (a resize to 0 no
        reference can delay), so :meth:`_track` orders that stream after the copy."""
        self._reads.append(t)

    def _track(self, done: Optional[Completion]) -> None:
        """Keep a non-blocking copy until :meth:`settle`; if it read device memory
        (:meth:`used_here`), the launch's opening stream waits for its event before it is reused."""
        reads, self._reads = self._reads, []
        if done is None:
            return
        self._pending.append(done)
        if reads:
            CommStreams.for_device(self.compute_device).launcher_waits(done.event)

    def settle(self) -> None:
        """Block the host until every non-blocking copy of this group's host buffers is done."""
        pending, self._pending, self._reads = self._pending, [], []
        for done in pending:
            done.synchronize()
