"""Where a group's main state lives: the ``offload`` part every group has, and its Protocols.

A group always has an ``offload`` part (a :class:`Residence`) and calls it without asking which
it is. Three exist:

* :data:`NO_OFFLOAD` (here): main weights, main grads and optimizer state on the mesh's device;
  its moves are no-ops;
* :class:`fsdp.compose.offload.HostOffload` (``CPUOffloadPolicy``): the main weights, main grads
  and optimizer state on the host, copied to and from the device around each gather and
  reduction (``on_host``: it also allocates the host buffers, :class:`HostResidence`);
* :class:`fsdp.compose.optim_state.OptimStateOffload` (``fsdp.OptimizerStateOffloadPolicy``): main
  weights and grads on the device as without offload, only the optimizer state on the host: its
  :attr:`Residence.optim_state` is an :class:`OptimStateHome`, which the optimizers
  (:mod:`fsdp.optim`) ask for host memory for their state and for the passes that bring it to
  where the step runs.

``on_host`` answers the few decisions of the group that do differ (which buffer a reduction may
write directly, what ``module.to`` may accept); ``optim_state`` those of the optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import DBuffer

if TYPE_CHECKING:
    from dbuffer.layout import Layout, RaggedLayout

__all__ = ["Chunk", "HostResidence", "NO_OFFLOAD", "NoOffload", "OptimStateHome", "Residence"]


@dataclass(frozen=True)
class Chunk:
    """Elements ``[start, end)`` of a group's flat main weights (and of its flat optimizer state,
    laid out alike), whose gradients start at ``grad_start`` of the flat main grads; ``tag`` is
    the optimizer's (e.g. the step count of the run it belongs to)."""

    start: int
    end: int
    grad_start: int
    tag: object = None

    @property
    def numel(self) -> int:
        return self.end - self.start


class OptimStateHome(Protocol):
    """A group's optimizer state in host memory, and the passes that step it (see
    :mod:`fsdp.compose.optim_state`). Every copy between host and device goes through the part's
    :class:`~fsdp.compose.offload.HostTransfers`; after a pass or a copy the host touches host
    memory a copy may still use only after :meth:`settle`."""

    step_on: str  # "device": the step runs where the weights are, states streamed in; "host": on the host

    def host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D tensor in the part's host memory (pinned where it pins)."""

    def host_buffer(
        self, mesh: DeviceMesh, placements: Sequence, shapes: Sequence, dtype: torch.dtype,
        layout: Optional[Union[Layout, RaggedLayout]],
    ) -> DBuffer:
        """A zeroed DBuffer in the part's host memory (a sibling of the group's ``main``)."""

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in memory :meth:`host_tensor` gives (pinned where it pins)."""

    def device_pass(self, states: Sequence[torch.Tensor], chunks: Sequence[Chunk], fn: Callable) -> None:
        """For each chunk in turn, ``fn(chunk, views)`` with ``views[j]`` a device tensor holding
        ``states[j][chunk.start:chunk.end]`` (host), whose values after ``fn`` go back there."""

    def host_pass(
        self, weights: torch.Tensor, grads: torch.Tensor, states: Sequence[torch.Tensor], chunks: Sequence[Chunk],
        fn: Callable,
    ) -> None:
        """For each chunk in turn, ``fn(chunk, w, g, views)`` on the host: ``w`` and ``g`` host
        copies of the chunk of ``weights`` and ``grads`` (device), ``views`` the host states'
        slices; ``w``'s values after ``fn`` go back into ``weights``."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` between host and device, tracked until :meth:`settle`."""

    def settle(self) -> None:
        """Block the host until every copy to or from the host memory of this part is done."""


class Residence(Protocol):
    """A group's offload part: what a :class:`~fsdp.group.param_group.ParameterGroup` calls."""

    on_host: bool  # the main weights and grads live on the host (HostResidence)
    optim_state: Optional[OptimStateHome]  # the optimizer state apart from the weights, or None

    def in_residence(self, buf: DBuffer) -> DBuffer:
        """``buf`` in this part's memory (a buffer rebuilt by ``module.to(dtype)``)."""

    def upload(self, src: DBuffer, out: Optional[DBuffer] = None) -> DBuffer:
        """The model shard a gather reads, on the compute device."""

    def release_upload(self) -> None:
        """After the gather that read the upload landed."""

    def settle(self) -> None:
        """Before the host touches memory a copy of this part may still use."""


class HostResidence(Residence, Protocol):
    """A :class:`Residence` whose ``on_host`` is True also allocates the host buffers."""

    compute_device: torch.device

    def buffer(self, mesh: DeviceMesh, placements: Sequence, shapes: Sequence, dtype: torch.dtype,
               layout: Optional[Union[Layout, RaggedLayout]], zero_fill: bool = True) -> DBuffer:
        """A host DBuffer (pinned where the part pins)."""


class NoOffload:
    """The main state on the mesh's device: nothing to upload, download, pin or wait for."""

    on_host = False
    optim_state: Optional[OptimStateHome] = None

    def in_residence(self, buf: DBuffer) -> DBuffer:
        return buf

    def upload(self, src: DBuffer, out: Optional[DBuffer] = None) -> DBuffer:
        """The gather reads the model shard where it is."""
        return src

    def release_upload(self) -> None:
        pass

    def settle(self) -> None:
        pass


NO_OFFLOAD = NoOffload()
