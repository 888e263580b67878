"""The fastest correct way to run each collective on each backend, on flat 1-D tensors.

The toolkit's only caller of torch.distributed collectives (teardown's one barrier aside).

* NCCL, torch's threaded test group and anything else not named below: the one-call c10d
  collective (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``; before torch
  2.13 ``all_gather_into_tensor``, ``reduce_scatter_tensor``: :mod:`dbuffer.compat`). A caller
  that repeats one call binds it once (:func:`bind`), skipping these decisions at each call.
* Gloo, all-gather: ``all_gather_single`` for shards under 2 MiB (the crossover
  ``tools/bench_primitives.py`` finds, point-to-point having more latency); from 2 MiB up,
  point-to-point (``isend``/``irecv``) straight into ``out`` (gloo's own stages through a fresh
  output-sized buffer, faulted in page by page, and two extra copies).
* Gloo, reduce-scatter (gloo runs ``reduce_scatter_single`` as a full all-reduce): under 2 MiB,
  ``all_to_all_single`` + a local sum; from 2 MiB up, point-to-point, each rank sending every peer
  its chunk, receiving the first into ``out`` (when apart from the input) and the others into
  ``(size - 2) * shard`` elements of scratch, reused across calls (:func:`release_workspaces`).
* Gloo, all-reduce: ``dist.all_reduce`` (as reduce-scatter + all-gather: no faster).
* Owned layouts whose shards are mostly padding gather by one broadcast per owner's used range
  (:func:`broadcast_segments`) and reduce to the owners by one all-to-all of those ranges
  (:func:`reduce_to_owners`), instead of moving padded shards (see ``buffer.py``).
* ``avg``: native where the backend has ``ReduceOp.AVG`` (NCCL, threaded; the fake group computes
  nothing: NCCL's route); elsewhere a sum and an in-place division by the group size on the output.

A group of one makes no c10d call (a copy, or nothing); :func:`singleton_groups_communicate`
(or ``DBUFFER_SINGLETON_C10D=1`` in the environment) makes it call c10d as a group of N does, so
that one process on one GPU runs the real collective calls (NCCL at world 1) and the stream
ordering around them: for tests and ``tools/gpu_check.py``.

Every function writes into the ``out`` it is given and returns a :class:`Pending` whose ``wait()``
finishes the work and returns ``out``. Each notes its call (number on the group, bytes, the
caller's label: :mod:`dbuffer.calls`); a backend error at launch or wait becomes a
``CollectiveError`` naming it. With
``DBUFFER_DEBUG_COLLECTIVES=1`` each one first checks that every rank of the group is at the same
call (:mod:`dbuffer.debug`); off, that costs one bool check.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import compat
from dbuffer import debug as _debug
from dbuffer.calls import GroupCalls, Pending
from dbuffer.workspaces import WorkspacePool

__all__ = [
    "BoundCollective",
    "Pending",
    "all_gather",
    "all_reduce",
    "bind",
    "broadcast_segments",
    "c10d_reduce_op",
    "group_allocator",
    "rendezvous_symmetric",
    "symmetric_allocator",
    "mesh_device",
    "reduce_op_name",
    "reduce_scatter",
    "reduce_to_owners",
    "release_workspaces",
    "singleton_groups_communicate",
]

def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of ``mesh``: where its buffers live and its collectives run.

    ``mesh``: a torch ``DeviceMesh``. For an accelerator mesh (CUDA, XPU, ...), that device type
    at the device module's ``current_device()`` (set the current device per rank first, as every
    CUDA program does); otherwise the mesh's device type (``cpu``, ``meta``). Raises nothing of
    its own; no communication."""
    kind = mesh.device_type
    if kind in ("cpu", "meta"):
        return torch.device(kind)
    return torch.device(kind, torch.get_device_module(kind).current_device())


_NATIVE_AVG_BACKENDS = ("nccl", "threaded", "fake")

# Whether a group of one calls c10d anyway (see the module docstring).
_SINGLETON_C10D = os.environ.get("DBUFFER_SINGLETON_C10D", "0") == "1"


@contextlib.contextmanager
def singleton_groups_communicate(enabled: bool = True) -> Iterator[None]:
    """Within the block, a group of one calls c10d as a larger group does (``enabled=False``:
    the default shortcut, a local copy). The whole process: set it around a run, not per rank."""
    global _SINGLETON_C10D
    before, _SINGLETON_C10D = _SINGLETON_C10D, enabled
    try:
        yield
    finally:
        _SINGLETON_C10D = before


