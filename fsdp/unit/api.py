"""fully_shard and FSDPModule: the public surface, shaped like torch FSDP2's.

``fully_shard(module)`` groups the parameters the module owns (everything below it that no
nested unit owns) into :class:`~fsdp.group.param_group.ParameterGroup` s, registers sharded DTensor
parameters in their place, and swaps the module's class to ``FSDP<Orig>`` so the FSDP2 methods
(``unshard``, ``reshard``, ``set_requires_gradient_sync``, ...) are available on it. Like FSDP2,
shard nested modules first (bottom-up), the root last.

Every check of the arguments runs before any buffer is built or any collective runs, so a
misuse raises the same error on every rank. Then one small collective checks that every rank
shards the same parameters with the same values (:mod:`dbuffer.agreement`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dbuffer import mesh_device
from dbuffer.agreement import check_agreement, value_digest, values_comparable
from fsdp.group.bucket import Bucket, GroupSpec, plan_buckets
from fsdp.compose.extension_protocol import check_extension_params, split_extension_members
from fsdp.compose.extensions import ExtensionParameterGroup
from fsdp.group.layout_choice import chunk_by_default, describe_layout_policy
from fsdp.compose.offload import CPUOffloadPolicy, HostOffload, OffloadPolicy, check_offload_policy
from fsdp.compose.outer_shard import OuterShardedParameterGroup, check_outer_sharding
from fsdp.group.members import ParamInfo
from fsdp.group.param_group import ParameterGroup
from fsdp.group.policy import MixedPrecisionPolicy, Strategy, parse_strategy
from fsdp.compose.post_forward import enable_post_forward_slices
from fsdp.unit import surface
from fsdp.unit.state import FSDPState, finish_grad_sync
from fsdp.unit.surface import ArgumentTypeError, DataParallelMeshDims, share_comm_ctx
from fsdp.compose.tensor_parallel import TensorParallelKind, check_params as _check_tensor_parallel, local_of
from fsdp.group.layouts import PLAIN, ChunkedLayout, describe_layout

__all__ = [
    "Bucket",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "fully_shard",
    "init_weights",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

log = logging.getLogger("fsdp")

# Attribute naming the unit that owns a parameter (set on the original and the sharded one).
_OWNER = "_fsdp_owner"
_IS_SHARD = "_fsdp_is_shard"  # on the sharded parameters fsdp registers (not on the originals)
_CLASS_CACHE: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the all-gathers."""

    def __init__(self, state: Optional[FSDPState]) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_unshard()
            self._state._use_unsharded()
            self._state = None


