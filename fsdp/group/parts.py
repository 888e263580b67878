"""The typed interfaces between a :class:`~fsdp.group.param_group.ParameterGroup` and its parts.

Protocols for what the group calls on a part (:class:`Weights`, :class:`Comms`,
:class:`PostForwardSlice`; the residence's are in :mod:`fsdp.group.residence`) and
:class:`WeightsParts`, the data a weights part is built from, as no part sees its group
(:mod:`fsdp.group.grad_parts`). No behaviour; ``tests/fsdp/test_parts.py`` checks implementations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import DBuffer, Pending

if TYPE_CHECKING:  # annotations only: these modules import this one's users
    from fsdp.group.comms import AllGatherComm, ReduceScatterComm
    from fsdp.group.forward_only import ForwardOnlyTail
    from fsdp.group.layouts import ChunkedLayout, FlatLayout, ParamKind
    from fsdp.group.members import GroupPlacements, ParamInfo
    from fsdp.group.plan import GroupPlan
    from fsdp.group.policy import Dtypes, MixedPrecisionPolicy, Strategy
    from fsdp.group.residence import Residence
    from fsdp.group.siblings import Siblings

__all__ = ["Comms", "GatherKind", "PostForwardSlice", "SharedGatherPart", "Weights", "WeightsParts"]


class GatherKind(enum.Enum):
    """What a weights part's next gather is (:meth:`Weights.begin_gather`)."""

    OWN = "own"  # the group's own all-gather of this rank's shard into its own target
    SHARED = "shared"  # its part of one all-gather with the unit's other groups (shared_gather)
    POST_FORWARD_SLICE = "post_forward_slice"  # within n ranks, from the slices kept after forward


class Comms(Protocol):
    """A group's two collectives (:mod:`fsdp.group.comms`)."""

    all_gather_comm: Optional[AllGatherComm]  # FSDP2's comm objects, if any
    reduce_scatter_comm: Optional[ReduceScatterComm]

    def all_gather(self, source: DBuffer, placements: tuple, target: DBuffer) -> Pending:
        """``target`` = ``source`` gathered to ``placements``, in flight."""

    def reduce(self, source: DBuffer, placements: tuple, out: DBuffer,
               async_op: bool = True) -> Union[Pending, DBuffer]:
        """``out`` = ``source`` (Partial) reduced to ``placements``: a Pending, or ``out``."""


class PostForwardSlice(Protocol):
    """The ``1/n`` slice of a group's gathered weights kept from forward to backward."""

    buffer: DBuffer

    @property
    def ranks(self) -> int:
        """The ``n`` of ``reshard_after_forward=n``: the ranks a backward's gather spans."""

    def keep(self, fill: Optional[Callable[[torch.Tensor, int, int], None]] = None) -> None:
        """Copy this rank's slice out of the gathered weights (or let ``fill`` write it)."""

    def gather(self) -> Pending:
        """All-gather the kept slices into the gathered buffer, in flight."""

    def drop(self) -> None:
        """Release the slice."""

    def rebuilt(self, unsharded: DBuffer) -> "PostForwardSlice":
        """The same slice for a rebuilt gathered buffer."""


class SharedGatherPart(Protocol):
    """A group's view of an all-gather it shares with others (:mod:`fsdp.group.shared_gather`)."""

    def rows(self, index: int) -> torch.Tensor:
        """Group ``index``'s rows of the gathered buffer, to copy out of."""

    def copied_out(self) -> None:
        """One group copied its rows out (the last one frees the shared buffers)."""


class Weights(Protocol):
    """Makes a group's model weights from ``main`` (:mod:`fsdp.group.weights`); the group's
    Unsharder drives :meth:`refresh`, :meth:`begin_gather` to :meth:`end_gather`, then
    :meth:`free_unsharded`."""

    dtype_fixed: Optional[str]  # why module.to(dtype) must not change its dtype (None: it may)
    keep_unsharded_storage: bool  # set_keep_unsharded_storage: storage stays across reshards

    @property
    def unsharded_params(self) -> Optional[list[nn.Parameter]]:
        """The parameters the modules compute with while gathered (None before the first gather)."""

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy the original parameters' values into ``main`` (after :meth:`build`)."""

    def build(self, plan: "GroupPlan", main: DBuffer, dtypes: "Dtypes", siblings: "Siblings") -> None:
        """(Re)build the weight buffers for new ``main``, ``dtypes``, ``siblings`` and ``plan``."""

    def install_grad_hooks(self, hook_for: Callable[[int], Callable[[torch.Tensor], None]]) -> None:
        """Hook each unsharded parameter ``k`` with ``hook_for(k)``, again whenever it is remade."""

    def replanned(self, plan: "GroupPlan") -> None:
        """The group compiled its plan again (a setter, between steps): run ``plan``'s routes."""

    def new_sharded_params(self) -> list[nn.Parameter]:
        """The sharded parameters (DTensor views of ``main``) to register on the modules."""

    def version_key(self) -> object:
        """Changes whenever the main weights change in place (the refresh compares it)."""

    def refresh(self, model_current: bool) -> None:
        """Make the model-dtype shard from ``main`` (``model_current``: it was written already)."""

    def release_model_shard(self) -> None:
        """Free the model-dtype shard until the next refresh (ZeRO-1/2: gathered already)."""

    def has_unsharded(self) -> bool:
        """Whether the gathered weights have storage."""

    def begin_gather(self, kind: GatherKind) -> Optional[DBuffer]:
        """Allocate what the gather writes; the target buffer (None: ``kind`` brings its own)."""

    def gather_source(self) -> DBuffer:
        """What this rank contributes to the gather."""

    def gathered_buffer(self) -> DBuffer:
        """The buffer gathers land in."""

    def end_gather(self, refill: bool, rows: Optional[torch.Tensor] = None) -> None:
        """The gather landed: copy out (``rows``: this group's rows of a shared gather)."""

    def free_unsharded(self) -> None:
        """Release the gathered weights' storage."""

    def release_unsharded_tail(self, tail: ForwardOnlyTail) -> bool:
        """Free the gathered weights from ``tail.start`` on; False if this part cannot."""

    def keep_slice(self, post: PostForwardSlice) -> None:
        """Let ``post`` keep its slice of the gathered weights."""

    def init_params(self) -> list[nn.Parameter]:
        """Full parameters for an init function (``init_weights``)."""

    def commit_init(self, commit: bool) -> None:
        """Write what :meth:`init_params` gave back into ``main`` (or drop it)."""


@dataclass(frozen=True)
class WeightsParts:
    """Fixed inputs of a weights part (a reduce-op change moves only the gradients' ``placements``;
    ``sharded_params`` is swapped in place); the rest comes with :meth:`Weights.build`."""

    infos: list["ParamInfo"]
    mesh: DeviceMesh
    strategy: "Strategy"
    placements: "GroupPlacements"
    layout: Union[FlatLayout, ChunkedLayout]
    kind: "ParamKind"
    offload: "Residence"
    policy: Optional["MixedPrecisionPolicy"]
    requires_grad: bool
    sharded_params: list[nn.Parameter]
    names: str
