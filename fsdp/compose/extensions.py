"""All-gather extensions: parameters that are tensor subclasses (float8, NF4, ``TwoTensor``, ...).

torch FSDP2's protocol, honoured by ``fsdp.fully_shard``. A parameter whose tensor defines

* ``fsdp_pre_all_gather(self, mesh)`` or
  ``fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)``
  returning ``(tensors_to_gather, metadata)``, and
* ``fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None)`` returning
  ``(unsharded_tensor, tensors_to_free)`` (``out=None``) or writing into ``out`` (``None``)

is sharded as FSDP2 shards it: its sharded parameter is a plain ``DTensor`` with placement
``Shard(0)`` (``(Replicate(), Shard(0))`` under HSDP) whose local tensor is a ``torch.chunk``
piece *of the parameter's own type* (padded like FSDP2's: the pieces of every rank have the
shape of rank 0's), so the optimizer updates the subclass itself. Before an all-gather fsdp calls
``fsdp_pre_all_gather`` on that local tensor (``mesh``: the 1-D shard mesh; ``module``: the module
holding the parameter; ``mp_policy``: the unit's :class:`fsdp.MixedPrecisionPolicy`), gathers the
returned tensors through a DBuffer (one all-gather for all the group's tensors; different dtypes
travel as bytes), and calls ``fsdp_post_all_gather`` with each output viewed as
``(-1, *input.shape[1:])``: the first time without ``out`` to build the unsharded parameter, later
with ``out=`` that parameter, whose storage and that of ``tensors_to_free`` were freed at reshard
and are given back first (FSDP2's in-place reuse: tensors autograd saved stay valid). Gradients
of the unsharded parameter are reduce-scattered into plain sharded gradients, as in FSDP2.
A subclass without the two methods is gathered as its values (cast to ``param_dtype``) and the
unsharded parameter is a plain tensor, as in FSDP2.

What differs from FSDP2, and why: ``fsdp_pre_all_gather`` runs once per change of the weights
(an optimizer step, an in-place update, a load), not before every all-gather. Its outputs are
copied into a persistent sharded buffer, the group's low-precision model shard, which every
gather of that step reuses: a float8 weight is cast (amax, scale, quantise) once per optimizer
step however often ZeRO-3 gathers it (forward, backward, every micro-batch), where FSDP2 casts it
on every gather. This is the same rule as fsdp's BF16 compute weights. A pre-all-gather whose
result depends on anything but the weights would see the difference; the methods are looked up
again at every refresh, so monkey-patching the local tensor after ``fully_shard`` works.

Limits (each raises a clear error before any collective): such parameters need a strategy that
shards the main weights (not ``no_shard``), ``Shard(0)`` (no ``shard_placement_fn`` dim other
than 0, no ``Owned`` bucket), contiguous tensors, and keep their dtype after ``fully_shard``
(``module.to(dtype)`` raises). A plain parameter whose local tensor is given the methods after
``fully_shard`` raises too: the row-atomic layout is not FSDP2's piece; make it a subclass
before sharding.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer, mesh_device
from dbuffer.agreement import check_agreement
from dbuffer.layout import compute_layout
from fsdp.compose.extension_protocol import POST, PRE, numel as _numel, plain as _plain, plain_leaves as _plain_leaves
from fsdp.group.layouts import ChunkedLayout, ParamKind, contiguous_stride
from fsdp.group.meta_init import meta_error
from fsdp.group.param_group import ParameterGroup

__all__ = ["ExtensionParameterGroup"]

_ALIGN_BYTES = 16  # byte offsets of mixed-dtype inputs, so every output view is aligned


@dataclass(frozen=True)
class _Slot:
    """Where input ``i`` of parameter ``k`` lives in each rank's shard of the gather buffer."""

    k: int
    i: int
    offset: int  # in elements of the buffer's dtype
    length: int  # same units
    shape: tuple[int, ...]
    dtype: torch.dtype