class FSDPModule:
    """Mixin of every sharded module (the class becomes ``FSDP<Orig>(FSDPModule, Orig)``)."""

    _fsdp_state: FSDPState

    # ---------------------------------------------------------------- FSDP2 surface

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this unit's parameters now (e.g. to overlap with other work)."""
        state = self._fsdp_state
        state.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(state)
        state._use_unsharded()
        return None

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded ones (ZeRO-3)."""
        self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: keep accumulating unsharded gradients locally (no communication) until a
        backward with sync on, or :meth:`finish_grad_sync`."""
        for state in self._states(recurse):
            state.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Explicit from now on (the root's default of not resharding no longer applies). A bool
        only, as in FSDP2 (whose error, ``ValueError``, this also is)."""
        if not isinstance(reshard_after_forward, bool):
            raise ArgumentTypeError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}; pass True or False"
            )
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of backward leaves reductions in flight and ``.grad`` unattached; a
        later last backward or :meth:`finish_grad_sync` completes them. Read by the root (set it
        there; on another unit of an initialised tree it reaches the root too, as in FSDP2)."""
        self._fsdp_state.root_knobs().is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._fsdp_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._fsdp_state.backward_prefetch = [_state_of(m) for m in modules]

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``, as in FSDP2: a unit built under ``torch.device("meta")`` keeps
        its sharded parameters on meta until now; here each rank allocates only its shards on
        ``device`` (the parameter objects keep their identity). Then initialise them on the
        sharded model (``reset_parameters()`` of each module, ``module.apply(init_fn)``, or
        :func:`init_weights`, which matches an unsharded build under the same seed) or load a
        checkpoint. ``device`` must be of the mesh's device type (under CPU offload, the host or
        the mesh's device: the shards go to the host either way). Buffers and ignored
        parameters go through ``nn.Module.to_empty``."""
        device = torch.device(device)
        if device.type != "meta":
            for state in self._states(recurse):
                for group in state.groups:
                    group.materialize(device)
        for state in self._states(recurse):
            for group in state.groups:
                have = group.main.device
                if not group.accepts_device(device):
                    raise ValueError(
                        f"to_empty(device={device}): fully_shard allocated the shards on {have}, the mesh's "
                        f"device (or the host, under CPU offload); pass that device (or build the mesh for "
                        f"{device.type})"
                    )
        return super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]  # via _apply

    def _apply(self, fn, recurse: bool = True):
        """What ``nn.Module.to`` / ``double`` / ``float`` / ``half`` / ``cpu`` / ``cuda`` /
        ``to_empty`` run. The sharded parameters of every unit below follow the new dtype (see
        :meth:`ParameterGroup.convert <fsdp.group.param_group.ParameterGroup.convert>`: their buffers
        are rebuilt from the current values, the parameter objects keep their identity, explicit
        policy dtypes stay); everything else (buffers, ignored parameters) goes through
        ``nn.Module._apply``. The shards stay on the mesh's device: ``.to`` that device is a no-op,
        ``.to`` another one raises before anything changes. As in FSDP2, the unit is resharded
        first; call it between steps, not between forward and backward.
        """
        states = self._states(recurse)
        targets = {id(g): _conversion_target(fn, g) for state in states for g in state.groups}
        for state in states:  # every unit below is checked before any changes
            for group in state.groups:
                group.check_convert(*targets[id(group)])
        state = self._fsdp_state
        state.reshard()  # the sharded parameters registered (the unsharded ones are rebuilt)
        for group in state.groups:
            group.convert(*targets[id(group)])
        hidden = []  # nested units hide their own when nn.Module._apply reaches them
        for group in state.groups:
            for info in group.infos:
                for module, name in info.registrations:
                    hidden.append((module, name, module._parameters[name]))
                    module._parameters[name] = None  # nn.Module._apply skips None
        try:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for module, name, param in reversed(hidden):
                module._parameters[name] = param

    # ---------------------------------------------------------------- FSDP2 knobs (fsdp/surface.py)

    set_requires_all_reduce = surface.set_requires_all_reduce
    set_all_reduce_hook = surface.set_all_reduce_hook
    set_gradient_divide_factor = surface.set_gradient_divide_factor
    set_reduce_scatter_divide_factor = surface.set_reduce_scatter_divide_factor
    set_force_sum_reduction_for_comms = surface.set_force_sum_reduction_for_comms
    set_unshard_in_backward = surface.set_unshard_in_backward
    set_post_optim_event = surface.set_post_optim_event
    set_custom_all_gather = surface.set_custom_all_gather
    set_custom_reduce_scatter = surface.set_custom_reduce_scatter
    set_reduce_scatter_unused_params = surface.set_reduce_scatter_unused_params
    set_reduce_scatter_max_input_buffers = surface.set_reduce_scatter_max_input_buffers
    set_separate_reduce_scatter_group = surface.set_separate_reduce_scatter_group
    set_allocate_memory_from_process_group_for_comm = surface.set_allocate_memory_from_process_group_for_comm
    set_symm_mem_for_comm = surface.set_symm_mem_for_comm
    reset_iter_state = surface.reset_iter_state

    def _get_fsdp_state(self) -> FSDPState:
        """This unit's state (what ``fully_shard.state(self)`` returns)."""
        return self._fsdp_state

    # ---------------------------------------------------------------- Megatron surface

    def zero_grad_buffer(self) -> None:
        """Zero the main-grad buffers of every unit below (``param.grad`` views stay attached)."""
        for state in self._states(True):
            for group in state.groups:
                if group.grads is not None:
                    group.grads.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        """Reduce gradients still held locally, wait for every reduction, attach ``.grad``."""
        finish_grad_sync(self._states(True), launch=True)

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        states: list[FSDPState] = []
        for m in self.modules():  # type: ignore[attr-defined]
            if isinstance(m, FSDPModule) and m._fsdp_state not in states:
                states.append(m._fsdp_state)
        return states


def _conversion_target(fn: Callable[[torch.Tensor], torch.Tensor], group: ParameterGroup):
    """(dtype, device) that ``fn`` (an ``nn.Module._apply`` function) turns the group's main
    weights into, found by applying it to an empty tensor like them."""
    probe = torch.empty(0, dtype=group.dtypes.main, device=group.main.device)
    try:
        out = fn(probe)
    except Exception as e:
        e.add_note(f"(fully_shard: converting sharded parameters {group._names()}, on {group.main.device})")
        raise
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"an nn.Module._apply function returned {type(out).__name__} for a tensor")
    return out.dtype, out.device