def _alone(size: int) -> bool:
    """Whether a group of ``size`` takes the no-call shortcut."""
    return size == 1 and not _SINGLETON_C10D


# c10d's one-call all-gather and reduce-scatter under this torch's names (:mod:`dbuffer.compat`),
# looked up in torch.distributed at each call (tests and tools that wrap c10d functions see them).
_ALL_GATHER = compat.all_gather_name()
_REDUCE_SCATTER = compat.reduce_scatter_name()


# From this many bytes per shard (per message) up, gloo all-gather and reduce-scatter go
# point-to-point; see the module docstring.
_P2P_MIN_SHARD_BYTES = 2 << 20


class _GroupFacts(NamedTuple):
    size: int
    backend: str  # lower case: "nccl", "gloo", "fake", "threaded", ...
    calls: GroupCalls  # this rank's collectives on the group, numbered (dbuffer.calls)


# A group's size and backend never change (unlike the rank, the same on every rank sharing a group
# object) and c10d's getters cost a dozen Python calls each. Weakly keyed: a destroyed group goes.
_FACTS: "weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupFacts]" = weakref.WeakKeyDictionary()


def _facts(group: dist.ProcessGroup | None) -> _GroupFacts:
    if group is None:  # the default group: looked up each time (it may be destroyed and made again)
        group = dist.distributed_c10d._get_default_group()
    facts = _FACTS.get(group)
    if facts is None:
        facts = _FACTS[group] = _GroupFacts(dist.get_world_size(group), str(dist.get_backend(group)).lower(), GroupCalls())
    return facts


def _reduce_op(op: str, backend: str) -> tuple[dist.ReduceOp, bool]:
    """The c10d op to issue, and whether the result must still be divided by the group size."""
    if op == "sum":
        return dist.ReduceOp.SUM, False
    if op == "avg":
        if backend in _NATIVE_AVG_BACKENDS:
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True
    raise ValueError(f"reduce op must be 'sum' or 'avg', got {op!r}")


def c10d_reduce_op(op: str, group: dist.ProcessGroup) -> tuple[dist.ReduceOp, bool]:
    """The c10d op this module issues for ``op`` (``"sum"``/``"avg"``) on ``group``, and whether
    the result is then divided by the group size: for code that hands dbuffer's buffers to a
    user's collective (fsdp's ``set_custom_reduce_scatter``) and must reduce exactly as we do."""
    return _reduce_op(op, _facts(group).backend)


def reduce_op_name(op: dist.ReduceOp) -> str:
    """``"sum"`` / ``"avg"`` for c10d's ``SUM`` / ``AVG`` (the names this module's functions take)."""
    for name, c10d_op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        if op == c10d_op:
            return name
    raise ValueError(f"dbuffer's collectives reduce with SUM or AVG, got {op}")


def group_allocator(group: dist.ProcessGroup, device: torch.device) -> Callable[[int, torch.dtype], torch.Tensor] | None:
    """``allocate(numel, dtype)`` from ``group``'s own allocator on ``device`` (NCCL: memory
    registered with the communicator, which zero-copy transfers such as SHARP need), or None
    where the backend has none (gloo, CPU)."""
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # no backend for this device type (torch's threaded test group)
        return None
    if not backend.supports_tensor_alloc(device):
        return None

    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        return backend.allocate_tensor(numel, dtype=dtype, device=device)

    return allocate


def symmetric_allocator(
    group: dist.ProcessGroup, device: torch.device, backend: str = "NCCL"
) -> Callable[[int, torch.dtype], torch.Tensor]:
    """``allocate(numel, dtype)`` from the symmetric-memory pool of ``device`` (CUDA, NCCL), for
    buffers that :func:`rendezvous_symmetric` registers with ``group`` before a collective. A
    barrier first initialises the communicator (the rendezvous needs it), so every rank of
    ``group`` must call this together. Raises RuntimeError where symmetric memory is missing
    (CPU, gloo), as torch does."""
    import torch.distributed._symmetric_memory as symm_mem

    if device.type != "cuda":
        raise RuntimeError(
            f"symmetric memory needs CUDA devices and NCCL; this group's device is {device} (torch: "
            f"'SymmetricMemory does not find allocation backend {backend}')"
        )
    if _debug.ENABLED:
        _debug.check(group, "symmetric_allocator", f"{backend} {device.type}")
    symm_mem.set_backend(backend)
    dist.barrier(group=group)
    pool = symm_mem.get_mem_pool(device)

    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.use_mem_pool(pool):  # the pool reuses blocks: one rendezvous per block
            return torch.empty(numel, dtype=dtype, device=device)

    return allocate


