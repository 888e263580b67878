"""A group's weights made or replaced outside training: meta-device init, ``init_weights``, adoption.

FSDP2's flow, which this follows: ``fully_shard`` on a model built under ``torch.device("meta")``
leaves the sharded parameters on meta (a group's buffers are meta DBuffers: shapes, layout and
placements, no storage); ``module.to_empty(device=...)`` gives each rank's shards storage
(:func:`materialize`), keeping the parameter objects, so an optimizer built earlier stays valid;
then the user initialises the sharded model (:func:`begin_init` / :func:`end_init` around
``fsdp.init_weights``' function) or loads a checkpoint. DTensors assigned to the modules before
the first forward (``load_state_dict(sharded_sd, assign=True)``, ``module.weight =
nn.Parameter(dtensor)``) are adopted (:func:`adopt_assigned`): their values are copied into
fsdp's layout and the assigned objects *become* the sharded parameters.

Each function takes a :class:`~fsdp.group.param_group.ParameterGroup`; what differs between
kinds of weights (DBuffers, tensor subclasses) is the group's ``weights`` part.
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

if TYPE_CHECKING:  # annotations only
    from fsdp.group.param_group import ParameterGroup

__all__ = ["adopt_assigned", "begin_init", "check_swappable", "end_init", "materialize", "swap_in"]


@torch.no_grad()
def materialize(group: ParameterGroup, device: torch.device) -> None:
    """``to_empty`` for a meta-built group: every buffer gets (zeroed) storage on ``device``,
    this rank's device of the mesh; the sharded parameters keep their identity (their contents
    are swapped, so references and optimizers built on meta stay valid) and become views of the
    new main weights. Values are meaningless until initialised or loaded, exactly as ``to_empty``."""
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
    """Take over parameters assigned to the modules since ``fully_shard`` and before the first
    forward, as FSDP2's lazy init does (``module.weight = nn.Parameter(dtensor)``,
    ``load_state_dict(sharded_sd, assign=True)``): a DTensor of the parameter's shape on the
    group's mesh. Its values are copied into the main weights (materialising a meta-built group
    on the DTensor's device first) and the assigned object *becomes* fsdp's sharded parameter
    (contents swapped, identity kept), so an optimizer built on it trains the model.
    Collective when its layout differs from fsdp's (a ``full_tensor()``): every rank of the mesh
    adopts the same parameters. Anything else assigned raises at the next registration
    (``Unsharder.check_registered``). Returns whether anything was adopted."""
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
    """Register full parameters (in the main dtype, of each parameter's own type) for an init
    function to fill; a meta-built group first gets storage on the mesh's device."""
    if group.is_meta:  # init_weights without to_empty
        materialize(group, mesh_device(group.mesh))
    group.initialising = True
    group.unsharder.register(group.weights.init_params())


@torch.no_grad()
def end_init(group: ParameterGroup, commit: bool = True) -> None:
    """Keep this rank's part of the initialised weights (a local copy, no communication),
    register the sharded parameters again and refresh the model weights. ``commit=False``
    (after a failed init function) only restores the registration."""
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
    """Give the parameter objects ``params`` the contents of ``new_params`` (attributes set on
    the old ones stay), as ``nn.Module._apply`` does for DTensor parameters."""
    for old, new in zip(params, new_params):
        old.grad = None  # attached again by the caller; a reference would block the swap
        for key, value in vars(old).items():
            if key not in vars(new) and key != "main_grad":
                setattr(new, key, value)
        torch.utils.swap_tensors(old, new)


def _copy_into_shard(group: ParameterGroup, k: int, src: DTensor) -> None:
    """This rank's part of parameter ``k`` from a DTensor of its full shape. Whether this
    communicates depends only on types and placements, so every rank decides alike."""
    target = group.sharded_params[k]
    local = target.to_local()
    if type(target) is DTensor and type(src) is DTensor and src.placements == target.placements:
        local.copy_(src.to_local())  # both DTensor's own pieces: no communication
    elif type(target) is DTensor:
        local.copy_(distribute_tensor(src.full_tensor(), group.mesh, target.placements).to_local())
    else:  # fsdp's row or element pieces
        local.copy_(group.main.local_piece(k, src.full_tensor()).reshape(local.shape))


def _swap_in_one(group: ParameterGroup, k: int, assigned: nn.Parameter) -> None:
    """The assigned object becomes fsdp's sharded parameter ``k``; fsdp's old object gets the
    assigned contents and is marked, so an optimizer still holding it is refused."""
    ours = group.sharded_params[k]
    assigned.grad = ours.grad = None
    torch.utils.swap_tensors(assigned, ours)
    ours._fsdp_owner = getattr(assigned, "_fsdp_owner", "its fsdp unit")  # no _fsdp_group: refused
    group.sharded_params[k] = assigned
    for m, n in group.infos[k].registrations:
        m._parameters[n] = assigned
    note_registration()  # optimizers are checked again


def _adoptable(assigned, ours: DTensor, mesh: DeviceMesh) -> bool:
    """An assigned parameter fsdp can take over: a DTensor of the same shape on the same mesh."""
    return (
        isinstance(assigned, nn.Parameter)
        and isinstance(assigned, DTensor)
        and assigned.shape == ours.shape
        and assigned.device_mesh == mesh
        and not weakref.getweakrefs(assigned)
    )