def _state_of(module: nn.Module) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not sharded; pass modules returned by fully_shard")
    return module._fsdp_state


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    sharding_strategy: Union[str, Strategy] = "optim_grads_params",
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    buckets: Sequence[Bucket] = (),
    bucket_size: Optional[int] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    offload_policy: OffloadPolicy = OffloadPolicy(),
    dp_mesh_dims: Optional[DataParallelMeshDims] = None,
    outer_dp_sharding_strategy: str = "no_shard",
):
    """Shard ``module`` (or a list of modules forming one unit) over ``mesh``.

    ``reshard_after_forward``: as in FSDP2, whether a unit frees its gathered weights after
    forward (and gathers again in backward). ``None`` (default): True, except for the root (the
    first unit run), whose backward starts right after its forward. After forward a unit that
    reshards has its sharded DTensor parameters registered, one that does not its unsharded
    plain ones, until the end of backward or :meth:`FSDPModule.reshard`. An ``int`` ``n`` (FSDP2's
    resharding to a smaller group) must divide the shard group's size ``W``: 1 means False, ``W``
    True; in between, each rank keeps ``1/n`` of the gathered weights after forward and backward
    gathers them within groups of ``n`` consecutive ranks (:mod:`fsdp.compose.post_forward`; ZeRO-3
    groups of plain parameters on a 1-D mesh without offload; the other groups reshard fully,
    like True).

    ``mesh``: 1-D (the data-parallel ranks) or 2-D ``(replicate, shard)`` for HSDP: parameters
    are sharded and gathered within the inner axis, gradients are reduce-scattered within it and
    all-reduced across the outer one, in one ``redistribute``. ``buckets``: explicit groups of
    parameters by name, each with its own mesh, placement, strategy and policy (see
    :class:`fsdp.Bucket`); ``bucket_size``: split the remaining default groups at this many bytes
    of main weights. Returns the module, its class swapped to ``FSDP<Orig>``. Nested units must be
    sharded first.

    Layout. By default every parameter's local shard is FSDP2's: exactly
    ``torch.chunk(full, W, 0)[rank]`` over the ``W`` shard ranks (empty where torch.chunk gives
    fewer pieces), registered as a plain DTensor with placement ``Shard(0)``, gathered and reduced
    in flat groups with FSDP2's copy after each gather and before each reduction (see
    :class:`fsdp.group.layouts.ChunkedLayout`). ``fsdp.layout_policy("auto" | "row" | "ragged")`` around the call opts
    into Megatron-FSDP's flat layouts instead, whose gathered buffer *is* the unsharded
    parameters (no copies), with row pieces handed out as exact DTensor subclasses (see
    :mod:`fsdp.group.layout_choice`); ``no_shard``, HFSDP and explicit buckets always use those.

    ``shard_placement_fn`` (FSDP2's): called once per parameter; ``Shard(dim)`` (``dim`` may be
    negative) makes its local shard ``torch.chunk(full, W, dim)[rank]``, placement ``Shard(dim)``;
    ``None`` leaves it to the default above. Any other return value raises ``TypeError``, a dim
    the parameter lacks ``ValueError``, naming the parameter. With ``no_shard`` nothing is sharded
    and the function's answers have no effect.

    Parameters that are already DTensors (tensor or expert parallelism on other axes of the same
    root mesh, e.g. ``parallelize_module(m, mesh["tp"], plan)`` then ``mesh=mesh["dp"]``) are
    sharded as FSDP2 does: their TP-local tensors in torch.chunk pieces over ``mesh`` (dim 0, or
    ``shard_placement_fn``'s), registered as DTensors on the joint ``(dp, tp)`` mesh; see
    :mod:`fsdp.compose.tensor_parallel`.

    ``offload_policy`` (FSDP2's classes, also exported by fsdp): ``CPUOffloadPolicy(pin_memory=)``
    keeps the main weights, gradients and optimizer state on the host and steps the optimizer
    there; each gather uploads the shard, each reduction downloads its result (see
    :mod:`fsdp.compose.offload`). Parameters may then be on the CPU or the mesh's device; every strategy
    works. ``pin_memory`` on a CPU mesh has nothing to speed up and is ignored.

    ``dp_mesh_dims`` (FSDP2's :class:`DataParallelMeshDims`): ``mesh`` is a named mesh and these
    of its dims are the data-parallel ones (``shard``, optionally ``replicate`` for HSDP; several
    names are flattened into one dim); see :func:`fsdp.unit.surface.data_parallel_mesh`.

    ``outer_dp_sharding_strategy`` (Megatron-FSDP's name; not in FSDP2): on a 2-D mesh,
    ``"no_shard"`` (default) is HSDP; ``"optim"`` (HFSDP) also shards the main weights, main
    grads and optimizer state across the replicate axis (``1/(R*S)`` per rank) while weights are
    still gathered on the shard axis only; see :mod:`fsdp.compose.outer_shard`.

    ``fully_shard.state(module)`` returns the unit's state, or None for a module not sharded.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    strategy = parse_strategy(sharding_strategy)
    offload = check_offload_policy(offload_policy)
    mesh = surface.data_parallel_mesh(mesh, dp_mesh_dims)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be an fsdp.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise ArgumentTypeError(f"reshard_after_forward must be a bool, an int or None, got {reshard_after_forward!r}")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(f"{type(m).__name__} is already sharded; fully_shard each module once")
    ignored = set(map(id, ignored_params or ()))
    infos, shared_with_other_units = _collect_params(modules, ignored)
    _check_devices(infos)
    mesh = _check_mesh(mesh, infos, host_ok=offload is not None)
    config = (strategy, reshard_after_forward, mp_policy, buckets, bucket_size, offload, outer_dp_sharding_strategy)
    post_forward_ranks = _post_forward_ranks(reshard_after_forward, mesh)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, mesh)
    if isinstance(buckets, Bucket):
        buckets = [buckets]
    shard_dims = _shard_dims(infos, shard_placement_fn)
    specs = plan_buckets(
        [i.fqn for i in infos],
        [i.param for i in infos],
        list(buckets),
        mesh,
        strategy,
        mp_policy,
        bucket_size,
        shard_dims,
        default_dim=0 if chunk_by_default() and outer_dp_sharding_strategy == "no_shard" else None,
    )
    for spec in specs:
        if spec.mesh is not mesh:
            _check_mesh(spec.mesh, infos, what="a bucket's mesh", host_ok=offload is not None)
        _check_params([infos[k] for k in spec.members], spec.strategy, spec.policy)
        _check_tensor_parallel([infos[k] for k in spec.members], spec.mesh, spec.dims, spec.strategy)
    check_extension_params([i.fqn for i in infos], [i.param for i in infos], specs)
    if offload is not None:
        _check_offloadable(infos)
    outer = check_outer_sharding(outer_dp_sharding_strategy, mesh, specs, [i.param for i in infos], offload)
    # The arguments are valid here; now the one collective: do all ranks shard the same thing?
    _check_ranks_agree(mesh, infos, specs, config)

    classes = [type(m) for m in modules]
    try:
        for m in modules:
            m.__class__ = _fsdp_class(type(m))
        groups = _build_groups(infos, specs, offload, outer)
        if post_forward_ranks is not None:  # every rank gets here: the view's groups are made together
            enable_post_forward_slices(groups, mesh, post_forward_ranks)
        state = FSDPState(modules, groups, mp_policy, reshard_after_forward)
        state.shared_with_other_units = shared_with_other_units
        for group in groups:
            group.use_params(unsharded=False)
    except BaseException:
        for m, cls in zip(modules, classes):
            m.__class__ = cls
        raise
    owner = f"the unit of {classes[0].__name__}"
    for info, group_param in _sharded_of(groups):
        setattr(info.param, _OWNER, owner)  # a tied registration elsewhere still refers to it
        setattr(group_param, _OWNER, owner)
        setattr(group_param, _IS_SHARD, True)
        info.param = None  # the full tensor is no longer needed
    state.install_hooks()
    for m in modules:
        m._fsdp_state = state
    return module


@torch.no_grad()
def init_weights(module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Initialise the sharded weights of every unit below ``module`` without ever holding more
    than the units being initialised (e.g. after building under ``torch.device("meta")``).

    Visits ``module.modules()`` in order and calls ``init_fn(m)`` on each (default:
    ``m.reset_parameters()`` for modules that define it and hold parameters or buffers of their
    own). While a unit's modules are visited its parameters are full plain tensors in the main
    dtype; when its last module is done each rank keeps its own rows and the full copy is freed.
    Visiting in module order keeps the random stream of an eager build: with the same seed the
    weights equal those of the module built on a real device. No communication except the
    ``optim``/``optim_grads`` refresh of the unsharded copy.
    """
    order = list(module.modules())
    owner: dict[int, FSDPState] = {}
    for m in order:
        if isinstance(m, FSDPModule):
            for sub in _own_modules(m._fsdp_state):
                owner.setdefault(id(sub), m._fsdp_state)
    last = {id(owner[id(m)]): i for i, m in enumerate(order) if id(m) in owner}
    for state in {id(s): s for s in owner.values()}.values():
        state.reshard()  # a forward may have left unsharded parameters registered
    active: dict[int, FSDPState] = {}
    fn = init_fn or _reset_parameters
    try:
        for i, m in enumerate(order):
            state = owner.get(id(m))
            if state is not None and id(state) not in active:
                for group in state.groups:
                    group.begin_init()
                active[id(state)] = state
            fn(m)
            if state is not None and last[id(state)] == i:
                del active[id(state)]
                for group in state.groups:
                    group.end_init()
    finally:
        for state in active.values():  # init_fn raised: restore the sharded registration
            for group in state.groups:
                group.end_init(commit=False)


