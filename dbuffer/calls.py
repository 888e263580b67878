"""A collective call as a rank can name it: who launched it, its number, its bytes, and the
error it raises when it fails.

A rank whose peers are at another collective waits until the process group's timeout, and the
backend's error then says only that a send or a receive timed out (gloo: ``Timed out waiting
...ms for send operation to complete``). Every collective of :mod:`dbuffer.collectives` therefore
notes, at its launch, a :class:`Call`: the operation, its number on its process group (``#0, #1,
...`` per rank, as the debug mode numbers them), its bytes in and out, and the :class:`CallLabel`
its caller set (fsdp: ``fsdp unit 'layers.3' (Block)``). When the backend raises, at the launch or
at ``Pending.wait()``, the call raises :class:`CollectiveError` instead, naming all that, and
what the other ranks of the group were doing: each failing rank publishes its call in the c10d
store and waits up to :data:`REPORT_WAIT` seconds for its peers' (ranks whose own collective
failed in that time; a rank blocked elsewhere or gone is named as silent). The message points at
``DBUFFER_DEBUG_COLLECTIVES=1`` (:mod:`dbuffer.debug`), which finds the first call where the ranks
differ.

Labels travel in a context variable, so a layer above dbuffer (fsdp) names its collectives
without dbuffer knowing it: ``with label: buf.redistribute(...)``. The cost on the hot path is the
label's enter and exit, a context-variable read and one small object per collective; the store
is touched only once a collective has failed.
"""

from __future__ import annotations

import datetime
from contextvars import ContextVar
from typing import Callable, Optional

import torch.distributed as dist

__all__ = ["REPORT_WAIT", "Call", "CallLabel", "CollectiveError", "GroupCalls", "Pending", "current_label"]

#: Seconds a failed collective waits for the other ranks' reports (their own failures).
REPORT_WAIT = 10.0

_CURRENT: ContextVar[Optional["CallLabel"]] = ContextVar("dbuffer_call_label", default=None)


def current_label() -> Optional["CallLabel"]:
    """The label of the collectives launched now (None: none set)."""
    return _CURRENT.get()


class CollectiveError(dist.DistBackendError):
    """A collective of dbuffer (so of fsdp) failed or timed out. Raised, instead of the backend's
    error, by the call that launched it or by ``Pending.wait()``, on every rank whose collective
    failed: the message names the operation, its call number on the process group, its bytes in
    and out, the :class:`CallLabel` it ran under (fsdp: the unit's module path) and the other
    ranks' calls, and points at ``DBUFFER_DEBUG_COLLECTIVES=1``; ``__cause__`` is the backend's
    error. A ``torch.distributed.DistBackendError``, so code that handles those still does."""


class CallLabel:
    """What the collectives launched inside ``with label:`` are for: ``text`` (fsdp sets
    ``fsdp unit 'layers.3' (Block)``) is shown by a :class:`CollectiveError` when one fails, and
    compared across ranks by the debug mode. Reusable and re-entrant (labels nest: the innermost
    applies); the label in force is per thread (a context variable), so one object must not be
    entered by two threads at once. Raises nothing; entering costs a context-variable set."""

    __slots__ = ("text", "_tokens")

    def __init__(self, text: str) -> None:
        self.text = text
        self._tokens: list = []

    def __enter__(self) -> "CallLabel":
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"CallLabel({self.text!r})"


