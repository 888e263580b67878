"""The measurement: the bytes of the DBuffers every unit's groups hold after ``fully_shard``, and
the schedule probe that says which units hold their working-set buffers at once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, OwnedLayout, RaggedLayout
from fsdp import fully_shard
from fsdp.group.policy import Strategy
from tools.memory_plan.closed_form import peak_of
from tools.memory_plan.report import CATEGORIES, Moment

WORKING_SETS = {"unsharded_working_set": "unsharded", "reduce_working_set": "grad_in"}  # category: buffer


def _working_buffer(g, attr: str):
    """The group's working-set buffer ``attr`` (``grad_in`` lives on its gradient reducer,
    ``unsharded`` on its weights part), or None."""
    owner = g.grads if attr == "grad_in" else g.weights
    return getattr(owner, attr, None) if owner is not None else None


@dataclass
class _Measured:
    bytes: dict[str, int]
    allowance: dict[str, int]
    padding: int = 0
    padding_mean: int = 0
    layout_padding: int = 0
    released: bool = True
    peak_moments: dict[str, Moment] = field(default_factory=dict)
    layouts: dict[str, int] = field(default_factory=dict)


def measure_units(units: list, states: int, schedule: dict[str, frozenset[Moment]], flat: bool = False) -> _Measured:
    """Read the DBuffers of every unit's groups (each storage once: aliases are skipped).
    ``units``: the FSDP states, the root's last."""
    m = _Measured({k: 0 for k, _ in CATEGORIES}, {k: 0 for k, _ in CATEGORIES})
    gathered: list[tuple[int, int]] = []  # (bytes, padding bytes) per unit, the root last
    reducing: list[tuple[int, int]] = []
    for state in units:
        unit_gather, unit_reduce = (0, 0), (0, 0)
        for g in state.groups:
            m.layout_padding += _padding_numel(g, g.main)
            kind = _layout_kind(g)
            m.layouts[kind] = m.layouts.get(kind, 0) + 1
            _persistent(m, "main_weights", g, g.main)
            w = g.weights
            if w.model is not g.main and not w.lean_model:
                _persistent(m, "model_weights", g, w.model)
            if w.cast_main is not None:  # HFSDP: the cast optimizer shard
                _persistent(m, "model_weights", g, w.cast_main)
            if w.unsharded is not w.model and not g.strategy.shard_params:
                _persistent(m, "unsharded_weights", g, w.unsharded)
            if g.strategy.shard_params:
                unit_gather = _plus(unit_gather, _transient(m, g, w.unsharded))
            if not g.requires_grad:
                continue
            _persistent(m, "main_grads", g, g.grads.main_grad)
            unit_reduce = _plus(unit_reduce, _transient(m, g, g.grads.grad_in))
            # Like the parameter's local piece, in the main dtype: this rank's rows, no padding.
            data = _data_bytes(g, g.main)
            slack = max(_nbytes(g.main) - data, _padding_share(g, g.main))
            m.bytes["optimizer_state"] += states * data
            m.allowance["optimizer_state"] += states * slack
            if g.grads.main_grad.dtype != g.main.dtype and not flat:
                m.bytes["grad_copies"] += data
                m.allowance["grad_copies"] += slack
        gathered.append(unit_gather)
        reducing.append(unit_reduce)
    for key, sizes in (("unsharded_working_set", gathered), ("reduce_working_set", reducing)):
        (m.bytes[key], m.allowance[key]), moment = peak_of(sizes, schedule[key])
        if m.bytes[key]:
            m.peak_moments[key] = moment
    return m


def _persistent(m: _Measured, key: str, g, buf) -> None:
    m.bytes[key] += _nbytes(buf)
    m.allowance[key] += _padding_share(g, buf)
    m.padding += _nbytes(buf) - _data_bytes(g, buf)
    m.padding_mean += _padding_share(g, buf)


def _transient(m: _Measured, g, buf) -> tuple[int, int]:
    """(bytes, padding bytes) of a full buffer that holds storage only while in use."""
    m.released &= buf.is_storage_released()
    return _nbytes(buf), _nbytes(buf) - _data_bytes(g, buf)


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _nbytes(buf) -> int:
    """Bytes of this rank's local buffer while it holds storage (its shape stays when the storage
    is released between uses, so this is not the storage's current size)."""
    return buf.local_buffer.numel() * buf.local_buffer.element_size()


