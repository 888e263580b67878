"""Meta-device init, ``init_weights`` and FSDP2's adoption of assigned parameters, for :class:`~fsdp.group.param_group.ParameterGroup`.

FSDP2's flow, which this follows: ``fully_shard`` on a model built under ``torch.device("meta")``
leaves the sharded parameters on meta (a group's buffers are meta DBuffers: shapes, layout and
placements, no storage); ``module.to_empty(device=...)`` gives each rank's shards storage
(:meth:`MetaInit.materialize`), keeping the parameter objects, so an optimizer built earlier
stays valid; then the user initialises the sharded model or loads a checkpoint. DTensors assigned
to the modules before the first forward (``load_state_dict(sharded_sd, assign=True)``,
``module.weight = nn.Parameter(dtensor)``) are adopted (:meth:`MetaInit.adopt_assigned`): their
values are copied into fsdp's layout and the assigned objects *become* the sharded parameters.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from dbuffer import DBuffer, mesh_device
from fsdp.group.registration import note_registration

__all__ = ["MetaInit", "meta_error"]


class MetaInit:
    """Mixin of :class:`~fsdp.group.param_group.ParameterGroup`: the meta-device and adoption steps."""

    @property
    def is_meta(self) -> bool:
        """Built under ``torch.device("meta")`` and not yet given storage (:meth:`materialize`)."""
        return self.main.device.type == "meta"

    @torch.no_grad()
    def materialize(self, device: torch.device) -> None:
        """``to_empty`` for a meta-built group: every buffer gets (zeroed) storage on ``device``,
        this rank's device of the mesh; the sharded parameters keep their identity (their
        contents are swapped, so references and optimizers built on meta stay valid) and become
        views of the new main weights. Values are meaningless until initialised (``reset_parameters``
        on the sharded modules, :func:`fsdp.init_weights`) or loaded, exactly as ``to_empty``."""
        if not self.is_meta:
            return
        device = torch.device(device)
        allowed = {self.mesh.device_type} | ({"cpu"} if self.offload.on_host else set())
        if device.type not in allowed:
            raise ValueError(
                f"to_empty(device={device}): the mesh of parameters {self._names()} is for "
                f"{self.mesh.device_type!r}; pass a {self.mesh.device_type} device (or build the mesh for {device.type!r})"
            )
        self._check_swappable()
        main = self.main
        self._place_main(main.placements, main.shapes, main.dtype, main.layout, device)
        self._build_compute_buffers()
        if self.grads is not None:
            self.grads = self.grads.rebuilt()
        self._swap_in(self._new_sharded_params())
        self._gathered = None
        self.mark_stale()

    @torch.no_grad()
    def adopt_assigned(self) -> bool:
        """Take over parameters assigned to the modules since ``fully_shard`` and before the first
        forward, as FSDP2's lazy init does (``module.weight = nn.Parameter(dtensor)``,
        ``load_state_dict(sharded_sd, assign=True)``): a DTensor of the parameter's shape on the
        group's mesh. Its values are copied into the main weights (materialising a meta-built
        group on the DTensor's device first) and the assigned object *becomes* fsdp's sharded
        parameter (contents swapped, identity kept), so an optimizer built on it trains the model.
        Collective when its layout differs from fsdp's (a ``full_tensor()``): every rank of the
        mesh adopts the same parameters. Anything else assigned raises, see :meth:`check_registered`.
        Returns whether anything was adopted."""
        if self._registered is not self.sharded_params:
            return False
        adopted = False
        for k, info in enumerate(self.infos):
            want = self.sharded_params[k]
            found = [m._parameters.get(n) for m, n in info.registrations]
            assigned = [a for a in found if a is not want and _adoptable(a, want, self.mesh)]
            if not assigned:
                continue
            have = assigned[0]  # tied registrations loaded separately hold equal values
            for other in assigned[1:]:
                if other is not have:  # no longer registered: an optimizer holding it is refused
                    other._fsdp_owner = getattr(want, "_fsdp_owner", "its fsdp unit")
            if have.device.type != "meta":
                if self.is_meta:
                    self.materialize(have.device)
                self._copy_into_main(k, have)
            self._swap_in_one(k, have)
            adopted = True
        if adopted:
            self.mark_stale()
        return adopted

    def _copy_into_main(self, k: int, src: DTensor) -> None:
        """This rank's part of parameter ``k`` from a DTensor of its full shape. Whether this
        communicates depends only on types and placements, so every rank decides alike."""
        target = self.sharded_params[k]
        local = target.to_local()
        if type(target) is DTensor and type(src) is DTensor and src.placements == target.placements:
            local.copy_(src.to_local())  # both DTensor's own pieces: no communication
        elif type(target) is DTensor:
            local.copy_(distribute_tensor(src.full_tensor(), self.mesh, target.placements).to_local())
        else:
            local.copy_(_rows_of(src.full_tensor(), self.main, k, local))

    def _swap_in_one(self, k: int, assigned: nn.Parameter) -> None:
        """The assigned object becomes fsdp's sharded parameter ``k``; fsdp's old object gets the
        assigned contents and is marked, so an optimizer still holding it is refused."""
        ours = self.sharded_params[k]
        assigned.grad = ours.grad = None
        torch.utils.swap_tensors(assigned, ours)
        ours._fsdp_owner = getattr(assigned, "_fsdp_owner", "its fsdp unit")  # no _fsdp_group: refused
        self.sharded_params[k] = assigned
        for m, n in self.infos[k].registrations:
            m._parameters[n] = assigned
        note_registration()  # optimizers are checked again

    # ------------------------------------------------------------------ init_weights and swaps

    def _check_swappable(self) -> None:
        for p in self.sharded_params:
            if weakref.getweakrefs(p):
                raise RuntimeError(
                    f"cannot rebuild parameter {self._names()}: something holds a weak reference to it, "
                    f"which swapping its contents (keeping its identity) would break"
                )

    def _swap_in(self, new_params: list[nn.Parameter]) -> None:
        """Give the current sharded parameter objects the contents of ``new_params`` (attributes
        set on the old ones stay), as ``nn.Module._apply`` does for DTensor parameters."""
        for old, new in zip(self.sharded_params, new_params):
            old.grad = None  # attached again by the caller; a reference would block the swap
            for key, value in vars(old).items():
                if key not in vars(new) and key != "main_grad":
                    setattr(new, key, value)
            torch.utils.swap_tensors(old, new)

    def begin_init(self) -> None:
        """Register full plain parameters in the main dtype for an init function to fill: the
        main weights themselves when they are replicated (``no_shard``), otherwise a temporary
        replicated buffer of this group only, never of the whole model."""
        if self.is_meta:  # init_weights without to_empty: the mesh's device
            self.materialize(mesh_device(self.mesh))
        if self.strategy.shard_optim:
            self._init_buffer = self._init_target()
        target = self._init_buffer if self._init_buffer is not None else self.main
        params = [self._module_param(k, target.get_local_tensor(k)) for k in range(len(self.infos))]
        self._register(params)

    @torch.no_grad()
    def end_init(self, commit: bool = True) -> None:
        """Keep this rank's rows of the initialised weights (a local copy, no communication),
        drop the temporary buffer, register the sharded parameters again and refresh the model
        weights. ``commit=False`` (after a failed init function) only restores the registration."""
        buf, self._init_buffer = self._init_buffer, None
        if commit and buf is not None:
            self._commit_init(buf)
        self.use_params(unsharded=False)
        if commit:
            self.mark_stale()
            self.refresh()

    def _init_target(self) -> DBuffer:
        """The replicated main-dtype buffer of full tensors whose views ``init_weights`` fills."""
        return self.layout.unsharded_buffer(self.main, self.placements.replicated, self.dtypes.main, self.main.device, True)

    def _commit_init(self, buf: DBuffer) -> None:
        """Keep this rank's part of the initialised full weights in ``buf`` (a local copy)."""
        self._fill_main([buf.get_local_tensor(k) for k in range(len(self.infos))])


def meta_error(fqns: list[str]) -> str:
    """FSDP2's message (tests match it) for running on parameters still on the meta device."""
    return (
        f"FSDP parameters should be materialized from meta device before training, but the following "
        f"were still on meta device: {fqns}. Call model.to_empty(device=...) and then initialise "
        f"(reset_parameters() on the sharded modules, fsdp.init_weights(model)) or load a checkpoint."
    )


def _adoptable(assigned, ours: DTensor, mesh: DeviceMesh) -> bool:
    """An assigned parameter fsdp can take over: a DTensor of the same shape on the same mesh."""
    return (
        isinstance(assigned, nn.Parameter)
        and isinstance(assigned, DTensor)
        and assigned.shape == ours.shape
        and assigned.device_mesh == mesh
        and not weakref.getweakrefs(assigned)
    )


def _rows_of(full: torch.Tensor, main: DBuffer, k: int, local: torch.Tensor) -> torch.Tensor:
    """This rank's rows of tensor ``k`` of ``main`` cut out of its full value."""
    return main.local_piece(k, full).reshape(local.shape)
