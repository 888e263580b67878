"""The c10d calls a piece of work makes: counted, and recorded for a replay.

:class:`CommCounter` wraps the ``torch.distributed`` collective and point-to-point functions
while installed. Inside ``counting(label)`` it counts, under that label: ``calls``, every c10d
call (isend and irecv each count one); ``ops``, collectives, with the isend/irecv calls of one
point-to-point all-gather or reduce-scatter (``world - 1`` sends and receives posted together)
counted as one op; ``bytes_sent``, what this rank must send for them with a bandwidth-optimal
algorithm: all-gather ``(W-1) * input``, reduce-scatter and all-to-all ``(W-1)/W * input``,
all-reduce ``2 (W-1)/W * tensor``, send the tensor (gloo's own algorithms may move more: its
``reduce_scatter_single`` runs as an all-reduce). Inside ``recording()`` it records the calls as
:class:`tools.kit.comm_replay.Call` values, which :class:`tools.kit.comm_replay.Replay` replays
alone. Calls made by a wrapped call (a collective built on others) are not counted again.

``collectives`` counts, by kind, the collectives the step asked for, whatever c10d calls carry
them: a call of one of ``dbuffer.collectives``' functions (the one module of the library that
calls c10d, CONTRIBUTING.md) is one collective of the operation it implements (``LIBRARY_OPS``:
on gloo, fsdp's all-gather of a big shard is ``world - 1`` isend/irecv pairs and its
reduce-scatter an ``all_to_all_single`` or isend/irecv, each one ``all_gather`` or
``reduce_scatter`` here); a c10d call made outside them (torch FSDP2's, a user's) is one of its
own kind (``p2p`` for a point-to-point exchange). ``library_ops`` counts those made through
``dbuffer.collectives``: equal to the sum of ``collectives`` when every collective of the step
went through the library.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from tools.kit import comm_replay

_COLLECTIVES = {  # function -> (kind, how the sent bytes follow from (input bytes, W))
    "all_gather_single": ("all_gather", "input_tensor", lambda b, w: (w - 1) * b),
    "all_gather_into_tensor": ("all_gather", "input_tensor", lambda b, w: (w - 1) * b),
    "all_gather": ("all_gather", "tensor", lambda b, w: (w - 1) * b),
    "reduce_scatter_single": ("reduce_scatter", "input", lambda b, w: (w - 1) * b / w),
    "reduce_scatter_tensor": ("reduce_scatter", "input", lambda b, w: (w - 1) * b / w),
    "reduce_scatter": ("reduce_scatter", "input_list", lambda b, w: (w - 1) * b / w),
    "all_reduce": ("all_reduce", "tensor", lambda b, w: 2 * (w - 1) * b / w),
    "all_to_all_single": ("all_to_all", "input", lambda b, w: (w - 1) * b / w),
    "all_to_all": ("all_to_all", "input_tensor_list", lambda b, w: (w - 1) * b / w),
    "broadcast": ("broadcast", "tensor", lambda b, w: b),  # upper bound: what a relay sends
    "reduce": ("reduce", "tensor", lambda b, w: b),
    "barrier": ("barrier", None, lambda b, w: 0),
}
_P2P = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}
# dbuffer.collectives' functions -> the operation each implements (owned layouts gather by
# broadcasts of each owner's range and reduce by one all-to-all to the owners).
LIBRARY_OPS = {"all_gather": "all_gather", "broadcast_segments": "all_gather", "reduce_scatter": "reduce_scatter",
               "reduce_to_owners": "reduce_scatter", "all_reduce": "all_reduce"}


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


class CommCounter:
    """Counts the c10d calls made through ``torch.distributed``'s functions while installed,
    attributed to ``self.label`` (calls made while it is None are not counted)."""

    def __init__(self) -> None:
        self.label: Optional[str] = None
        self.stats: dict[str, dict] = {}
        self._originals: dict[tuple[Any, str], Callable] = {}  # (module, name) -> original
        self._depth = 0
        self._library_depth = 0  # > 0 inside a call of dbuffer.collectives' functions
        self._exchange: Optional[dict] = None  # the point-to-point op being posted
        self.trace: Optional[list] = None  # the calls being recorded (``recording``), for a replay

    def _stats(self) -> dict:
        return self.stats.setdefault(self.label, {"calls": 0, "ops": 0, "bytes_sent": 0.0, "by_kind": {},
                                                  "collectives": {}, "library_ops": 0})

    def _collective(self, kind: str, library: bool = False) -> None:
        """One collective the step asked for (see the module docstring)."""
        if self.label is None:
            return
        s = self._stats()
        s["collectives"][kind] = s["collectives"].get(kind, 0) + 1
        s["library_ops"] += library

    def _count(self, kind: str, sent: float, new_op: bool) -> None:
        if self.label is None:  # only recording
            return
        s = self._stats()
        s["calls"] += 1
        s["bytes_sent"] += sent
        k = s["by_kind"].setdefault(kind, {"calls": 0, "bytes_sent": 0.0})
        k["calls"] += 1
        k["bytes_sent"] += sent
        if new_op:
            s["ops"] += 1
            if self._library_depth == 0:
                self._collective("p2p" if kind.startswith("p2p_") else kind)

    def _on_collective(self, name: str, bound: inspect.BoundArguments) -> bool:
        kind, arg, sent_of = _COLLECTIVES[name]
        self._exchange = None
        group = bound.arguments.get("group")
        world = dist.get_world_size(group)
        size = _nbytes(bound.arguments.get(arg)) if arg else 0
        self._count(kind, float(sent_of(size, world)), new_op=True)
        return True

    def _on_p2p(self, name: str, bound: inspect.BoundArguments) -> bool:
        direction = _P2P[name]
        tensor = bound.arguments["tensor"]
        storage = tensor.untyped_storage()._cdata
        world = dist.get_world_size(bound.arguments.get("group"))
        ex = self._exchange
        joins = (
            ex is not None
            and ex[direction] < world - 1
            and (ex[direction + "_storage"] in (None, storage))
        )
        if not joins:
            ex = self._exchange = {"send": 0, "recv": 0, "send_storage": None, "recv_storage": None}
        ex[direction] += 1
        ex[direction + "_storage"] = storage
        if ex["send"] == ex["recv"] == world - 1:
            self._exchange = None  # complete: the next call starts a new op
        self._count(f"p2p_{direction}", float(_nbytes(tensor)) if direction == "send" else 0.0, new_op=not joins)
        return not joins

    def _wrap(self, name: str, fn: Callable, handler: Callable) -> Callable:
        sig = inspect.signature(fn)
        counter = self

        def wrapper(*args, **kwargs):
            if counter._depth == 0 and (counter.label is not None or counter.trace is not None):
                try:
                    bound = sig.bind(*args, **kwargs)
                except TypeError:  # a call torch itself will reject; let it
                    bound = None
                if bound is not None:
                    new_op = handler(name, bound)
                    if counter.trace is not None:
                        counter.trace.append(comm_replay.record(name, bound.arguments, new_op))
            counter._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth -= 1

        wrapper.__wrapped__ = fn
        return wrapper

    def _wrap_library(self, name: str, fn: Callable) -> Callable:
        counter = self

        def wrapper(*args, **kwargs):
            if counter._library_depth == 0:
                counter._collective(LIBRARY_OPS[name], library=True)
            counter._library_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._library_depth -= 1

        wrapper.__wrapped__ = fn
        return wrapper

    def install(self) -> None:
        from dbuffer import collectives

        for name in list(_COLLECTIVES) + list(_P2P):
            fn = getattr(dist, name, None)
            if fn is None or (dist, name) in self._originals:
                continue
            self._originals[(dist, name)] = fn
            handler = self._on_p2p if name in _P2P else self._on_collective
            setattr(dist, name, self._wrap(name, fn, handler))
        for name in LIBRARY_OPS:
            fn = getattr(collectives, name, None)
            if fn is None or (collectives, name) in self._originals:
                continue
            self._originals[(collectives, name)] = fn
            setattr(collectives, name, self._wrap_library(name, fn))

    def uninstall(self) -> None:
        for (module, name), fn in self._originals.items():
            setattr(module, name, fn)
        self._originals.clear()

    @contextlib.contextmanager
    def counting(self, label: str):
        self.label, self._exchange = label, None
        try:
            yield
        finally:
            self.label, self._exchange = None, None

    @contextlib.contextmanager
    def recording(self):
        """Record the calls made inside (``comm_replay.Call`` values); yields the list."""
        self.trace, self._exchange = [], None
        try:
            yield self.trace
        finally:
            self.trace, self._exchange = None, None