def _chunks(g, buf):
    """The ``torch.chunk`` layout of ``buf`` when it is one of a chunked group's flat shard-major
    buffers (TP parameters and ``shard_placement_fn``: fsdp/group/layouts.py), else None. Those hold one
    flat item, so their padding is the chunk layout's, not the flat item's (none)."""
    chunks = getattr(g.layout, "chunks", None)
    return None if chunks is None or buf is g.weights.unsharded else chunks


def _layout_kind(g) -> str:
    if getattr(g.layout, "chunks", None) is not None:
        return "torch.chunk"
    layout = g.main.layout
    if isinstance(layout, RaggedLayout):
        return "ragged"
    return "owned" if isinstance(layout, OwnedLayout) else "row-atomic"


def _padding_numel(g, buf) -> int:
    chunks = _chunks(g, buf)
    return buf.layout.padding_numel if chunks is None else chunks.padding_numel


def _data_bytes(g, buf) -> int:
    """Bytes of this rank's elements of every tensor in ``buf`` (from the layout: works while
    the storage is released; row ranges or, of a ragged layout, element ranges)."""
    chunks = _chunks(g, buf)
    if chunks is None:
        numel = sum(e1 - e0 for e0, e1 in (buf.local_elements(i) for i in range(len(buf))))
    elif buf.local_buffer.numel() == chunks.total_numel:  # replicated: every shard's pieces
        numel = chunks.data_numel
    else:  # sharded: this rank's torch.chunk pieces
        numel = sum(chunks.piece(k, g.layout.rank)[1] * it.inner for k, it in enumerate(chunks.items))
    return numel * buf.dtype.itemsize


def _padding_share(g, buf) -> int:
    """The layout's padding divided evenly over the shards, in bytes (rounded up). A sharded
    buffer holds at most this much more than ``ceil(data / shards)``."""
    return math.ceil(_padding_numel(g, buf) * buf.dtype.itemsize / buf.num_shards)


# ----------------------------------------------------------------------------- schedule probe

PROBE_BLOCKS = 6
_SCHEDULES: dict[str, dict[str, frozenset[Moment]]] = {}  # per strategy, for this process


class _ProbeLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))  # no RNG drawn: the caller's stream is kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _Probe(nn.Module):
    """Decoder-shaped: the root's own weights are used first and last, the blocks in between."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _ProbeLinear()
        self.blocks = nn.ModuleList(_ProbeLinear() for _ in range(PROBE_BLOCKS))
        self.last = _ProbeLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.last(x)


def probe_schedule(strategy: Strategy, world: int) -> dict[str, frozenset[Moment]]:
    """Moments at which each working set grows, measured on the probe (cached per strategy: the
    schedule does not depend on sizes, dtypes or the world size)."""
    if strategy.name not in _SCHEDULES:
        _SCHEDULES[strategy.name] = _run_probe(strategy, world)
    return _SCHEDULES[strategy.name]


def _run_probe(strategy: Strategy, world: int) -> dict[str, frozenset[Moment]]:
    """Three forward/backward passes of the probe (prefetching starts with the second), noting
    which units hold each working-set buffer whenever any DBuffer gets its storage back."""
    probe = _Probe()
    mesh = init_device_mesh("cpu", (world,))
    for block in probe.blocks:
        fully_shard(block, mesh=mesh, sharding_strategy=strategy)
    fully_shard(probe, mesh=mesh, sharding_strategy=strategy)
    units = [b._fsdp_state for b in probe.blocks] + [probe._fsdp_state]
    # Without ZeRO-3 the gathered weights are persistent (counted elsewhere), not a working set.
    watched = {k: v for k, v in WORKING_SETS.items() if strategy.shard_params or v != "unsharded"}
    seen: dict[str, set[Moment]] = {key: set() for key in WORKING_SETS}

    def note() -> None:
        for key, attr in watched.items():
            held = [any(b is not None and not b.is_storage_released() for b in (_working_buffer(g, attr) for g in u.groups)) for u in units]
            seen[key].add((held[-1], sum(held[:-1])))

    reallocate = DBuffer.reallocate_storage

    def noting(buf: DBuffer) -> None:
        reallocate(buf)
        note()

    DBuffer.reallocate_storage = noting  # type: ignore[method-assign]
    try:
        for _ in range(3):
            probe(torch.ones(2, 4)).sum().backward()
            probe.zero_grad()
    finally:
        DBuffer.reallocate_storage = reallocate  # type: ignore[method-assign]
    return {key: frozenset(moments) for key, moments in seen.items()}