def _reset_parameters(m: nn.Module) -> None:
    if callable(getattr(m, "reset_parameters", None)) and (m._parameters or m._buffers):
        m.reset_parameters()


def _own_modules(state: FSDPState) -> list[nn.Module]:
    """The modules of a unit: its top modules and everything below that no nested unit owns."""
    out, stack = [], list(reversed(state.modules))
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in reversed(list(m.children())) if not isinstance(c, FSDPModule))
    return out


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unit's forward hooks around ``module.<method_name>`` too (e.g. ``generate``),
    as torch FSDP2's function of the same name does."""
    state = _state_of(module)
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def _state_of_module(module: nn.Module) -> Optional[FSDPState]:
    """``fully_shard.state(module)``: the state of the unit ``module`` is a top module of (every
    module of a ``fully_shard([a, b])`` unit gives the same one), None if it is not one."""
    return module.__dict__.get("_fsdp_state") if isinstance(module, FSDPModule) else None


fully_shard.state = _state_of_module  # type: ignore[attr-defined]  # as FSDP2's contract function


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASS_CACHE[cls]


def _collect_params(modules: list[nn.Module], ignored: set[int]) -> tuple[list[ParamInfo], list[str]]:
    """Parameters registered below ``modules`` outside nested units, in registration order,
    each with all of its registrations (tied parameters appear once); and the error messages
    for parameters another unit already owns (a tie split across units). Like FSDP2, such a
    unit is still built (from the tensor the other registration keeps) and the error is raised
    at lazy initialisation, the first forward, before any collective (``FSDPState._lazy_init``)."""
    infos: dict[int, ParamInfo] = {}
    shared: list[str] = []
    seen_modules: set[int] = set()
    for top in modules:
        stack: list[tuple[str, nn.Module]] = [("", top)]
        while stack:
            prefix, m = stack.pop()
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            for name, p in m._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                fqn = prefix + name
                if getattr(p, _IS_SHARD, False):  # a module another unit already sharded
                    raise ValueError(
                        f"parameter {fqn!r} is already owned by {getattr(p, _OWNER)} (already managed by another "
                        f"FSDP unit): its module belongs to that unit; a parameter (tied ones included) must "
                        f"belong to one unit: shard a module that holds all its uses, or fully_shard([module_a, "
                        f"module_b]) as one unit"
                    )
                if hasattr(p, _OWNER) and id(p) not in infos:  # a tie: this registration kept the original
                    shared.append(
                        f"parameter {fqn!r} is shared with a parameter already managed by another FSDP unit "
                        f"({getattr(p, _OWNER)}); a parameter (tied ones included) must belong to one unit: shard a "
                        f"module that holds all its uses, or fully_shard([module_a, module_b]) as one unit"
                    )
                info = infos.setdefault(id(p), ParamInfo(fqn, p))
                info.registrations.append((m, name))
            children = [(f"{prefix}{n}.", c) for n, c in m.named_children() if not isinstance(c, FSDPModule)]
            stack.extend(reversed(children))
    return list(infos.values()), shared


