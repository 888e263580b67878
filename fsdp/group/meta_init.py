"""A group's weights made or replaced outside training: meta-device init, ``init_weights``, adoption.

As in FSDP2, ``to_empty`` (:func:`materialize`) keeps the parameter objects, so an optimizer built
earlier stays valid; then ``init_weights`` (:func:`begin_init` / :func:`end_init`), a checkpoint
or DTensors assigned before the first forward (:func:`adopt_assigned`) fill them.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from dbuffer import mesh_device
from fsdp.group.grad_parts import grad_parts
from fsdp.group.registration import note_registration

if TYPE_CHECKING:
    from fsdp.group.param_group import ParameterGroup

__all__ = ["adopt_assigned", "begin_init", "check_swappable", "end_init", "materialize", "swap_in"]


@torch.no_grad()
def materialize(group: ParameterGroup, device: torch.device) -> None:
    """``to_empty`` for a meta-built group: storage on ``device``, parameters keep their identity.
    Raises ``ValueError`` for a device not of the mesh's type."""
    if not group.is_meta:
        return
    device = torch.device(device)
    allowed = {group.mesh.device_type} | ({"cpu"} if group.offload.on_host else set())
    if device.type not in allowed:
        raise ValueError(
            f"to_empty(device={device}): the mesh of parameters {group.names()} is for "
            f"{group.mesh.device_type!r}; pass a {group.mesh.device_type} device (or build the mesh for {device.type!r})"
        )
    check_swappable(group)
    main = group.main
    group.place_main(main.placements, main.shapes, main.dtype, main.layout, device)
    group.build_weights()
    if group.grads is not None:
        group.grads = group.grads.rebuilt(grad_parts(group))
    swap_in(group.sharded_params, group.new_sharded_params())
    group.unsharder.rebuilt(group.streams)


@torch.no_grad()
def adopt_assigned(group: ParameterGroup) -> bool:
    """Take over DTensors assigned since ``fully_shard`` (as FSDP2's lazy init): values copied in,
    the assigned object *becomes* the sharded parameter, so an optimizer built on it trains the
    model. Collective when its layout differs from fsdp's. Anything else assigned raises at the
    next registration. Returns whether anything was adopted."""
    if group.unsharder.registered is not group.sharded_params:
        return False
    adopted = False
    for k, info in enumerate(group.infos):
        want = group.sharded_params[k]
        found = [m._parameters.get(n) for m, n in info.registrations]
        assigned = [a for a in found if a is not want and _adoptable(a, want, group.mesh)]
        if not assigned:
            continue
        have = assigned[0]  # tied registrations loaded separately hold equal values
        for other in assigned[1:]:
            if other is not have:  # no longer registered: an optimizer holding it is refused
                other._fsdp_owner = getattr(want, "_fsdp_owner", "its fsdp unit")
        if have.device.type != "meta":
            if group.is_meta:
                materialize(group, have.device)
            _copy_into_shard(group, k, have)
        _swap_in_one(group, k, have)
        adopted = True
    if adopted:
        group.unsharder.mark_stale()
    return adopted


def begin_init(group: ParameterGroup) -> None:
    """Register full main-dtype parameters for an init function to fill."""
    if group.is_meta:  # init_weights without to_empty
        materialize(group, mesh_device(group.mesh))
    group.initialising = True
    group.unsharder.register(group.weights.init_params())


@torch.no_grad()
def end_init(group: ParameterGroup, commit: bool = True) -> None:
    """Keep this rank's part of the initialised weights (no communication) and refresh;
    ``commit=False`` (a failed init) only restores the registration."""
    group.weights.commit_init(commit)
    group.initialising = False
    group.unsharder.register_sharded_params()
    if commit:
        group.unsharder.mark_stale()
        group.unsharder.refresh()


def check_swappable(group: ParameterGroup) -> None:
    """Raise before anything changes if a sharded parameter cannot keep its identity."""
    for p in group.sharded_params:
        if weakref.getweakrefs(p):
            raise RuntimeError(
                f"cannot rebuild parameter {group.names()}: something holds a weak reference to it, "
                f"which swapping its contents (keeping its identity) would break"
            )


def swap_in(params: list[nn.Parameter], new_params: list[nn.Parameter]) -> None:
    """Give ``params`` the contents of ``new_params``, keeping their attributes (as ``_apply``)."""
    for old, new in zip(params, new_params):
        old.grad = None  # attached again by the caller; a reference would block the swap
        for key, value in vars(old).items():
            if key not in vars(new) and key != "main_grad":
                setattr(new, key, value)
        torch.utils.swap_tensors(old, new)


def _copy_into_shard(group: ParameterGroup, k: int, src: DTensor) -> None:
    """This rank's part of parameter ``k`` from ``src``; communicates by types and placements only."""
    target = group.sharded_params[k]
    local = target.to_local()
    if type(target) is DTensor and type(src) is DTensor and src.placements == target.placements:
        local.copy_(src.to_local())  # both DTensor's own pieces: no communication
    elif type(target) is DTensor:
        local.copy_(distribute_tensor(src.full_tensor(), group.mesh, target.placements).to_local())
    else:  # fsdp's row or element pieces
        local.copy_(group.main.local_piece(k, src.full_tensor()).reshape(local.shape))


def _swap_in_one(group: ParameterGroup, k: int, assigned: nn.Parameter) -> None:
    """``assigned`` becomes sharded parameter ``k``; the old object is marked for refusal."""
    ours = group.sharded_params[k]
    assigned.grad = ours.grad = None
    torch.utils.swap_tensors(assigned, ours)
    ours._fsdp_owner = getattr(assigned, "_fsdp_owner", "its fsdp unit")
    group.sharded_params[k] = assigned
    for m, n in group.infos[k].registrations:
        m._parameters[n] = assigned
    note_registration()


def _adoptable(assigned, ours: DTensor, mesh: DeviceMesh) -> bool:
    """A DTensor parameter of ``ours``' shape on ``mesh``."""
    return (
        isinstance(assigned, nn.Parameter)
        and isinstance(assigned, DTensor)
        and assigned.shape == ours.shape
        and assigned.device_mesh == mesh
        and not weakref.getweakrefs(assigned)
    )