class _ExtensionKind(ParamKind):
    """Gradients of a tensor-subclass parameter are reduced as plain tensors, as in FSDP2."""

    plain = False

    def grad_local(self, k: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if grad is None else _plain(grad)


_EXTENSION = _ExtensionKind()


class ExtensionParameterGroup(ParameterGroup):
    """A :class:`~fsdp.group.param_group.ParameterGroup` in torch.chunk pieces along dim 0
    (:class:`~fsdp.group.layouts.ChunkedLayout`) whose parameters keep their
    tensor type: the sharded weights are the subclass pieces themselves (not a DBuffer), the
    gather source is the persistent buffer of the pre-all-gather outputs, and the unsharded
    parameters are what ``fsdp_post_all_gather`` builds. Gradients use the chunked group's
    buffers unchanged (plain ``Shard(0)`` pieces)."""

    _ready = False  # refresh() waits until the group is built (the methods may come later)
    _pieces: Optional[list[torch.Tensor]] = None
    keeps_post_forward_slice = False  # it gathers the pre-all-gather outputs, not the model shard

    def __init__(self, infos, mesh, strategy, dtypes, requires_grad, **kw) -> None:
        shapes = [tuple(i.param.shape) for i in infos]
        self._orig = [(torch.Size(shape), contiguous_stride(torch.Size(shape))) for shape in shapes]
        self._modules = [i.registrations[0][0] for i in infos]
        layout = ChunkedLayout(shapes, [0] * len(infos), mesh.shape[-1], mesh.get_coordinate()[-1])
        super().__init__(infos, mesh, strategy, dtypes, requires_grad, layout=layout, kind=_EXTENSION, **kw)
        self._shard_mesh_cache: Optional[DeviceMesh] = None
        self._spec: Optional[tuple] = None  # (shape, dtype) of every pre-all-gather output
        self._key: Optional[tuple] = None  # _inputs_key() when the send buffer was made
        self._metadata: list[Any] = []
        self._extended: list[bool] = []
        self.unsharded_params = None  # built by the first gather
        self._inner: list[list[torch.Tensor]] = []  # tensors_to_free of each parameter
        self._outputs: list[list[torch.Tensor]] = []  # all-gather outputs of each parameter
        self._capacity: dict[int, int] = {}  # bytes of each freed storage (by tensor id)
        self._alive = False  # the unsharded parameters have storage and current values
        self._ready = True
        self.mark_stale()

    # ------------------------------------------------------------------ sharded weights

    def _make_pieces(self, params: list[torch.Tensor], fill: bool) -> None:
        """Each rank's padded ``torch.chunk`` piece, of the parameter's own type (``new_zeros``
        goes through its dispatch), filled with this rank's rows unless built on meta."""
        rank, device = self.layout.rank, self.main.device
        pieces = []
        for k, p in enumerate(params):
            data = p.detach()
            padded = data.new_zeros(tuple(self.layout.chunks.piece_shape(k, 0)), device=device)
            _, length = self.layout.chunks.piece(k, rank)
            if fill and length:  # cut by torch.chunk (aten.split), as FSDP2 does: NF4 has no partial slice
                padded.narrow(0, 0, length).copy_(_chunk_of(data, self.layout.chunks.num_shards, rank))
            pieces.append(padded)
        self._pieces = pieces

    @torch.no_grad()
    def _fill_main(self, params: list[torch.Tensor]) -> None:
        self._make_pieces(params, fill=True)

    def materialize(self, device: torch.device) -> None:
        """``to_empty``: the pieces (of the parameters' own type) get zeroed storage on ``device``."""
        if self.is_meta and self._pieces is not None:
            self._pieces = [p.new_zeros(p.shape, device=device) for p in self._pieces]
        super().materialize(device)

    def _build_compute_buffers(self) -> None:
        if self._pieces is None:  # built on meta: zeros until initialised
            self._make_pieces([i.param for i in self.infos], fill=False)
        # ``main`` only lends its layout to the gradient buffers: the weights are the pieces.
        if not self.main.is_storage_released():
            self.main.release_storage()
        self.model = self.unsharded = None

    def _new_sharded_params(self) -> list[nn.Parameter]:
        rank, params = self.layout.rank, []
        for k, padded in enumerate(self._pieces):
            _, length = self.layout.chunks.piece(k, rank)
            shape, stride = self._orig[k]
            local = padded.narrow(0, 0, length)
            dt = DTensor.from_local(local, self.mesh, self.placements.sharded, run_check=False, shape=shape, stride=stride)
            p = nn.Parameter(dt, requires_grad=self.requires_grad)
            p._fsdp_group = weakref.ref(self)  # found by the optimizer-step hook
            params.append(p)
        return params

    def weights_version(self) -> int:
        return sum(p._version + p._local_tensor._version for p in self.sharded_params)

    # ------------------------------------------------------------------ pre-all-gather

    def _shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard axis (FSDP2 passes it, not the HSDP mesh)."""
        if self._shard_mesh_cache is None:
            mesh = self.mesh
            if mesh.ndim == 1:
                self._shard_mesh_cache = mesh
            elif mesh.mesh_dim_names:
                self._shard_mesh_cache = mesh[mesh.mesh_dim_names[-1]]
            else:
                raise ValueError(
                    f"parameters {self._names()} use an all-gather extension on an HSDP mesh without "
                    f"names; build it with mesh_dim_names=('replicate', 'shard') so the shard mesh can be passed"
                )
        return self._shard_mesh_cache

    def _inputs_key(self) -> tuple:
        """Everything ``fsdp_pre_all_gather`` may read, per parameter: the method itself, the
        parameter's and its local tensor's versions, every plain tensor inside the subclass and
        every tensor attribute set on it (identity and version: torchao's precomputed float8
        scale is such an attribute, replaced without any version bump), its other plain
        attributes and its flatten metadata. The tensors are also kept referenced (in
        ``_inputs``), so an identity in the key cannot be reused by a new tensor."""
        key, refs = [], []
        for p in self.sharded_params:
            local = p._local_tensor
            fn = getattr(local, PRE, None)
            tensors = _plain_leaves(local) + [v for _, v in sorted(vars(local).items()) if isinstance(v, torch.Tensor)]
            plain = tuple(
                (name, v) for name, v in sorted(vars(local).items()) if isinstance(v, (bool, int, float, str, type(None)))
            )
            meta = repr(local.__tensor_flatten__()[1]) if hasattr(local, "__tensor_flatten__") else None
            key.append((getattr(fn, "__func__", fn), p._version, tuple((id(t), t._version) for t in tensors), plain, meta))
            refs += tensors
        self._inputs = refs
        return tuple(key)

    def _pre_all_gather(self, k: int) -> tuple[tuple[torch.Tensor, ...], Any, bool]:
        """(tensors to gather, metadata, whether the extension made them) for parameter ``k``."""
        local = self.sharded_params[k]._local_tensor
        pre = getattr(local, PRE, None)
        name = self.infos[k].fqn
        if pre is None:
            padded = self._pieces[k]
            return (padded if padded.dtype == self.dtypes.model else padded.to(self.dtypes.model),), None, False
        if not hasattr(local, POST):
            raise ValueError(f"parameter {name!r}: its local tensor has {PRE} but no {POST}; define both")
        count = len(inspect.signature(pre).parameters)
        if count == 1:
            result = pre(self._shard_mesh())
        elif count == 5:
            shape, stride = self._orig[k]
            result = pre(self._shard_mesh(), shape, stride, self._modules[k], self.policy)
        else:
            raise TypeError(
                f"parameter {name!r}: invalid {PRE}{inspect.signature(pre)}; expected {PRE}(self, mesh) or "
                f"{PRE}(self, mesh, outer_size, outer_stride, module, mp_policy)"
            )
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], (tuple, list))):
            raise TypeError(f"parameter {name!r}: {PRE} must return (tuple of tensors, metadata), got {type(result)}")
        inputs = tuple(result[0])
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError(f"parameter {name!r}: {PRE} must return a non-empty tuple of tensors to all-gather")
        return inputs, result[1], True

    @torch.no_grad()
    def refresh(self) -> None:
        """Run the pre-all-gather of every parameter if the weights (or the methods) changed since
        the last time, and copy its outputs into the persistent sharded gather buffer. The
        strategies that keep the unsharded weights gather them right away."""
        if not self._ready:
            return
        key = self._inputs_key()
        if not self._stale and key == self._key:
            return
        made = [self._pre_all_gather(k) for k in range(len(self.infos))]
        spec = tuple(tuple((tuple(t.shape), t.dtype) for t in inputs) for inputs, _, _ in made)
        if spec != self._spec:
            self._build_gather_buffers(spec)
        local = self.send.local_buffer
        for slot in self._slots:
            self._slot_view(local, slot).copy_(made[slot.k][0][slot.i])
        self._metadata = [meta for _, meta, _ in made]
        extended = [ext for _, _, ext in made]
        if extended != self._extended:  # the unsharded parameters come from another path now
            self.unsharded_params = None
        self._extended = extended
        self._key, self._stale = key, False
        self._refreshes += 1
        if not self.strategy.shard_params:
            self._launch_gather()
            self.wait_unshard()

    def _build_gather_buffers(self, spec: tuple) -> None:
        """Lay out the pre-all-gather outputs in each rank's shard (after checking that every
        rank's outputs have the same shapes and dtypes: one small collective, as the all-gather
        needs it), one dtype for all, else bytes."""
        entries = [
            (f"{self.infos[k].fqn} all-gather input {i}", f"shape {shape} {dtype}")
            for k, inputs in enumerate(spec)
            for i, (shape, dtype) in enumerate(inputs)
        ]
        check_agreement(
            self.mesh,
            entries,
            f"fsdp all-gather extension ({PRE})",
            f"{PRE} must return tensors of the same shapes and dtypes on every rank; for a parameter "
            f"sharded unevenly, that is the padded piece's shape (FSDP2's rule)",
        )
        dtypes = {dtype for inputs in spec for _, dtype in inputs}
        unit = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        slots, pos = [], 0
        for k, inputs in enumerate(spec):
            for i, (shape, dtype) in enumerate(inputs):
                numel = _numel(shape)
                if unit == torch.uint8 and dtype != torch.uint8:
                    pos = -(-pos // _ALIGN_BYTES) * _ALIGN_BYTES
                    numel *= dtype.itemsize
                slots.append(_Slot(k, i, pos, numel, shape, dtype))
                pos += numel
        world = self.mesh.shape[-1]
        flat = [(world * max(pos, 1),)]
        layout = compute_layout(flat, world)
        device = self.main.device
        self.send = DBuffer(self.mesh, self.placements.sharded, flat, unit, device, layout=layout, check_ranks=False)
        self.gathered = DBuffer(
            self.mesh, self.placements.replicated, flat, unit, device, layout=layout, zero_fill=False, check_ranks=False
        )
        self.gathered.release_storage()
        self._slots, self._spec, self._shard_len = slots, spec, max(pos, 1)
        self._outputs = [
            [torch.empty(world * _numel(shape), dtype=dtype, device=device) for shape, dtype in inputs] for inputs in spec
        ]
        self._inner = [[] for _ in spec]
        self._capacity = {}
        self._free_storage()
        self.unsharded_params = None
        self._alive = False
        self._gathered = None

    def _slot_view(self, flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
        part = flat[slot.offset : slot.offset + slot.length]
        if part.dtype != slot.dtype:
            part = part.view(slot.dtype)
        return part.view(slot.shape)

    # ------------------------------------------------------------------ gather, post-all-gather

    def unshard(self, async_op: bool = False) -> None:
        if self.is_meta:
            raise RuntimeError(meta_error([i.fqn for i in self.infos]))
        if self._gather_pending is not None:
            if not async_op:
                self.wait_unshard()
            return
        self.refresh()
        if self._gathered == self._refreshes and self._alive:
            return
        self._launch_gather()
        if not async_op:
            self.wait_unshard()

    def _launch_gather(self) -> None:
        self.gathered.reallocate_storage()
        with self.streams.launch(self.streams.all_gather):
            self._gather_pending = self.all_gather(self.send, self.gathered)

    @torch.no_grad()
    def wait_unshard(self) -> None:
        if self._gather_pending is None:
            return
        self._gather_pending.wait()
        self.streams.wait(self.streams.all_gather)
        self._gather_pending = None
        rebuild = self.unsharded_params is None
        saved = [] if rebuild else self._saved_tensors()
        versions = [t._version for t in saved]
        world = self.mesh.shape[-1]
        rows = self.gathered.local_buffer.view(world, self._shard_len)
        self._alloc_storage()
        for slot in self._slots:  # copy out: each output is rank-major, contiguous (FSDP2's copy-out)
            out = self._outputs[slot.k][slot.i]
            dst = out.view(torch.uint8) if rows.dtype == torch.uint8 and out.dtype != torch.uint8 else out
            dst.view(world, slot.length).copy_(rows[:, slot.offset : slot.offset + slot.length])
        self.gathered.release_storage()
        if rebuild:
            self._build_unsharded_params()
        else:
            for k, param in enumerate(self.unsharded_params):
                if self._extended[k]:
                    self._post_all_gather(k, out=param)
        # Refilling restores values autograd saved in forward; it is not a modification.
        torch._C._autograd._unsafe_set_version_counter(tuple(saved), tuple(versions))
        self._alive = True
        self._gathered = self._refreshes

    def _post_all_gather(self, k: int, out: Optional[torch.Tensor] = None):
        local = self.sharded_params[k]._local_tensor
        outputs = tuple(t.view(-1, *shape[1:]) for t, (shape, _) in zip(self._outputs[k], self._spec[k]))
        if out is None:
            return getattr(local, POST)(outputs, self._metadata[k], self.dtypes.model)
        return getattr(local, POST)(outputs, self._metadata[k], self.dtypes.model, out=out)

    def _build_unsharded_params(self) -> None:
        params, self._inner = [], []
        for k in range(len(self.infos)):
            shape, stride = self._orig[k]
            if self._extended[k]:
                result = self._post_all_gather(k)
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise TypeError(
                        f"parameter {self.infos[k].fqn!r}: {POST} without out= must return "
                        f"(unsharded tensor, tensors to free), got {type(result)}"
                    )
                tensor, to_free = result
                self._inner.append([leaf for t in to_free for leaf in _plain_leaves(t)])
            else:
                tensor = self._outputs[k][0]
                self._inner.append([])
            full = torch.as_strided(tensor, shape, stride, 0)
            params.append(nn.Parameter(full, requires_grad=self.requires_grad))
        self.unsharded_params = params
        if self.grads is not None:
            self.grads.hook_params()

    def _saved_tensors(self) -> list[torch.Tensor]:
        """Everything whose version counter a refill may bump: outputs, parameters, inner tensors."""
        out = [t for outs in self._outputs for t in outs] + list(self.unsharded_params)
        return out + [t for inner in self._inner for t in inner]

    def _storages(self) -> list[torch.Tensor]:
        return [t for outs in self._outputs for t in outs] + [t for inner in self._inner for t in inner]

    def _free_storage(self) -> None:
        """Free the outputs and ``tensors_to_free`` (storage resized to 0: the tensor objects, and
        whatever autograd saved of them, stay valid and see the storage again when refilled)."""
        for t in self._storages():
            nbytes = t.untyped_storage().nbytes()
            if nbytes:
                self._capacity[id(t)] = nbytes
                t.untyped_storage().resize_(0)

    def _alloc_storage(self) -> None:
        for t in self._storages():
            want = self._capacity.get(id(t), t.numel() * t.element_size())
            if t.untyped_storage().nbytes() < want:
                t.untyped_storage().resize_(want)

    def reshard(self) -> None:
        """Free the gathered outputs and the tensors ``fsdp_post_all_gather`` named (ZeRO-3)."""
        if not self.strategy.shard_params:
            return
        self.wait_unshard()
        if self._alive:
            self._free_storage()
        self._alive = False
        self._gathered = None

    def use_params(self, unsharded: bool) -> None:
        if unsharded and self.unsharded_params is None:
            raise RuntimeError(f"parameters {self._names()} were never gathered; unshard the module first")
        super().use_params(unsharded)

    # ------------------------------------------------------------------ gradients

    # ------------------------------------------------------------------ dtype, init

    def check_convert(self, dtype: torch.dtype, device) -> None:
        super().check_convert(dtype, device)
        if dtype != self.dtypes.main:
            raise ValueError(
                f"cannot convert parameters {self._names()} to {dtype}: tensor-subclass parameters (all-gather "
                f"extensions) keep the dtype they had at fully_shard; convert the module before sharding it"
            )

    def convert(self, dtype: Optional[torch.dtype] = None, device=None) -> bool:
        self.check_convert(self.dtypes.main if dtype is None else dtype, self.main.device if device is None else device)
        return False

    def begin_init(self) -> None:
        """Register full tensors of each parameter's own type for an init function to fill."""
        if self.is_meta:  # init_weights without to_empty: the mesh's device
            self.materialize(mesh_device(self.mesh))
        self._init_full = [
            nn.Parameter(piece.new_zeros(self._orig[k][0]), requires_grad=self.requires_grad)
            for k, piece in enumerate(self._pieces)
        ]
        self._register(self._init_full)

    @torch.no_grad()
    def end_init(self, commit: bool = True) -> None:
        full, self._init_full = getattr(self, "_init_full", None), None
        if commit and full is not None:
            rank = self.layout.rank
            for k, t in enumerate(full):
                if self.layout.chunks.piece(k, rank)[1]:
                    self.sharded_params[k]._local_tensor.copy_(_chunk_of(t.detach(), self.layout.chunks.num_shards, rank))
        self.use_params(unsharded=False)
        if commit:
            self.mark_stale()
            self.refresh()


def _chunk_of(data: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``torch.chunk(data, world)[rank]`` (this rank has a non-empty piece)."""
    return torch.chunk(data, world, 0)[rank]