class MeshDimNamesError(ValueError, AssertionError):
    """A 2-D mesh without dim names. A ``ValueError``; also an ``AssertionError``, which is what
    torch FSDP2 raises for it."""


class NonContiguousParameterError(ValueError, NotImplementedError):
    """A non-contiguous parameter (e.g. channels_last). A ``ValueError``; also a
    ``NotImplementedError``, which is what torch FSDP2 raises for it."""


class ShardPlacementError(ValueError, AssertionError):
    """``shard_placement_fn`` returned ``Shard(dim)`` for a dim the parameter lacks. A
    ``ValueError``; also an ``AssertionError``, which is what torch FSDP2 raises for it."""


def _shard_dims(infos: list[ParamInfo], fn) -> Optional[list[Optional[int]]]:
    """``shard_placement_fn``'s answer for every parameter: a dim (normalised) or None."""
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(f"shard_placement_fn must be a callable (nn.Parameter) -> Shard | None, got {fn!r}")
    dims: list[Optional[int]] = []
    for info in infos:
        placement = fn(info.param)
        if placement is None:
            dims.append(None)
            continue
        if not isinstance(placement, Shard):
            raise TypeError(
                f"shard_placement_fn returned {placement!r} for parameter {info.fqn!r}; return Shard(dim) "
                f"or None (the default layout)"
            )
        ndim, dim = info.param.dim(), placement.dim
        if not -ndim <= dim < ndim:
            raise ShardPlacementError(
                f"Shard dim {dim} is invalid for {ndim}D tensor: shard_placement_fn returned {placement!r} "
                f"for parameter {info.fqn!r} of shape {tuple(info.param.shape)}; return a dim in "
                f"[{-ndim}, {ndim}) or None"
            )
        dims.append(dim % ndim)
    return dims


