"""The typed interfaces between a :class:`~fsdp.group.param_group.ParameterGroup` and its parts.

Two directions, one Protocol each way:

* what the group calls on a part: :class:`Weights` (:class:`~fsdp.group.weights.BufferWeights`,
  :class:`~fsdp.compose.extensions.SubclassWeights`), :class:`Comms`
  (:class:`~fsdp.group.comms.DBufferComms`, :mod:`fsdp.compose.custom_comm`'s) and
  :class:`PostForwardSlice` (:class:`~fsdp.compose.post_forward.PostForwardShard`); the
  residence has its own in :mod:`fsdp.group.residence`;
* what a weights part is built from: :class:`WeightsParts`, plain data its group hands down.
  No part sees its group: the :class:`~fsdp.group.grads.GradReducer` and the
  :class:`~fsdp.group.unsharder.Unsharder` are built from what it hands down too
  (:mod:`fsdp.group.grad_parts`).

No behaviour here: Protocols and data only, checked by a type checker and by
``tests/fsdp/test_parts.py`` (every implementation has every member).
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
    SHARED = "shared"  # its part of one all-gather with the unit's other groups (fsdp.group.shared_gather)
    POST_FORWARD_SLICE = "post_forward_slice"  # gathered within n ranks from the slices kept after forward


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
    """One all-gather shared by several groups of a unit (:mod:`fsdp.group.shared_gather`), as
    each group sees it while its part is in flight."""

    def rows(self, index: int) -> torch.Tensor:
        """Group ``index``'s rows of the gathered buffer, to copy out of."""

    def copied_out(self) -> None:
        """One group copied its rows out (the last one frees the shared buffers)."""


class Weights(Protocol):
    """How a group's model weights are made from ``main``, gathered and freed
    (:mod:`fsdp.group.weights`). The group drives the cycle: :meth:`refresh` after a step,
    :meth:`begin_gather` / :meth:`gather_source` / :meth:`end_gather` around the collective,
    :meth:`free_unsharded` after use."""

    shares_gather: bool  # its gathers may be one collective with the unit's other groups
    dtype_fixed: Optional[str]  # why module.to(dtype) must not change its dtype (None: it may)
    keep_unsharded_storage: bool  # set_keep_unsharded_storage: storage stays across reshards

    @property
    def unsharded_params(self) -> Optional[list[nn.Parameter]]:
        """The parameters the modules compute with while gathered (None before the first gather)."""

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy the original parameters' values into ``main`` (after :meth:`build`)."""

    def build(self, plan: "GroupPlan", main: DBuffer, dtypes: "Dtypes", siblings: "Siblings") -> None:
        """(Re)build the model-weight and gathered buffers for the group's ``main`` weights (new
        after ``module.to(dtype)`` and ``to_empty``), in ``dtypes``, as ``siblings`` of it, to
        run ``plan``'s routes; the unsharded parameters it makes are hooked again."""

    def install_grad_hooks(self, hook_for: Callable[[int], Callable[[torch.Tensor], None]]) -> None:
        """Hook each unsharded parameter ``k`` with ``hook_for(k)``, now and whenever this part
        makes them again (the unit's hook, which hands the gradient to the reducer)."""

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
        """Free the gathered weights from ``tail``'s start on (a
        :class:`~fsdp.group.forward_only.ForwardOnlyTail`); False if this part cannot."""

    def keep_slice(self, post: PostForwardSlice) -> None:
        """Let ``post`` keep its slice of the gathered weights."""

    def init_params(self) -> list[nn.Parameter]:
        """Full parameters for an init function (``init_weights``)."""

    def commit_init(self, commit: bool) -> None:
        """Write what :meth:`init_params` gave back into ``main`` (or drop it)."""


@dataclass(frozen=True)
class WeightsParts:
    """What a weights part is built from, fixed for its life: its group's parameters
    (``infos``), ``mesh``, ``strategy``, ``placements`` (a reduce-op change moves only the
    gradients'), ``layout``, ``kind``, ``offload`` part, the ``policy`` its dtypes came from,
    whether the parameters require grad, the registered ``sharded_params`` (filled with what
    :meth:`Weights.new_sharded_params` makes first, then swapped in place, never replaced)
    and the group's ``names`` for messages. What changes (the main weights, the dtypes, the
    device after ``to_empty``) comes with :meth:`Weights.build`."""

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
