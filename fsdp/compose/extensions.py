"""All-gather extensions: parameters that are tensor subclasses (float8, NF4, ``TwoTensor``, ...).

torch FSDP2's protocol, honoured by ``fsdp.fully_shard``. A parameter whose tensor defines

* ``fsdp_pre_all_gather(self, mesh)`` or
  ``fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)``
  returning ``(tensors_to_gather, metadata)``, and
* ``fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None)`` returning
  ``(unsharded_tensor, tensors_to_free)`` (``out=None``) or writing into ``out`` (``None``)

is sharded as FSDP2 shards it, by :class:`SubclassWeights`: its local tensor is a padded
``torch.chunk`` piece *of its own type* (the optimizer updates the subclass itself), and the
unsharded parameter is refilled in place (``out=``: tensors autograd saved stay valid). A subclass
without the two methods is gathered as its values and unsharded as a plain tensor.

Unlike FSDP2, ``fsdp_pre_all_gather`` runs once per change of the weights
(:meth:`SubclassWeights.version_key`), not before every all-gather: a float8 weight is cast once
per optimizer step however often ZeRO-3 gathers it. The methods are looked up at each refresh.

Limits (each raises a clear error before any collective): a strategy sharding the main weights,
``Shard(0)`` only, contiguous tensors, no dtype change after ``fully_shard``, and the methods
present at ``fully_shard`` (make a plain parameter a subclass before sharding).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import DBuffer, dtensor_view
from dbuffer.agreement import check_agreement
from dbuffer.layout import compute_layout
from dbuffer.view import contiguous_stride
from fsdp.compose.extension_protocol import POST, PRE, numel as _numel, plain as _plain, plain_leaves as _plain_leaves
from fsdp.group.layouts import ParamKind
from fsdp.group.parts import GatherKind, WeightsParts
from fsdp.group.plan import GroupPlan
from fsdp.group.policy import Dtypes
from fsdp.group.siblings import Siblings
from fsdp.group.weights import GradHooks

__all__ = ["SUBCLASS", "SubclassKind", "SubclassWeights"]

_ALIGN_BYTES = 16  # byte offsets of mixed-dtype inputs, so every output view is aligned


@dataclass(frozen=True)
class _Slot:
    """Where input ``i`` of parameter ``k`` lives in each rank's shard of the gather buffer."""

    k: int
    i: int
    offset: int  # offset and length in elements of the buffer's dtype
    length: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class SubclassKind(ParamKind):
    """Gradients of a tensor-subclass parameter are reduced as plain tensors, as in FSDP2."""

    plain = False

    def grad_local(self, k: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if grad is None else _plain(grad)


SUBCLASS = SubclassKind()


class SubclassWeights:
    """A group's weights part (:mod:`fsdp.group.weights`) for tensor-subclass parameters in a
    :class:`~fsdp.group.layouts.ChunkedLayout`: padded pieces of the subclass (``main`` only lends
    its layout to the gradients), gathered from the persistent pre-all-gather outputs ``send``."""

    keep_unsharded_storage = False  # FSDP2's set_keep_unsharded_storage (see BufferWeights)
    dtype_fixed = (
        "tensor-subclass parameters (all-gather extensions) keep the dtype they had at fully_shard; "
        "convert the module before sharding it"
    )

    def __init__(self, parts: WeightsParts) -> None:
        self.parts = parts
        self.main: Optional[DBuffer] = None  # lends layout and device; set, with dtypes, by build()
        self.dtypes: Optional[Dtypes] = None
        self.hooks = GradHooks()
        self._orig = [(torch.Size(i.param.shape), contiguous_stride(torch.Size(i.param.shape))) for i in parts.infos]
        self._modules = [i.registrations[0][0] for i in parts.infos]
        self._pieces: Optional[list[torch.Tensor]] = None
        self._shard_mesh_cache: Optional[DeviceMesh] = None
        self._spec: Optional[tuple] = None  # (shape, dtype) of every pre-all-gather output
        self._inputs: list[torch.Tensor] = []  # see version_key()
        self._metadata: list[object] = []
        self._extended: list[bool] = []
        self.send: Optional[DBuffer] = None
        self.gathered: Optional[DBuffer] = None
        self.unsharded_params: Optional[list[nn.Parameter]] = None  # built by the first gather
        self._inner: list[list[torch.Tensor]] = []  # tensors_to_free of each parameter
        self._outputs: list[list[torch.Tensor]] = []  # all-gather outputs of each parameter
        self._capacity: dict[int, int] = {}  # bytes of each freed storage (by tensor id)
        self._alive = False  # the unsharded parameters have storage and current values
        self._init_full: Optional[list[nn.Parameter]] = None

    def fill(self, tensors: list[torch.Tensor]) -> None:
        self._make_pieces(tensors, fill=True)

    def replanned(self, plan: GroupPlan) -> None:
        """Nothing to take: a subclass's routes are the same in every plan."""

    def build(self, plan: GroupPlan, main: DBuffer, dtypes: Dtypes, siblings: Siblings) -> None:
        """Pieces on ``main``'s device (zeros if built on meta or materialised); frees ``main``."""
        self.main, self.dtypes = main, dtypes
        if self._pieces is None:
            self._make_pieces([i.param for i in self.parts.infos], fill=False)
        elif self._pieces and self._pieces[0].device != main.device:  # to_empty
            self._pieces = [p.new_zeros(p.shape, device=main.device) for p in self._pieces]
        if not main.is_storage_released():
            main.release_storage()

    def install_grad_hooks(self, hook_for: Callable[[int], Callable[[torch.Tensor], None]]) -> None:
        self.hooks.install(hook_for, self.unsharded_params)

    @torch.no_grad()
    def _make_pieces(self, params: list[torch.Tensor], fill: bool) -> None:
        """This rank's padded piece of each parameter, of its type, holding its rows if ``fill``."""
        chunks, device = self.parts.layout.chunks, self.main.device
        pieces = []
        for k, p in enumerate(params):
            data = p.detach()
            padded = data.new_zeros(tuple(chunks.piece_shape(k, 0)), device=device)
            _, length = chunks.piece(k, self.parts.layout.rank)
            if fill and length:  # torch.chunk (aten.split) as FSDP2: NF4 has no partial slice
                padded.narrow(0, 0, length).copy_(self._chunk_of(data))
            pieces.append(padded)
        self._pieces = pieces

    def _chunk_of(self, data: torch.Tensor) -> torch.Tensor:
        """``torch.chunk(data, world)[rank]`` (this rank has a non-empty piece)."""
        layout = self.parts.layout
        return torch.chunk(data, layout.chunks.num_shards, 0)[layout.rank]

    def new_sharded_params(self) -> list[nn.Parameter]:
        g, params = self.parts, []
        for k, padded in enumerate(self._pieces):
            _, length = g.layout.chunks.piece(k, g.layout.rank)
            shape, stride = self._orig[k]
            local = padded.narrow(0, 0, length)
            dt = dtensor_view(local, g.mesh, g.placements.sharded, shape, stride)
            params.append(nn.Parameter(dt, requires_grad=g.requires_grad))
        return params

    def release_model_shard(self) -> None:
        """Kept: the pre-all-gather outputs are what every gather of the step reuses."""

    def _shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard axis (FSDP2 passes it, not the HSDP mesh)."""
        if self._shard_mesh_cache is None:
            mesh = self.parts.mesh
            if mesh.ndim == 1:
                self._shard_mesh_cache = mesh
            elif mesh.mesh_dim_names:
                self._shard_mesh_cache = mesh[mesh.mesh_dim_names[-1]]
            else:
                raise ValueError(
                    f"parameters {self.parts.names} use an all-gather extension on an HSDP mesh without "
                    f"names; build it with mesh_dim_names=('replicate', 'shard') so the shard mesh can be passed"
                )
        return self._shard_mesh_cache

    def version_key(self) -> tuple:
        """Everything ``fsdp_pre_all_gather`` may read: the method, versions, the identity of inner
        tensors and tensor attributes (torchao replaces its float8 scale without a version bump,
        kept referenced so no new tensor reuses an identity), plain attributes, flatten metadata."""
        key, refs = [], []
        for p in self.parts.sharded_params:
            local = p._local_tensor
            fn = getattr(local, PRE, None)
            attrs = sorted(vars(local).items())
            tensors = _plain_leaves(local) + [v for _, v in attrs if isinstance(v, torch.Tensor)]
            plain = tuple((name, v) for name, v in attrs if isinstance(v, (bool, int, float, str, type(None))))
            meta = repr(local.__tensor_flatten__()[1]) if hasattr(local, "__tensor_flatten__") else None
            key.append((getattr(fn, "__func__", fn), p._version, tuple((id(t), t._version) for t in tensors), plain, meta))
            refs += tensors
        self._inputs = refs
        return tuple(key)

    def _pre_all_gather(self, k: int) -> tuple[tuple[torch.Tensor, ...], object, bool]:
        """(tensors to gather, metadata, whether the extension made them) for parameter ``k``."""
        g = self.parts
        local = g.sharded_params[k]._local_tensor
        pre = getattr(local, PRE, None)
        name = g.infos[k].fqn
        if pre is None:
            padded = self._pieces[k]
            model = self.dtypes.model
            return (padded if padded.dtype == model else padded.to(model),), None, False
        if not hasattr(local, POST):
            raise ValueError(f"parameter {name!r}: its local tensor has {PRE} but no {POST}; define both")
        count = len(inspect.signature(pre).parameters)
        if count == 1:
            result = pre(self._shard_mesh())
        elif count == 5:
            shape, stride = self._orig[k]
            result = pre(self._shard_mesh(), shape, stride, self._modules[k], g.policy)
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
    def refresh(self, model_current: bool) -> None:
        """Run every pre-all-gather into ``send`` (on a new :meth:`version_key` or after a step)."""
        made = [self._pre_all_gather(k) for k in range(len(self.parts.infos))]
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

    def _build_gather_buffers(self, spec: tuple) -> None:
        """Lay out the outputs in each rank's shard (one dtype or bytes), checked across ranks."""
        g = self.parts
        entries = [
            (f"{g.infos[k].fqn} all-gather input {i}", f"shape {shape} {dtype}")
            for k, inputs in enumerate(spec)
            for i, (shape, dtype) in enumerate(inputs)
        ]
        check_agreement(
            g.mesh,
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
                count = _numel(shape)
                if unit == torch.uint8 and dtype != torch.uint8:
                    pos = -(-pos // _ALIGN_BYTES) * _ALIGN_BYTES
                    count *= dtype.itemsize
                slots.append(_Slot(k, i, pos, count, shape, dtype))
                pos += count
        world = g.mesh.shape[-1]
        flat = [(world * max(pos, 1),)]
        layout = compute_layout(flat, world)
        device = self.main.device
        self.send = DBuffer(g.mesh, g.placements.sharded, flat, unit, device, layout=layout, check_ranks=False)
        self.gathered = DBuffer(
            g.mesh, g.placements.replicated, flat, unit, device, layout=layout, zero_fill=False, check_ranks=False
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

    @staticmethod
    def _slot_view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
        part = flat[slot.offset : slot.offset + slot.length]
        if part.dtype != slot.dtype:
            part = part.view(slot.dtype)
        return part.view(slot.shape)

    def has_unsharded(self) -> bool:
        return self._alive

    def keep_slice(self, post) -> None:
        """Never called: :func:`~fsdp.group.plan.can_keep_slice` is false for these weights."""
        raise RuntimeError("tensor-subclass weights keep no post-forward slice (the plan keeps none)")

    def begin_gather(self, kind: GatherKind = GatherKind.OWN) -> Optional[DBuffer]:
        if kind is GatherKind.SHARED:
            return None
        self.gathered.reallocate_storage()
        return self.gathered

    def gather_source(self) -> DBuffer:
        return self.send

    def gathered_buffer(self) -> DBuffer:
        return self.gathered

    @torch.no_grad()
    def end_gather(self, refill: bool, rows: Optional[torch.Tensor] = None) -> None:
        """Copy the outputs out of ``rows`` (else ``gathered``) and build or refill (``out=``) the
        unsharded parameters; ``refill`` restores the version counters autograd may have saved."""
        rebuild = self.unsharded_params is None
        saved = [] if rebuild or not refill else self._saved_tensors()
        versions = [t._version for t in saved]
        world = self.parts.mesh.shape[-1]
        own = rows is None
        if own:
            rows = self.gathered.local_buffer.view(world, self._shard_len)
        self._alloc_storage()
        for slot in self._slots:  # each output is rank-major, contiguous
            out = self._outputs[slot.k][slot.i]
            dst = out.view(torch.uint8) if rows.dtype == torch.uint8 and out.dtype != torch.uint8 else out
            dst.view(world, slot.length).copy_(rows[:, slot.offset : slot.offset + slot.length])
        if own:
            self.gathered.release_storage()
        if rebuild:
            self._build_unsharded_params()
        else:
            for k, param in enumerate(self.unsharded_params):
                if self._extended[k]:
                    self._post_all_gather(k, out=param)
        torch._C._autograd._unsafe_set_version_counter(tuple(saved), tuple(versions))
        self._alive = True

    def _post_all_gather(self, k: int, out: Optional[torch.Tensor] = None):
        local = self.parts.sharded_params[k]._local_tensor
        outputs = tuple(t.view(-1, *shape[1:]) for t, (shape, _) in zip(self._outputs[k], self._spec[k]))
        if out is None:
            return getattr(local, POST)(outputs, self._metadata[k], self.dtypes.model)
        return getattr(local, POST)(outputs, self._metadata[k], self.dtypes.model, out=out)

    def _build_unsharded_params(self) -> None:
        g = self.parts
        params, self._inner = [], []
        for k in range(len(g.infos)):
            shape, stride = self._orig[k]
            if self._extended[k]:
                result = self._post_all_gather(k)
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise TypeError(
                        f"parameter {g.infos[k].fqn!r}: {POST} without out= must return "
                        f"(unsharded tensor, tensors to free), got {type(result)}"
                    )
                tensor, to_free = result
                self._inner.append([leaf for t in to_free for leaf in _plain_leaves(t)])
            else:
                tensor = self._outputs[k][0]
                self._inner.append([])
            full = torch.as_strided(tensor, shape, stride, 0)
            params.append(nn.Parameter(full, requires_grad=g.requires_grad))
        self.unsharded_params = params
        self.hooks.hook(params)

    def _saved_tensors(self) -> list[torch.Tensor]:
        """Everything whose version counter a refill may bump."""
        return self._storages() + list(self.unsharded_params)

    def _storages(self) -> list[torch.Tensor]:
        return [t for outs in self._outputs for t in outs] + [t for inner in self._inner for t in inner]

    def _free_storage(self) -> None:
        """Resize the outputs and ``tensors_to_free`` to 0 bytes; saved tensors stay valid."""
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

    def free_unsharded(self) -> None:
        """Free the gathered outputs and ``tensors_to_free`` unless ``keep_unsharded_storage``."""
        if self._alive and not self.keep_unsharded_storage:
            self._free_storage()
        self._alive = False

    def release_unsharded_tail(self, tail) -> bool:
        """Tensor subclasses keep their gathered outputs whole: never freed in part."""
        return False

    def init_params(self) -> list[nn.Parameter]:
        """Full tensors of each parameter's own type for an init function to fill."""
        g = self.parts
        self._init_full = [
            nn.Parameter(piece.new_zeros(self._orig[k][0]), requires_grad=g.requires_grad)
            for k, piece in enumerate(self._pieces)
        ]
        return self._init_full

    @torch.no_grad()
    def commit_init(self, commit: bool) -> None:
        full, self._init_full = self._init_full, None
        if commit and full is not None:
            g = self.parts
            for k, t in enumerate(full):
                if g.layout.chunks.piece(k, g.layout.rank)[1]:
                    g.sharded_params[k]._local_tensor.copy_(self._chunk_of(t.detach()))