def _check_ranks_agree(mesh: DeviceMesh, infos: list[ParamInfo], specs: list[GroupSpec], config) -> None:
    """Every rank must shard the same unit (names, shapes, dtypes, arguments) of the same values:
    one digest exchange on the unit's mesh, plus one per other bucket mesh for the values there
    (expert weights may differ across an expert-parallel axis, never within their group's mesh).
    A mismatch raises :class:`dbuffer.agreement.RankMismatchError` on every rank."""
    fix = (
        "Every rank must build the same model with the same values (same code and seed) and call "
        "fully_shard with the same arguments; or load one checkpoint on every rank."
    )
    structure = [("fully_shard arguments", repr(config)), ("layout policy", describe_layout_policy())]
    structure += [(i.fqn, f"shape {tuple(i.param.shape)} {i.param.dtype} requires_grad={i.param.requires_grad}") for i in infos]
    structure += [(f"{infos[k].fqn} placement", f"Shard({d})") for s in specs if s.dims for k, d in zip(s.members, s.dims)]
    values: dict[int, tuple[DeviceMesh, list]] = {}
    for spec in specs:
        target = values.setdefault(id(spec.mesh), (spec.mesh, []))[1]
        if values_comparable(spec.mesh):
            target += [(f"{infos[k].fqn} values", value_digest(local_of(infos[k].param))) for k in spec.members]
    mesh_values = values.pop(id(mesh), (mesh, []))[1]
    check_agreement(mesh, structure + mesh_values, "fully_shard", fix)
    for other, entries in values.values():
        check_agreement(other, entries, "fully_shard (a bucket's mesh)", fix)