def rendezvous_symmetric(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Register a :func:`symmetric_allocator` tensor with ``group`` (collective: every rank, same
    order) so that NCCL runs its symmetric-memory algorithms on it."""
    import torch.distributed._symmetric_memory as symm_mem

    if _debug.ENABLED:
        _debug.check(group, "rendezvous_symmetric", _describe(t))
    symm_mem.rendezvous(t, group=group.group_name)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Pending:
    """Concatenate every rank's ``inp`` into ``out`` (``out.numel() == size * inp.numel()``)."""
    size, backend, calls = _facts(group)
    if _alone(size):
        return _copied(out, inp)
    if _debug.ENABLED:
        _debug.check(group, "all_gather", _describe(out, inp))
    call = calls.note(group, "all_gather", inp.nbytes, out.nbytes)
    try:
        if backend == "gloo" and _gloo_p2p_ok(out, inp) and _big(inp):
            _check_sizes("all_gather", out, inp, size)
            rank = dist.get_rank(group)
            chunks = out.view(size, inp.numel())
            works = []
            for k in range(1, size):
                src, dst = (rank - k) % size, (rank + k) % size
                works.append(dist.irecv(chunks[src], group=group, group_src=src))
                works.append(dist.isend(inp, group=group, group_dst=dst))
            if chunks[rank].data_ptr() != inp.data_ptr():  # else already in place
                chunks[rank].copy_(inp)  # overlaps the transfers
        else:
            works = [getattr(dist, _ALL_GATHER)(out, inp, group=group, async_op=async_op)]
    except RuntimeError as exc:  # the backend's (a sync call's timeout): named
        raise call.failed(exc) from exc
    return _maybe_wait(Pending(works, lambda: out, call), async_op)


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, op: str, group: dist.ProcessGroup, async_op: bool = False
) -> Pending:
    """``out`` = chunk ``group rank`` of the reduction over ranks of ``inp``."""
    size, backend, calls = _facts(group)
    if _alone(size):
        return _copied(out, inp)
    if _debug.ENABLED:
        _debug.check(group, f"reduce_scatter({op})", _describe(out, inp))
    c10d_op, divide = _reduce_op(op, backend)
    call = calls.note(group, "reduce_scatter", inp.nbytes, out.nbytes)
    try:
        pending = _reduce_scatter(out, inp, group, size, backend, c10d_op, divide, async_op, call)
    except RuntimeError as exc:  # the backend's (a sync call's timeout): named
        raise call.failed(exc) from exc
    return _maybe_wait(pending, async_op)


class BoundCollective:
    """:func:`all_gather` or :func:`reduce_scatter` from one fixed ``inp`` into one fixed ``out``,
    decided once (the group's facts, the c10d op, whether to divide) where the call is c10d's
    one-call collective (:func:`bind`): what the function would run, for a caller that runs the
    same call every step (:class:`dbuffer.steps.PreparedRedistribute`)."""

    __slots__ = ("op", "out", "inp", "group", "size", "calls", "kwargs", "divide", "_name", "_debug", "_bytes")

    def __init__(self, op: str, out, inp, group, facts: _GroupFacts, kwargs: dict, divide: bool, debug: str) -> None:
        self.op, self.out, self.inp, self.group, self.kwargs, self.divide = op, out, inp, group, kwargs, divide
        self.size, self.calls, self._debug, self._bytes = facts.size, facts.calls, debug, (inp.nbytes, out.nbytes)
        self._name = _ALL_GATHER if op == "all_gather" else _REDUCE_SCATTER

    def start(self, finish: Callable[[], object]) -> Pending:
        """Launch asynchronously; the Pending's ``wait()`` waits, divides (``avg`` without a
        native op) and returns ``finish()``."""
        if _debug.ENABLED:
            _debug.check(self.group, self._debug, _describe(self.out, self.inp))
        call = self.calls.note(self.group, self.op, *self._bytes)
        try:
            work = getattr(dist, self._name)(self.out, self.inp, group=self.group, async_op=True, **self.kwargs)
        except RuntimeError as exc:
            raise call.failed(exc) from exc
        if self.divide:
            return Pending([work], lambda: (self.out.div_(self.size), finish())[1], call)
        return Pending([work], finish, call)