class GroupCalls:
    """One process group's collectives on this rank: how many were launched (the next call's
    number). Kept beside the group's size and backend (:mod:`dbuffer.collectives`)."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def note(self, group: Optional[dist.ProcessGroup], op: str, nbytes_in: int, nbytes_out: int) -> "Call":
        """The call being launched now, numbered and labelled."""
        seq = self.calls
        self.calls = seq + 1
        return Call(op, seq, nbytes_in, nbytes_out, _CURRENT.get(), group)


class Call:
    """One collective as launched: what a failure names (:meth:`failed`)."""

    __slots__ = ("op", "seq", "nbytes_in", "nbytes_out", "label", "group")

    def __init__(self, op: str, seq: int, nbytes_in: int, nbytes_out: int, label: Optional[CallLabel], group) -> None:
        self.op, self.seq, self.nbytes_in, self.nbytes_out = op, seq, nbytes_in, nbytes_out
        self.label, self.group = label, group

    def describe(self) -> str:
        """``all_gather #12 of fsdp unit 'encoder' (Encoder), 2.0 KiB in, 4.0 KiB out``."""
        who = f"of {self.label.text}" if self.label is not None else "(no label: not launched by fsdp)"
        return f"{self.op} #{self.seq} {who}, {_size(self.nbytes_in)} in, {_size(self.nbytes_out)} out"

    def failed(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``, which the backend raised for this call: a
        :class:`CollectiveError` naming it and the peers' calls (``exc`` itself if it already is one)."""
        if isinstance(exc, CollectiveError):
            return exc
        cause = _first_line(exc)
        where, peers = self._exchange(cause)
        lines = [f"{self.describe()} on {where} failed: {cause}"]
        lines += peers
        lines.append(
            "A collective that times out usually means the ranks are not at the same call: a module "
            "that runs on some ranks only (an encoder fed only batches with images, a branch taken "
            "on some ranks), a forward, backward or optimizer step on some ranks only, or different "
            "shapes; at equal sizes such calls can even pair up and exchange the wrong data. Make every "
            "rank run the same units in the same order (run a skipped module on a dummy input). To find "
            "the first call where the ranks differ, rerun with DBUFFER_DEBUG_COLLECTIVES=1: every rank "
            "then raises CollectiveMismatchError there, naming each rank's call."
        )
        return CollectiveError("\n".join(lines))

    def _exchange(self, cause: str) -> tuple[str, list[str]]:
        """Publish this rank's call in the c10d store and read the group's other ranks' (best
        effort: anything the store cannot do leaves them unnamed)."""
        group = self.group
        try:
            if group is None:
                group = dist.distributed_c10d._get_default_group()
            members = dist.get_process_group_ranks(group)
            rank = dist.get_rank()
            name = group.group_name
        except Exception:  # no process group any more
            return "its process group", []
        where = f"process group {name!r} (ranks {_ranks(members)})"
        peers = [r for r in members if r != rank]
        if not peers:
            return where, []
        try:
            store = dist.distributed_c10d._get_default_store()
            prefix = f"dbuffer_failed/{name}/"
            store.set(f"{prefix}{rank}", f"{self.seq}\t{self.describe()}; it failed too: {cause}")
            keys = [f"{prefix}{r}" for r in peers]
            try:
                store.wait(keys, datetime.timedelta(seconds=REPORT_WAIT))
            except Exception:  # some never reported: named below
                pass
            reports = {r: _text(store.get(k)).split("\t", 1) for r, k in zip(peers, keys) if store.check([k])}
        except Exception:
            return where, []
        lines = _by_report({r: text for r, (_, text) in reports.items()})
        if any(seq != str(self.seq) for seq, _ in reports.values()):
            lines.append(
                "  The ranks are at different call numbers: before these calls some rank made more "
                "collectives on this group than another (same-sized calls of different units pair "
                "up silently until the ranks part)."
            )
        silent = [r for r in peers if r not in reports]
        if silent:
            lines.append(
                f"  rank(s) {_ranks(silent)}: no report within {REPORT_WAIT:g} s (blocked in something "
                f"else, e.g. a collective outside dbuffer or a later call, exited, or slower to time out)"
            )
        return where, [f"This rank ({rank}) was at call #{self.seq}; the other ranks of the group:"] + lines


class Pending:
    """Work in flight: what a DBuffer primitive with ``async_op=True`` returns.

    ``works``: the c10d work handles (None entries for steps done synchronously); ``finish``:
    run once after they complete (post-processing such as the local sum of a gloo reduce-scatter
    or the division of an average), its value being the result; ``call``: the collective, named
    when it fails. Built by dbuffer, not by users. ``wait()`` blocks (on CUDA: orders the current
    stream) and returns the result; a backend error becomes :class:`CollectiveError` naming the
    call (``CollectiveMismatchError`` in debug mode is raised earlier, at the call). Calling it
    again returns the same result at once.
    """

    def __init__(self, works: list, finish: Callable[[], object], call: Optional[Call] = None) -> None:
        self._works = works
        self._finish = finish
        self._call = call
        self._result: object = None
        self._done = False

    def wait(self):
        """Finish the work (once) and return the result: the ``out`` buffer."""
        if not self._done:
            try:
                for work in self._works:
                    if work is not None:
                        work.wait()
            except RuntimeError as exc:
                if self._call is None:
                    raise
                raise self._call.failed(exc) from exc
            self._result = self._finish()
            self._done = True
            # Drop the works and the finishing closure now: they hold the collective's buffers
            # (scratch, inputs), and a closure that names its own Pending would keep them until
            # the next garbage collection (through the optimizer step).
            self._works, self._finish = [], None
        return self._result

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return without blocking on the collectives."""
        return self._done or all(w is None or w.is_completed() for w in self._works)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _by_report(reports: dict[int, str]) -> list[str]:
    """One line per distinct report, naming the ranks that sent it (at most 6 lines)."""
    by: dict[str, list[int]] = {}
    for r in sorted(reports):
        by.setdefault(reports[r], []).append(r)
    lines = [f"  rank(s) {_ranks(ranks)}: {text}" for text, ranks in list(by.items())[:6]]
    if len(by) > 6:
        lines.append(f"  ... and {len(by) - 6} other calls")
    return lines
