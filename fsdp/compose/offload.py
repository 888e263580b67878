"""CPU offload: the main weights, main gradients and optimizer state of a unit live in host memory.

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
  the model weights are cast again, before gradients are accumulated on the host, zeroed or freed.

``pin_memory`` on a mesh whose device is the CPU (gloo, no accelerator): there is no device copy
for pinned memory to speed up, so the host buffers are ordinary memory and the policy works as
``pin_memory=False`` (torch FSDP2 raises there instead). The copies still run, between distinct
host buffers, so the data path is the same one a GPU runs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from dbuffer import DBuffer
from dbuffer.layout import Layout
from fsdp.group.streams import CommStreams

__all__ = ["CPUOffloadPolicy", "HostOffload", "OffloadPolicy", "check_offload_policy"]


def check_offload_policy(policy: object) -> Optional[CPUOffloadPolicy]:
    """The policy to offload with (None: no offload), or a ``TypeError`` naming the fix."""
    if isinstance(policy, CPUOffloadPolicy):
        if not isinstance(policy.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {policy.pin_memory!r}")
        return policy
    if type(policy) is OffloadPolicy:
        return None
    raise TypeError(
        f"offload_policy must be torch.distributed.fsdp.OffloadPolicy() (no offload) or "
        f"CPUOffloadPolicy(pin_memory=...) (also exported by fsdp), got {policy!r}"
    )


class HostOffload:
    """The host side of one parameter group: allocation of its host buffers and the copies
    between them and the compute device, with the events that order those copies."""

    device = torch.device("cpu")
    on_host = True  # the group's other offload part is fsdp.group.residence.NoOffload

    def __init__(self, policy: CPUOffloadPolicy, compute_device: torch.device) -> None:
        self.compute_device = compute_device
        # Pinned memory only speeds up copies to an accelerator (see the module docstring).
        self.pin = policy.pin_memory and compute_device.type != "cpu"
        self._events: list = []  # non-blocking copies that may still read or write host memory
        self._reads: list[torch.Tensor] = []  # device tensors the next recorded copy reads
        self._staging: Optional[DBuffer] = None  # the upload target (device), one per group

    # ------------------------------------------------------------------ allocation

    def buffer(
        self,
        mesh: DeviceMesh,
        placements: Sequence,
        shapes: Sequence[Sequence[int]],
        dtype: torch.dtype,
        layout: Optional[Layout],
        zero_fill: bool = True,
    ) -> DBuffer:
        """A host DBuffer (pinned with ``pin``), zero-filled unless ``zero_fill=False``."""
        plain = DBuffer(
            mesh, placements, shapes, dtype, self.device, layout=layout, zero_fill=zero_fill and not self.pin,
            check_ranks=False,  # a sibling of a buffer fully_shard checked
        )
        if not self.pin:
            return plain
        make = torch.zeros if zero_fill else torch.empty
        local = make(plain.local_buffer.numel(), dtype=dtype, pin_memory=True)
        return DBuffer(
            mesh, placements, shapes, dtype, self.device, layout=plain.layout, local_buffer=local, check_ranks=False
        )

    def adopt(self, buf: DBuffer) -> DBuffer:
        """``buf`` itself, or (``pin`` and it is not pinned: a buffer rebuilt by a dtype change)
        a pinned copy with the same values and the same released state."""
        if not self.pin or buf.local_buffer.is_pinned():
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
                staging = DBuffer(
                    src.mesh, src.placements, src.shapes, src.dtype, self.compute_device, layout=src.layout,
                    zero_fill=False, check_ranks=False,
                )
                self._staging = staging
            else:
                staging.reallocate_storage()
            out = staging
        out.local_buffer.copy_(src.local_buffer, non_blocking=self.pin)
        self._record()
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
        dst.copy_(src, non_blocking=self.pin)
        self._record()

    # ------------------------------------------------------------------ ordering

    def used_here(self, t: torch.Tensor) -> None:
        """The copy about to be queued on the current stream reads the device tensor ``t``, whose
        owner may free it right after (``grad_in``'s storage is resized to 0, which no kept
        reference can delay): :meth:`_record` orders that stream after the copy. Held only until
        then (the caller holds ``t`` while it queues the copy)."""
        self._reads.append(t)

    def _record(self) -> None:
        """After a copy between host and device queued on the current stream. Without pinned
        memory (and on the CPU) the copy is synchronous, done on return: nothing to order. With
        it, an event ends the copy: :meth:`settle` waits for it on the host, and if the copy read
        device memory (:meth:`used_here`), the stream that opened the launch the copy is queued
        in (the compute stream; the copy runs on the reduce-scatter stream) waits for it when
        that launch ends, before the memory's owner can free and reuse it (FSDP2's events instead
        of ``record_stream``; see :mod:`fsdp.group.streams`, item 5)."""
        reads, self._reads = self._reads, []
        if not self.pin:
            return
        streams = CommStreams.for_device(self.compute_device)
        event = streams.record()
        self._events.append(event)
        if reads:
            streams.launcher_waits(event)

    def settle(self) -> None:
        """Block the host until every non-blocking copy to or from this group's host buffers is
        done (a no-op without pinned memory, whose copies are synchronous)."""
        events, self._events, self._reads = self._events, [], []
        for event in events:
            event.synchronize()