def bind(kind: str, out: torch.Tensor, inp: torch.Tensor, op: str, group: dist.ProcessGroup) -> BoundCollective | None:
    """``kind`` (``"allgather"`` or ``"reduce_scatter"`` with ``op``) from ``inp`` into ``out``
    over ``group``, bound once; None where the function decides per call (a group of one; gloo's
    hand-built paths; the default group ``None``, looked up per call): call the function then."""
    facts = None if group is None else _facts(group)
    if facts is None or facts.size == 1 or facts.backend == "gloo":
        return None
    if kind == "allgather":
        return BoundCollective("all_gather", out, inp, group, facts, {}, False, "all_gather")
    c10d_op, divide = _reduce_op(op, facts.backend)
    return BoundCollective("reduce_scatter", out, inp, group, facts, {"op": c10d_op}, divide, f"reduce_scatter({op})")


def _reduce_scatter(out, inp, group, size: int, backend: str, c10d_op, divide: bool, async_op: bool, call) -> Pending:
    """:func:`reduce_scatter`'s launch, by backend; the Pending it returns is not waited for."""
    if backend == "gloo" and _gloo_p2p_ok(out, inp):
        _check_sizes("reduce_scatter", inp, out, size)
        shard = out.numel()
        chunks = inp.view(size, shard)
        if _big(out) and size > 1:
            rank = dist.get_rank(group)
            # The first peer's chunk lands in ``out`` itself when out is apart from inp: at
            # world 2 that needs no scratch at all (a gradient shard less at the backward peak).
            direct = not _overlaps(out, inp)
            workspace = _WORKSPACES.take((size - 1 - direct) * shard, inp.dtype)
            received = ([out] if direct else []) + list(workspace.view(size - 1 - direct, shard))
            works = []
            for k in range(1, size):
                src, dst = (rank - k) % size, (rank + k) % size
                works.append(dist.irecv(received[k - 1], group=group, group_src=src))
                works.append(dist.isend(chunks[dst], group=group, group_dst=dst))

            def reduce() -> None:  # own + first peer (either order: the same bits), then the rest
                if direct:
                    out.add_(chunks[rank])
                else:
                    torch.add(chunks[rank], received[0], out=out)  # elementwise: out may alias chunks[rank]
                for j in range(1, size - 1):
                    out.add_(received[j])

        else:
            workspace = _WORKSPACES.take(size * shard, inp.dtype)
            works = [dist.all_to_all_single(workspace, inp, group=group, async_op=async_op)]
            rows = workspace.view(size, shard)

            def reduce() -> None:  # in rank order; adds beat torch.sum(dim=0) (2x at 1 MiB)
                if size == 1:  # a group of one that communicates (singleton_groups_communicate)
                    out.copy_(rows[0])
                    return
                torch.add(rows[0], rows[1], out=out)
                for j in range(2, size):
                    out.add_(rows[j])

        def finish() -> torch.Tensor:
            reduce()
            _WORKSPACES.give(workspace)
            return out.div_(size) if divide else out

        return Pending(works, finish, call)
    work = getattr(dist, _REDUCE_SCATTER)(out, inp, op=c10d_op, group=group, async_op=async_op)
    return Pending([work], (lambda: out.div_(size)) if divide else (lambda: out), call)


