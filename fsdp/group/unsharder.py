"""Unsharder: one group's model weights between optimizer steps, and where they are registered.

It runs the cycle the unit drives (:mod:`fsdp.unit.state`): refresh, unshard, registration and
reshard, and owns, once each, the main weights' version (:class:`MainVersion`), the unsharded
weights' life (:class:`~fsdp.group.unsharded_state.UnshardedLife`), the gather in flight, the
post-forward slice, the forward-only tail and the registrations. It never sees its group.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from dbuffer import CallLabel, DBuffer, Pending, PreparedSlot
from fsdp.group.forward_only import ForwardOnlyTail
from fsdp.group.grad_mode import without_grad
from fsdp.group.members import meta_error
from fsdp.group.parts import Comms, GatherKind, PostForwardSlice, SharedGatherPart, Weights
from fsdp.group.plan import CommsKind, GatherSource, GroupPlan, Sharing, Unsharding
from fsdp.group.profiling import label
from fsdp.group.registration import Registrations
from fsdp.group.streams import CommStreams
from fsdp.group.unsharded_state import Unsharded, UnshardedLife

__all__ = ["MainVersion", "Unsharder"]


class MainVersion:
    """Which main weights the model weights were refreshed from: ``stale``
    (:meth:`Unsharder.mark_stale`), ``key`` (``version_key()`` then), ``written_key`` (the optimizer
    wrote the model shard: no cast), ``refreshes`` (the unsharded version)."""

    def __init__(self) -> None:
        self.stale = True
        self.key: object = None
        self.written_key: object = None
        self.refreshes = 0

    def is_current(self, key: object) -> bool:
        return not self.stale and key == self.key

    def refreshed(self, key: object) -> None:
        self.key, self.stale, self.written_key = key, False, None
        self.refreshes += 1


class Unsharder:
    """See the module docstring. ``weights``: the group's weights part; ``registrations``: where its
    parameters sit on the modules; ``sharded_params``: registered between uses (the group's list: an
    adopted parameter replaces its entry); ``comms``, ``replicated``: the gather's collective and
    target placements; ``plan``: its routes; ``streams``: its device's (meta until ``to_empty``:
    ``unshard`` raises); ``forward_only``: the tail freed after forward."""

    # reshard_after_forward=n: the 1/n slice kept between forward and backward (fsdp.compose.post_forward).
    post_forward: Optional[PostForwardSlice] = None

    def __init__(self, weights: Weights, registrations: Registrations, sharded_params: list[nn.Parameter],
                 comms: Comms, replicated: tuple, streams: CommStreams, plan: GroupPlan, call_label: CallLabel,
                 names: str, forward_only: Optional[ForwardOnlyTail] = None) -> None:
        self.weights = weights
        self.registrations = registrations
        self.sharded_params = sharded_params
        self.registered: Optional[list[nn.Parameter]] = None  # what fsdp last put on the modules (None: the originals)
        self.replicated = replicated
        self.streams, self._on_meta = streams, streams.device.type == "meta"
        self.call_label = call_label
        self.forward_only = forward_only
        self._names = names
        self.version = MainVersion()
        self.unsharded = UnshardedLife(names)
        self._pending: Optional[Pending] = None
        self._shared: Optional[tuple[SharedGatherPart, int]] = None  # (SharedGather, part) of the gather in flight
        self.replanned(plan, comms)

    def replanned(self, plan: GroupPlan, comms: Comms) -> None:
        """Run ``plan``'s routes from now on, gathering by ``comms`` (dbuffer's: prepared once)."""
        self._unsharding, self._sharing, self.comms = plan.unsharding, plan.sharing, comms
        kept_source = plan.gather_source in (GatherSource.OWN_ROW, GatherSource.MAIN, GatherSource.MODEL)
        self._gathers = PreparedSlot() if plan.config.comms is CommsKind.DBUFFER and kept_source else None

    def rebuilt(self, streams: CommStreams) -> None:
        """The buffers were rebuilt (``module.to``, ``to_empty``; new ``streams``): refresh next."""
        self.streams, self._on_meta = streams, streams.device.type == "meta"
        self.unsharded.freed()
        if self.post_forward is not None:  # follow the new gathered buffer
            self.post_forward = self.post_forward.rebuilt(self.weights.gathered_buffer())
        self.mark_stale()

    def mark_stale(self, model_written: bool = False) -> None:
        """The main weights changed: refresh before the next use (``model_written``: the model shard
        was written too, so no cast). A gather in flight read the old weights: it lands now, and the
        next use gathers again instead of taking it."""
        self.wait_unshard()
        self.version.stale = True
        self.version.written_key = self.weights.version_key() if model_written else None

    def is_current(self) -> bool:
        """Whether no :meth:`refresh` is pending (not marked stale, no in-place update since)."""
        return self.version.is_current(self.weights.version_key())

    @without_grad
    def refresh(self) -> None:
        """Update the model weights if the main weights changed (:meth:`mark_stale`, or an in-place
        update); ZeRO-1/2 keep unsharded weights, so they gather now, ZeRO-3 at :meth:`unshard`."""
        key = self.weights.version_key()
        if self.version.is_current(key) or self._on_meta:  # meta: nothing until to_empty
            return
        with label("fsdp::optimizer_refresh"):
            self.weights.refresh(model_current=key == self.version.written_key)
            if self._unsharding is Unsharding.GATHER_AT_REFRESH:  # ZeRO-1/2
                self.unsharded.begin_gather()
                target = self.weights.begin_gather(GatherKind.OWN)
                self._all_gather(self.weights.gather_source(), target).wait()
                self.weights.end_gather(refill=False)
                self.weights.release_model_shard()  # gathered until the next step: read again only after it
        self.version.refreshed(key)
        if self._unsharding is not Unsharding.GATHER_AT_UNSHARD:  # ZeRO-0/1/2: current from here to the next step
            if self.unsharded.state is not Unsharded.GATHERING:
                self.unsharded.begin_gather()  # ZeRO-0: the model weights are made from main here
            self.unsharded.gathered(self.version.refreshes)

    def needs_gather(self) -> bool:
        """Whether :meth:`unshard` would gather now: ZeRO-3, not current, none in flight."""
        if self._pending is not None or self._unsharding is not Unsharding.GATHER_AT_UNSHARD:
            return False
        return not (self.unsharded.is_current(self.version.refreshes) and self.weights.has_unsharded())

    def prepare_gather(self) -> None:
        """Before a gather: raise FSDP2's ``RuntimeError`` if on meta, else :meth:`refresh`."""
        if self._on_meta:
            raise RuntimeError(meta_error([i.fqn for i in self.registrations.infos]))
        self.refresh()

    def can_share_gather(self) -> bool:
        """Whether the next gather may join the unit's (the plan allows it, no slice to gather)."""
        return self._sharing is Sharing.MAY_SHARE and self.unsharded.state is not Unsharded.SLICE_KEPT

    def join_gather(self, pending: Pending, shared: SharedGatherPart, index: int) -> None:
        """Make part ``index`` of a shared gather (``gather_together``) the gather in flight."""
        self.unsharded.begin_gather()
        self._pending = pending
        self._shared = (shared, index)

    def gather_in_flight(self) -> bool:
        """Whether a gather (own or shared) is in flight; its source was refreshed at launch."""
        return self._pending is not None

    def unshard(self, async_op: bool = False) -> None:
        """Make the unsharded weights current: all-gather (ZeRO-3) into the reused buffers."""
        self.prepare_gather()
        self.launch_gather(async_op)

    def launch_gather(self, async_op: bool = False) -> None:
        """:meth:`unshard` after :meth:`prepare_gather` (a unit prepares all its groups first)."""
        if not self.needs_gather():
            if self._pending is not None and not async_op:
                self.wait_unshard()
            return
        post = self.post_forward
        if self.unsharded.state is Unsharded.SLICE_KEPT and self.unsharded.version != self.version.refreshes:
            post.drop()  # the weights changed since forward
            self.unsharded.freed()
        sliced = self.unsharded.state is Unsharded.SLICE_KEPT  # backward after reshard_after_forward=n
        target = self.weights.begin_gather(GatherKind.POST_FORWARD_SLICE if sliced else GatherKind.OWN)
        self.unsharded.begin_gather()
        with self.streams.launch(self.streams.all_gather):
            if sliced:  # gathered within n ranks, from the kept slices
                with self.call_label:
                    self._pending = post.gather()
            else:
                self._pending = self._all_gather(self.weights.gather_source(), target)
        if not async_op:
            self.wait_unshard()

    def _all_gather(self, source: DBuffer, target: DBuffer) -> Pending:
        with label("fsdp::all_gather", call=self.call_label):
            if self._gathers is not None:
                return self._gathers.start(source, self.replicated, target)
            return self.comms.all_gather(source, self.replicated, target)

    def wait_unshard(self) -> None:
        """Finish the gather in flight, if any: wait, copy out, mark the weights current."""
        if self._pending is None:
            return
        # The launch's event first, as FSDP2 does (fsdp.group.streams, "Copy-out").
        self.streams.wait(self.streams.all_gather)
        self._pending.wait()
        self._pending = None
        shared, self._shared = self._shared, None
        if shared is None:
            self.weights.end_gather(refill=True)
        else:
            gather, index = shared
            self.weights.end_gather(refill=True, rows=gather.rows(index))
            gather.copied_out()
        if self.post_forward is not None:
            self.post_forward.drop()
        self.unsharded.gathered(self.version.refreshes)

    def release_model_shard(self) -> None:
        """The unit keeps its unsharded weights until the next step: see
        :meth:`BufferWeights.release_model_shard <fsdp.group.weights.BufferWeights.release_model_shard>`."""
        self.weights.release_model_shard()

    def reshard_after_forward(self) -> None:
        """After forward: keep ``reshard_after_forward=n``'s ``1/n`` slice, then :meth:`reshard`."""
        post = self.post_forward
        if post is None:
            self.reshard()
            return
        self.wait_unshard()
        if self.unsharded.state is Unsharded.GATHERED and self.weights.has_unsharded():
            self.weights.keep_slice(post)
            self.weights.free_unsharded()
            self.unsharded.keep_slice()
        else:
            self._free_unsharded()

    def release_forward_only(self) -> None:
        """After a forward that keeps the unsharded weights: free the forward-only parameters
        (registered sharded) unless forward took hold of them (:mod:`fsdp.group.forward_only`)."""
        tail, params = self.forward_only, self.weights.unsharded_params
        if tail is None or self.unsharded.state is not Unsharded.GATHERED or params is None:
            return
        self.wait_unshard()
        if not tail.unheld(params) or not self.weights.release_unsharded_tail(tail):
            return
        self.unsharded.free_forward_only()
        self.register(self._forward_registration())

    def forward_only_modules(self) -> list[nn.Module]:
        """Modules reading the forward-only tail (a backward recomputation regathers it), or []."""
        infos = self.registrations.infos
        start = self.forward_only.start if self.forward_only is not None else len(infos)
        return [m for info in infos[start:] for m, _ in info.registrations]

    def keep_forward_only(self) -> None:
        """Stop freeing the forward-only tail: a second forward before backward would regather it."""
        self.forward_only = None

    def forward_only_freed(self) -> bool:
        """Whether the parameters only forward reads are freed (backward gathers none of them)."""
        return self.unsharded.state is Unsharded.FORWARD_ONLY_FREED

    def _forward_registration(self) -> list[nn.Parameter]:
        """What the modules hold once the forward-only tail is freed: sharded from its start on."""
        start = self.forward_only.start
        return self.weights.unsharded_params[:start] + self.sharded_params[start:]

    def reshard(self) -> None:
        """Free the unsharded weights (ZeRO-3 only) and any post-forward slice kept for backward."""
        if self._unsharding is not Unsharding.GATHER_AT_UNSHARD:
            return
        self.wait_unshard()
        if self.post_forward is not None:
            self.post_forward.drop()
        self._free_unsharded()

    def _free_unsharded(self) -> None:
        if self._unsharding is Unsharding.GATHER_AT_UNSHARD:
            self.weights.free_unsharded()
            self.unsharded.freed()

    def register_unsharded_params(self) -> None:
        """Register the unsharded parameters on their modules; raises RuntimeError if they were
        never gathered, or as :meth:`check_registered` does (registering nothing)."""
        params = self.weights.unsharded_params
        if params is None:
            raise RuntimeError(f"parameters {self._names} were never gathered; unshard the module first")
        if self.forward_only_freed():  # backward's registration: the freed tail stays sharded
            self.register(self._forward_registration())
            return
        self.register(params)
        if self.forward_only is not None:
            self.forward_only.note_registration(params)

    def register_sharded_params(self) -> None:
        """Register the sharded DTensor parameters (raises as :meth:`check_registered` does)."""
        self.register(self.sharded_params)

    def registered_unsharded(self) -> bool:
        """Whether the modules hold the unsharded parameters (all of them)."""
        return self.registered is not None and self.registered is self.weights.unsharded_params

    def register(self, params: list[nn.Parameter]) -> None:
        """Put ``params`` on the modules in place of each parameter's registrations (tied ones
        included); raises, registering nothing, as :meth:`check_registered` does."""
        self.registrations.put(params, self.registered, self._owner)
        if params is self.weights.unsharded_params and not hasattr(params[0], "_fsdp_unsharded"):
            for p in params:  # found by the optimizer-step pre-hook (fsdp.optim.step_hooks)
                p._fsdp_unsharded = True
        self.registered = params

    def check_registered(self) -> None:
        """Raise if a module no longer holds the parameter fsdp registered there
        (:meth:`Registrations.check <fsdp.group.registration.Registrations.check>`)."""
        self.registrations.check(self.registered, self._owner)

    def _owner(self) -> str:
        return getattr(self.sharded_params[0], "_fsdp_owner", "its fsdp unit")