def _check_devices(infos: list[ParamInfo]) -> None:
    devices = {info.param.device for info in infos}
    if len(devices) > 1:
        raise ValueError(f"the unit's parameters are on several devices {sorted(map(str, devices))}; move them to one")


def _check_params(infos: list[ParamInfo], strategy: Strategy, policy: MixedPrecisionPolicy) -> None:
    for info in infos:
        p = info.param
        if not p.is_floating_point() and (policy.param_dtype is not None or policy.main_grads_dtype is not None):
            raise ValueError(
                f"parameter {info.fqn!r} has non-floating dtype {p.dtype} but the policy casts "
                f"(param_dtype={policy.param_dtype}); pass it in ignored_params or make it a buffer"
            )
        if p.dim() == 0 and strategy.shard_optim:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters: parameter {info.fqn!r} is 0-D, which cannot "
                f"be sharded as a row range. Change {info.fqn} to a 1D tensor with numel equal to 1. (or use "
                f"sharding_strategy='no_shard')"
            )
        if not p.is_contiguous():
            raise NonContiguousParameterError(
                f"FSDP does not support non-contiguous parameters yet: parameter {info.fqn!r} of shape "
                f"{tuple(p.shape)} has strides {p.stride()} (e.g. channels_last); make it contiguous before "
                f"fully_shard (module.to(memory_format=torch.contiguous_format))"
            )


def _check_reshard_after_forward(value: Optional[Union[bool, int]], mesh: DeviceMesh) -> Optional[bool]:
    """None and bools as they are; an int ``n`` (FSDP2: reshard to groups of ``n`` ranks) must
    divide the shard group's size: 1 keeps the weights (False), any other factor reshards."""
    if value is None or isinstance(value, bool):
        return value
    size = mesh.shape[-1]
    if not 1 <= value <= size or size % value:
        raise ValueError(
            f"reshard_after_forward as an int must be a factor of the shard group's size {size}, got {value}"
        )
    return value != 1


def _post_forward_ranks(value: Optional[Union[bool, int]], mesh: DeviceMesh) -> Optional[int]:
    """The ``n`` of ``reshard_after_forward=n`` when it keeps a slice: an int strictly between
    1 and the size of a 1-D shard mesh (validated by :func:`_check_reshard_after_forward`)."""
    if isinstance(value, bool) or not isinstance(value, int) or mesh.ndim != 1:
        return None
    return value if 1 < value < mesh.size() and mesh.size() % value == 0 else None


