"""Where a group's main state lives: the ``offload`` part every group has, and its Protocols.

A group calls its :class:`Residence` without asking which it is: :data:`NO_OFFLOAD` (all on the
mesh's device), :class:`fsdp.compose.offload.HostOffload` (``CPUOffloadPolicy``: all on the host,
copied around each gather and reduction; a :class:`HostResidence`) or
:class:`fsdp.compose.optim_state.OptimStateOffload` (``fsdp.OptimizerStateOffloadPolicy``: the
optimizer state only, an :class:`OptimStateHome`). ``on_host`` settles the few group decisions that
differ (which buffer a reduction writes, what ``module.to`` accepts).
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
    """Elements ``[start, end)`` of a group's flat main weights and flat optimizer state, whose
    gradients start at ``grad_start`` of the flat main grads; ``tag``: the optimizer's."""

    start: int
    end: int
    grad_start: int
    tag: object = None

    @property
    def numel(self) -> int:
        return self.end - self.start


class OptimStateHome(Protocol):
    """A group's host-memory optimizer state and step passes (:mod:`fsdp.compose.optim_state`).
    Memory a :class:`~fsdp.compose.offload.HostTransfers` copy may use waits for :meth:`settle`."""

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
        """For each chunk, ``fn(chunk, w, g, views)`` on the host: ``w``, ``g`` host copies of the
        chunk of device ``weights``, ``grads``, ``views`` the host states'; ``w`` is copied back."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` between host and device, tracked until :meth:`settle`."""

    def settle(self) -> None:
        """Block the host until every copy to or from the host memory of this part is done."""


class Residence(Protocol):
    """A group's offload part: what a :class:`~fsdp.group.param_group.ParameterGroup` calls."""

    on_host: bool  # the main weights and grads live on the host (HostResidence)
    optim_state: Optional[OptimStateHome]

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
