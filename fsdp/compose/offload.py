"""CPU offload: the main weights, main gradients and optimizer state of a unit live in host memory.

(This module also defines :class:`OptimizerStateOffloadPolicy`, fsdp's choice of offloading the
optimizer state only; its group part is :mod:`fsdp.compose.optim_state`, which reuses the
:class:`HostTransfers` seam below for every copy.)

``fully_shard(module, offload_policy=CPUOffloadPolicy(pin_memory=True))`` takes torch FSDP2's own
policy classes (re-exported here and from :mod:`fsdp`: the same objects, so FSDP2 code runs
unchanged). With :class:`CPUOffloadPolicy` each :class:`~fsdp.group.param_group.ParameterGroup` keeps

* on the host: ``main`` (the sharded main weights, so the registered DTensor parameters and the
  optimizer state made like them), ``model`` when the compute dtype differs (cast on the host
  once per optimizer step, so each upload moves compute-dtype bytes), and ``main_grad`` (so
  ``param.grad``): the optimizer steps on the CPU;
* on the compute device (the mesh's): the upload target of this rank's shard (storage only while
  a gather reads it), the unsharded weights, ``grad_in`` and the reduction's output.

A gather copies the shard host-to-device into the upload target and all-gathers from there; a
reduction reduce-scatters (all-reduces) on the device and its result is copied device-to-host
into ``main_grad`` (added, for micro-batches). Every strategy works this way (for ``no_shard``
the upload goes straight into the unsharded weights, without a collective).

Why the copies are safe on CUDA (``pin_memory=True``: host buffers are pinned and every copy is
``non_blocking``):

* the upload runs on the all-gather side stream, right before the gather that reads it, so
  stream order makes the gather see it; the upload target is allocated on that stream and freed
  after the compute stream has waited for it;
* the download runs on the reduce-scatter side stream, ordered after the reduction and the work
  queued on the compute stream so far (the division); its device source may be ``grad_in``,
  whose storage is freed right after on the compute stream, so the compute stream waits for
  the download's event at the end of that launch before it can reuse the memory (an event,
  not ``record_stream``: the ordering protocol of :mod:`fsdp.group.streams`);
* each non-blocking copy records an event; the host never touches a host buffer a copy may still
  read or write without first waiting for those events (:meth:`HostOffload.settle`): before the
  gradients are attached (so before the optimizer can read them or write the weights), before
  the model weights are cast again, before gradients are accumulated on the host, zeroed or freed,
  before a model shard cast for one gather (``persistent_param_shard=False``) is freed after it.

``pin_memory`` on a mesh whose device is the CPU (gloo, no accelerator): there is no device copy
for pinned memory to speed up, so the host buffers are ordinary memory and the policy works as
``pin_memory=False`` (torch FSDP2 raises there instead). The copies still run, between distinct
host buffers, so the data path is the same one a GPU runs.

**The seam.** Everything that differs on a GPU (page-locked allocation, ``non_blocking`` copies,
the events that end them) is a :class:`HostTransfers` part, made by :data:`TRANSFERS` for the
compute device: :class:`DeviceTransfers` (torch's own) unless a test replaces the factory with a
stand-in that pins on the CPU and defers every non-blocking copy until its completion is
synchronized, so that a host read that skipped :meth:`HostOffload.settle` reads garbage there
as it would on a GPU (``tests/models/device_standins.py``).
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
    """Offload only the optimizer state to host memory; the main weights and main gradients stay on
    the compute device, as without offload (``CPUOffloadPolicy`` keeps all three on the host).

    ``fully_shard(module, offload_policy=fsdp.OptimizerStateOffloadPolicy(step="device"))``, or a
    :class:`fsdp.Bucket`'s ``offload_policy`` for some parameters only. A subclass of torch's
    ``OffloadPolicy`` (not of ``CPUOffloadPolicy``: torch FSDP2 given it offloads nothing).

    * ``step="device"`` (default): the optimizer steps on the device. :class:`fsdp.FlatOptimizer`
      (``FlatAdamW``, ...) streams each group's flat state in chunks of its ``chunk_numel``
      elements: host-to-device, step, device-to-host, the next chunk's upload overlapping the
      current chunk's step, so the device holds two chunks of state, never all of it. A
      ``torch.optim`` optimizer is driven by fsdp's step hooks: torch's own per-parameter ones
      (every class but ``LBFGS``) are stepped one fsdp group at a time with only that group's
      state uploaded, then downloaded (the device holds one group's state); any other class
      (a subclass, a third-party optimizer) or a step with a ``closure`` gets all its offloaded
      state uploaded before its step and downloaded after (the step's peak holds all of it).
    * ``step="host"``: the optimizer steps on the host, where only the state lives. FlatOptimizer
      streams chunks the other way: each chunk of main weights and main grads is copied
      device-to-host, stepped on the host, and the weights copied back (two chunks of host
      scratch). A ``torch.optim`` optimizer steps host copies of its offloaded parameters (all of
      the group's weights and gradients are downloaded before, the weights uploaded after; host
      scratch the size of the weights and gradients, kept); the device holds no state ever. It
      moves 4 + 4 + grad bytes per element and step against 16 (Adam's two states both ways) but
      computes on the host's cores; results equal the device step's where the host's kernels
      round alike (the CPU) and to rounding otherwise.

    ``pin_memory``: host memory is page-locked and every copy non-blocking (on a mesh whose
    device is the CPU there is nothing to pin: ordinary memory, copies between distinct host
    buffers). The host waits for the last copies at the end of each step, so after ``step()``
    returns the state may be read and written freely (``state_dict()``, checkpoints, logging).

    Raises ``ValueError`` for a ``step`` other than ``"device"`` / ``"host"`` and ``TypeError``
    for a non-bool ``pin_memory``, when built (again in ``fully_shard``, before any collective).
    With ``step="host"`` a ``torch.optim`` step refuses a ``closure`` and ``capturable=True``
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
    """The policy to offload with (None: no offload), or a ``TypeError`` / ``ValueError`` naming
    ``what`` (the argument) and the fix."""
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

    pinned: bool  # host buffers are page-locked and copies between them and the device non-blocking

    def host_tensor(self, numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
        """A 1-D host tensor (pinned when :attr:`pinned`), zeroed if ``zero``."""

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in memory :meth:`host_tensor` would give (pinned where it pins)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[Completion]:
        """Queue ``dst.copy_(src)`` on the current stream; a :class:`Completion` when it may still
        be running on return (non-blocking), None when it is done."""


def has_pinned_memory(device: torch.device) -> bool:
    """Whether page-locked host memory speeds up copies to ``device``: an accelerator, not the
    CPU itself (nor the meta device)."""
    return device.type not in ("cpu", "meta")


class _EventCompletion:
    def __init__(self, event: DeviceEvent) -> None:
        self.event = event

    def synchronize(self) -> None:
        self.event.synchronize()


class DeviceTransfers:
    """torch's own transfers: pinned allocation and ``non_blocking`` copies ended by an event of
    the device's streams, where ``pin_memory`` asks for them and the device has pinned memory."""

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
    """The host side of one parameter group: allocation of its host buffers and the copies
    between them and the compute device (through its :class:`HostTransfers`), with the
    completions that order those copies. A :class:`fsdp.group.residence.HostResidence`."""

    device = torch.device("cpu")
    on_host = True  # the group's other offload parts: fsdp.group.residence
    optim_state = None  # the optimizer state lives with the main weights, on the host

    def __init__(self, policy: CPUOffloadPolicy, compute_device: torch.device) -> None:
        self.compute_device = compute_device
        self.transfers: HostTransfers = TRANSFERS(compute_device, policy.pin_memory)
        self._pending: list[Completion] = []  # non-blocking copies that may still read or write host memory
        self._reads: list[torch.Tensor] = []  # device tensors the next recorded copy reads
        self._staging: Optional[DBuffer] = None  # the upload target (device), one per group

    @property
    def pin(self) -> bool:
        """Whether the host buffers are pinned and the copies non-blocking."""
        return self.transfers.pinned

    # ------------------------------------------------------------------ allocation

    def buffer(
        self,
        mesh: DeviceMesh,
        placements: Sequence,
        shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        layout: Optional[Union[Layout, RaggedLayout]],
        zero_fill: bool = True,
    ) -> DBuffer:
        """A host DBuffer in the transfers' memory (pinned where they pin), zero-filled unless
        ``zero_fill=False``."""
        return host_dbuffer(self.transfers, mesh, placements, shapes, dtype, layout, zero_fill)

    def in_residence(self, buf: DBuffer) -> DBuffer:
        """``buf`` itself, or (``pin`` and it is not pinned: a buffer rebuilt by a dtype change)
        a pinned copy with the same values and the same released state."""
        if not self.pin or self.transfers.is_pinned(buf.local_buffer):
            return buf
        released = buf.is_storage_released()
        out = self.buffer(buf.mesh, buf.placements, buf.shapes, buf.dtype, buf.layout, zero_fill=False)
        if released:
            out.release_storage()
        else:
            out.local_buffer.copy_(buf.local_buffer)
        return out

    # ------------------------------------------------------------------ host -> device

    @torch.no_grad()
    def upload(self, src: DBuffer, out: Optional[DBuffer] = None) -> DBuffer:
        """Copy ``src`` (host) to the compute device: into ``out``, or into this group's upload
        target (same placements, dtype and layout as ``src``; storage until
        :meth:`release_upload`). Runs on the current stream, so call it where the collective
        that reads the result will run."""
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

    # ------------------------------------------------------------------ device -> host

    @torch.no_grad()
    def download(self, src: torch.Tensor, dst: torch.Tensor, add: bool) -> None:
        """Copy (``add``: add) the device tensor ``src`` into the host tensor ``dst``, casting to
        ``dst``'s dtype. Runs on the current stream (the reduction's). An overwrite into pinned
        memory is non-blocking; an add first lands in a host temporary (blocking) and is summed
        on the host, after the copies still in flight into ``dst`` are done."""
        self.used_here(src)
        if add:
            self.settle()
            dst.add_(src.to(self.device, dst.dtype))
            return
        self._track(self.transfers.copy(dst, src))

    # ------------------------------------------------------------------ ordering

    def used_here(self, t: torch.Tensor) -> None:
        """The copy about to be queued on the current stream reads the device tensor ``t``, whose
        owner may free it right after (``grad_in``'s storage is resized to 0, which no kept
        reference can delay): :meth:`_track` orders that stream after the copy. Held only until
        then (the caller holds ``t`` while it queues the copy)."""
        self._reads.append(t)

    def _track(self, done: Optional[Completion]) -> None:
        """After a copy between host and device queued on the current stream. A synchronous copy
        (no pinned memory, or the CPU) is done on return: nothing to order. A non-blocking one is
        kept until :meth:`settle` waits for it on the host, and if it read device memory
        (:meth:`used_here`), the stream that opened the launch the copy is queued in (the
        compute stream; the copy runs on the reduce-scatter stream) waits for its event when that
        launch ends, before the memory's owner can free and reuse it (FSDP2's events instead of
        ``record_stream``; see :mod:`fsdp.group.streams`, item 5)."""
        reads, self._reads = self._reads, []
        if done is None:
            return
        self._pending.append(done)
        if reads:
            CommStreams.for_device(self.compute_device).launcher_waits(done.event)

    def settle(self) -> None:
        """Block the host until every non-blocking copy to or from this group's host buffers is
        done (a no-op when every copy was synchronous)."""
        pending, self._pending, self._reads = self._pending, [], []
        for done in pending:
            done.synchronize()