def all_reduce(t: torch.Tensor, op: str, group: dist.ProcessGroup, async_op: bool = False) -> Pending:
    """Reduce ``t`` in place over the group."""
    size, backend, calls = _facts(group)
    if _alone(size):
        return _copied(t, t)
    if _debug.ENABLED:
        _debug.check(group, f"all_reduce({op})", _describe(t))
    c10d_op, divide = _reduce_op(op, backend)
    call = calls.note(group, "all_reduce", t.nbytes, t.nbytes)
    try:
        work = dist.all_reduce(t, op=c10d_op, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise call.failed(exc) from exc
    return _maybe_wait(Pending([work], (lambda: t.div_(size)) if divide else (lambda: t), call), async_op)


def broadcast_segments(
    buf: torch.Tensor, segments: list[tuple[int, int, int]], group: dist.ProcessGroup, async_op: bool = False
) -> Pending:
    """For each ``(src, start, end)``: ``buf[start:end]`` on every rank becomes group rank
    ``src``'s. One broadcast per segment, in the given order (the same on every rank): an
    all-gather of unequal pieces without padding them to the largest."""
    if _debug.ENABLED:
        _debug.check(group, "broadcast_segments", f"{_describe(buf)} segments={list(segments)}")
    nbytes = sum(end - start for _, start, end in segments) * buf.element_size()
    call = _facts(group).calls.note(group, "broadcast_segments", nbytes, nbytes)
    try:
        works = [
            dist.broadcast(buf[start:end], group=group, group_src=src, async_op=True)
            for src, start, end in segments
            if end > start
        ]
    except RuntimeError as exc:
        raise call.failed(exc) from exc
    return _maybe_wait(Pending(works, lambda: buf, call), async_op)


def reduce_to_owners(
    out: torch.Tensor,
    inp: torch.Tensor,
    segments: list[tuple[int, int, int]],
    op: str,
    group: dist.ProcessGroup,
    async_op: bool = False,
) -> Pending:
    """``out[:n]`` of group rank ``r`` = the reduction over ranks of ``inp[start:end]`` for the
    segment ``(r, start, end)`` (``n = end - start``); the rest of ``out`` is zeroed. Only the
    segments travel (one ``all_to_all_single`` of unequal splits, no padding) and each owner
    adds what it receives in rank order, so the result does not depend on the backend."""
    if _debug.ENABLED:
        _debug.check(group, f"reduce_to_owners({op})", f"{_describe(out, inp)} segments={list(segments)}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = [end - start for _, start, end in segments]
    mine = lengths[rank]
    pooled = inp.device.type == "cpu"  # the scratch pool keeps host memory only

    def scratch(numel: int) -> torch.Tensor:
        return _WORKSPACES.take(numel, inp.dtype) if pooled else torch.empty(numel, dtype=inp.dtype, device=inp.device)

    send = scratch(sum(lengths))
    pos = 0
    for (_, start, end), n in zip(segments, lengths):  # the owners' ranges, back to back
        if n:
            send[pos : pos + n].copy_(inp[start:end])
            pos += n
    received = scratch(size * mine)
    call = _facts(group).calls.note(group, "reduce_to_owners", send.nbytes, received.nbytes)
    try:
        work = dist.all_to_all_single(
            received, send, output_split_sizes=[mine] * size, input_split_sizes=lengths, group=group, async_op=True
        )
    except RuntimeError as exc:
        raise call.failed(exc) from exc

    def finish() -> torch.Tensor:
        rows = received.view(size, mine)
        head = out[:mine]
        head.copy_(rows[0])
        for j in range(1, size):
            head.add_(rows[j])
        out[mine:].zero_()
        if op == "avg":
            head.div_(size)
        if pooled:
            _WORKSPACES.give(send)
            _WORKSPACES.give(received)
        return out

    return _maybe_wait(Pending([work], finish, call), async_op)


def _copied(out: torch.Tensor, inp: torch.Tensor) -> Pending:
    """A group of one: gathering, summing or averaging over it is a copy (no c10d call)."""
    if out.data_ptr() != inp.data_ptr():
        out.copy_(inp.view(out.shape))
    return Pending([], lambda: out)


def _describe(*tensors: torch.Tensor) -> str:
    """``dtype [numel, ...]`` for the debug mode's comparison across ranks."""
    return f"{tensors[0].dtype} {[t.numel() for t in tensors]}"


def _maybe_wait(pending: Pending, async_op: bool) -> Pending:
    if not async_op:
        pending.wait()
    return pending


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


def _gloo_p2p_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the hand-built gloo paths apply: non-empty contiguous CPU tensors of one dtype."""
    return (
        a.device.type == "cpu" == b.device.type
        and a.dtype == b.dtype
        and a.numel() > 0
        and a.is_contiguous()
        and b.is_contiguous()
    )


def _big(shard: torch.Tensor) -> bool:
    return shard.numel() * shard.element_size() >= _P2P_MIN_SHARD_BYTES


def _check_sizes(op: str, full: torch.Tensor, chunk: torch.Tensor, size: int) -> None:
    """Raise before any message is posted: mismatched sizes would otherwise hang the peers."""
    if full.numel() != size * chunk.numel():
        raise ValueError(
            f"{op}: the full tensor has {full.numel()} elements but a group of {size} ranks needs "
            f"{size} x {chunk.numel()} = {size * chunk.numel()}"
        )


_WORKSPACES = WorkspacePool()


def release_workspaces() -> None:
    """Free the idle scratch kept by gloo reduce-scatters: at most two buffers per dtype, each the
    size of the largest input seen (``(size - 1) / size`` of it from 4 MiB up)."""
    _WORKSPACES.clear()