def _check_mesh(
    mesh: Optional[DeviceMesh], infos: list[ParamInfo], what: str = "mesh", host_ok: bool = False
) -> DeviceMesh:
    """``host_ok`` (CPU offload): parameters on the CPU may be sharded over any mesh (the shards
    stay on the host), whose default device type is then the accelerator, if any."""
    param_type = infos[0].param.device.type if infos else "meta"
    if param_type != "meta" and not (host_ok and param_type == "cpu"):
        device_type = param_type
    else:  # no parameters of its own, built on meta, or offloaded: compute on the mesh's device
        default = "cuda" if torch.cuda.is_available() else "cpu"
        device_type = mesh.device_type if isinstance(mesh, DeviceMesh) else default
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError("fully_shard needs torch.distributed initialised (or pass mesh=)")
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} as {what}: 1-D (the data-parallel "
            f"ranks) or 2-D (replicate, shard) for HSDP; slice it, e.g. mesh['dp_replicate', 'dp_shard'], "
            f"or name its data-parallel dims with dp_mesh_dims="
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise MeshDimNamesError(
            f"Please init the 2D mesh for HSDP with mesh_dim_names specified ({what} {mesh}), e.g. "
            f"init_device_mesh(..., mesh_dim_names=('replicate', 'shard')): the outer dim replicates, "
            f"the inner one shards"
        )
    if infos and mesh.device_type != device_type:
        raise ValueError(f"{what} is for device type {mesh.device_type!r} but the parameters are on {device_type!r}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank is not part of {what} {mesh}; call fully_shard only on its ranks")
    return mesh


def _check_offloadable(infos: list[ParamInfo]) -> None:
    for info in infos:
        kind = type(info.param.detach())
        if kind is not torch.Tensor:
            raise NotImplementedError(
                f"offload_policy=CPUOffloadPolicy(): parameter {info.fqn!r} is a {kind.__name__} (tensor "
                f"parallelism or an all-gather extension), which fsdp does not offload yet; shard the "
                f"modules holding such parameters without offload_policy (in their own fully_shard call)"
            )


def _build_groups(
    infos: list[ParamInfo], specs: list[GroupSpec], offload: Optional[CPUOffloadPolicy] = None, outer: bool = False
) -> list[ParameterGroup]:
    """One group per spec (tensor-subclass members split off into their own): its layout
    (torch.chunk pieces where the spec has dims, else flat), its parameter kind (plain or
    tensor-parallel) and its parts (host offload) are chosen here and handed to it."""
    groups = []
    for whole in specs:
        extension, rest = split_extension_members(whole, [i.param for i in infos])
        for members_k, ext in ((extension, True), (rest, False)):  # tensor subclasses: fsdp.compose.extensions
            if not members_k:
                continue
            spec = replace(whole, members=members_k, dims=_dims_of(whole, members_k))
            members = [infos[k] for k in spec.members]
            first = members[0].param
            part = None if offload is None else HostOffload(offload, mesh_device(spec.mesh))
            kw = dict(gradient_divide_factor=spec.gradient_divide_factor, policy=spec.policy, offload=part)
            args = (members, spec.mesh, spec.strategy, spec.policy.dtypes_for(first.dtype), first.requires_grad)
            if ext:
                groups.append(ExtensionParameterGroup(*args, **kw))
            elif spec.dims is not None:
                kind = TensorParallelKind([i.param for i in members], spec.mesh, spec.dims) if isinstance(first, DTensor) else PLAIN
                shapes = [tuple(kind.local(i.param).shape) for i in members]
                mesh = spec.mesh
                layout = ChunkedLayout(shapes, spec.dims, mesh.shape[-1], mesh.get_coordinate()[-1])
                groups.append(ParameterGroup(*args, layout=layout, kind=kind, **kw))
            else:  # outer: HFSDP (fsdp.compose.outer_shard), validated by check_outer_sharding
                cls = OuterShardedParameterGroup if outer else ParameterGroup
                groups.append(cls(*args, shard=spec.placement, **kw))
    if log.isEnabledFor(logging.DEBUG):
        for group in groups:
            log.debug(
                "fully_shard: %s of %d parameters (%s): %s layout, %s, strategy %s, dtypes %s, mesh %s",
                type(group).__name__, len(group.infos), group._names(), describe_layout(group.layout),
                type(group.kind).__name__, group.strategy.name, group.dtypes, group.mesh,
            )
    return groups


def _dims_of(spec: GroupSpec, members: list[int]) -> Optional[list[int]]:
    if spec.dims is None:
        return None
    return [d for k, d in zip(spec.members, spec.dims) if k in set(members)]


def _sharded_of(groups: list[ParameterGroup]):
    for group in groups:
        yield from zip(group.infos, group.sharded_params)
