"""Debug mode for mismatched collectives: find the call where the ranks diverged.

When one rank skips a step, a forward, a collective or a save, its peers wait in a collective
that will never be matched until the process group's timeout, and then get the backend's generic
error. With ``DBUFFER_DEBUG_COLLECTIVES=1`` in the environment (read once, when ``dbuffer`` is
imported; :func:`set_enabled` switches it at run time), every collective of :mod:`dbuffer.collectives`
(all the toolkit runs, but teardown's last barrier) and every :func:`fsdp.checkpoint.save` /
``load`` first checks across the group's ranks that all of them are at the same call:

* each rank numbers its calls per process group (``#0, #1, ...``) and publishes
  ``op dtype sizes`` and the caller's label (fsdp's unit: ``of fsdp unit 'encoder' (Encoder)``,
  :mod:`dbuffer.calls`) plus where it was called from (the toolkit's frames and the first frame of
  user code) in the default c10d store, under ``dbuffer_debug/<epoch>/<group>/<seq>/<rank>``;
* it then waits for the other ranks' entries of the same number, at most
  ``DBUFFER_DEBUG_TIMEOUT`` seconds (default 30), and compares them.

A difference raises :class:`CollectiveMismatchError` on every rank that sees it, naming the call
number, each rank's call and the last call all ranks agreed on; a rank that does not arrive in
time makes the waiting ranks raise it too, naming the missing ranks, what this rank was doing and
the last call the missing ranks made. Both are raised before the collective is issued, so the
process group is left consistent. Only the ``op dtype sizes`` and label part is compared (the
callers are for the message).

Cost: off, one module-level bool check per collective. On, each collective becomes a store round
trip and a barrier of the group (a few store messages per rank), and the last two entries per
rank stay in the store; use it to find a divergence, not for training speed. Collectives that do
not go through the toolkit (``torch.distributed`` calls in user code, DTensor ops such as
``clip_grad_norm_``, DCP's own planning collectives) are not numbered; a rank blocked in one shows
up as a rank that did not arrive.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from typing import Optional

import torch.distributed as dist

from dbuffer.calls import current_label

__all__ = ["CollectiveMismatchError", "ENABLED", "TIMEOUT", "check", "set_enabled"]

ENV, TIMEOUT_ENV = "DBUFFER_DEBUG_COLLECTIVES", "DBUFFER_DEBUG_TIMEOUT"


def _flag(value: Optional[str]) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def _seconds(value: Optional[str]) -> float:
    try:
        seconds = float(value or 30.0)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return seconds


ENABLED: bool = _flag(os.environ.get(ENV))
TIMEOUT: float = _seconds(os.environ.get(TIMEOUT_ENV))


class CollectiveMismatchError(RuntimeError):
    """The ranks of a process group are not at the same collective (debug mode)."""


def set_enabled(enabled: bool, timeout: Optional[float] = None) -> None:
    """Switch the debug mode on or off in this process (every rank must do the same, at the same
    point: the call numbering restarts). ``timeout``: seconds to wait for the other ranks."""
    global ENABLED, TIMEOUT, _EPOCH
    if timeout is not None:
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        TIMEOUT = float(timeout)
    with _LOCK:
        _STATES.clear()
        _EPOCH += 1
    ENABLED = bool(enabled)


class _RankState:
    """One rank's numbering: per process group, the next call number and the last agreed call."""

    def __init__(self, store) -> None:
        self.store = store
        self.seq: dict[str, int] = {}
        self.last: dict[str, tuple[int, dict[int, str]]] = {}
        self.apart: dict[str, tuple[int, dict[int, str]]] = {}  # last agreed call reached from different places


_LOCK = threading.Lock()
_STATES: dict[int, _RankState] = {}  # by global rank (threaded test worlds share this process)
_EPOCH = 0
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PACKAGE_DIR)
_TOOLKIT_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("dbuffer", "fsdp"))
_FSDP_DIR = _TOOLKIT_DIRS[1]
# Plumbing below the public methods, never shown: this module, the collectives, a redistribute's steps.
_SELF_FILES = (os.sep + "debug.py", os.sep + "collectives.py", os.sep + "steps.py")
_SKIP_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(dist.__file__))) + os.sep, os.path.dirname(os.__file__) + os.sep)


def check(group, op: str, detail: str) -> None:
    """Check that every rank of ``group`` (None: the default group) is at this call: ``op`` and
    ``detail`` (dtype, sizes) must be the same on all of them. Called by :mod:`dbuffer.collectives`
    when :data:`ENABLED`; raises :class:`CollectiveMismatchError`."""
    if not dist.is_available() or not dist.is_initialized():
        return
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if dist.get_world_size(group) < 2 or "fake" in str(dist.get_backend(group)).lower():
        return
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    with _LOCK:
        state = _STATES.get(rank)
        if state is None or state.store is not store:  # a new process group: start again
            state = _STATES[rank] = _RankState(store)
        epoch = _EPOCH
    name = group.group_name
    seq = state.seq.get(name, 0)
    state.seq[name] = seq + 1
    members = dist.get_process_group_ranks(group)
    label = current_label()  # compared too: same-sized calls of two fsdp units differ by it
    mine = f"{op} {detail}{f' of {label.text}' if label is not None else ''}\n{_caller()}"
    prefix = f"dbuffer_debug/{epoch}/{name}/"
    store.set(f"{prefix}{seq}/{rank}", mine)
    if seq >= 2:  # every peer has read it: each has published #seq-1 since, after reading #seq-2
        try:
            store.delete_key(f"{prefix}{seq - 2}/{rank}")
        except Exception:  # a store without deletion: the entry stays
            pass
    peers = [r for r in members if r != rank]
    keys = [f"{prefix}{seq}/{r}" for r in peers]
    where = f"process group {name!r} (ranks {members})"
    try:
        store.wait(keys, datetime.timedelta(seconds=TIMEOUT))
    except Exception as exc:  # DistStoreError on timeout
        missing = [r for r, key in zip(peers, keys) if not _has(store, key)]
        if missing:
            raise CollectiveMismatchError(
                _timeout_message(seq, where, rank, mine, missing, state, name)
            ) from exc
    calls = {rank: mine}
    calls.update(zip(peers, (v.decode() if isinstance(v, bytes) else str(v) for v in _get_all(store, keys))))
    if any(_op(text) != _op(mine) for text in calls.values()):
        raise CollectiveMismatchError(_mismatch_message(seq, where, calls, state, name))
    state.last[name] = (seq, calls)
    if len(set(calls.values())) > 1:
        state.apart[name] = (seq, calls)


def _op(text: str) -> str:
    return text.split("\n", 1)[0]


def _has(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _get_all(store, keys: list[str]) -> list:
    try:
        return list(store.multi_get(keys))
    except Exception:  # a store without multi_get
        return [store.get(k) for k in keys]


def _show(text: str) -> str:
    call, _, caller = text.partition("\n")
    return f"{call}, called from {caller}" if caller else call


def _history(state: _RankState, name: str, missing: Optional[list[int]] = None) -> list[str]:
    last = state.last.get(name)
    if last is None:
        return ["  No earlier call on this group was checked since the debug mode was switched on."]
    seq, calls = last
    lines = [f"  The last call all ranks agreed on was #{seq}: {_show(sorted(calls.values())[0])}"]
    if missing:
        lines[0] += f" (the last call rank(s) {missing} made on this group)"
    apart = state.apart.get(name)
    if apart is not None:
        seq, calls = apart
        lines.append(
            f"  At #{seq} the ranks made the same call from different places (the divergence may "
            f"have begun there):"
        )
        lines += [f"    rank {r}: {_show(calls[r])}" for r in sorted(calls)]
    return lines


def _mismatch_message(seq: int, where: str, calls: dict[int, str], state: _RankState, name: str) -> str:
    by_call: dict[str, list[int]] = {}
    for r in sorted(calls):
        by_call.setdefault(_op(calls[r]), []).append(r)
    lines = [f"dbuffer debug: the ranks of {where} are at different collectives at call #{seq}:"]
    for ranks in by_call.values():
        lines.append(f"  rank(s) {ranks}: {_show(calls[ranks[0]])}")
    lines += _history(state, name)
    lines.append(
        "Some rank skipped or added a call before this one (a forward, a backward, an optimizer "
        "step, a collective or a checkpoint save/load on only some ranks, or different shapes): "
        "make every rank run the same calls in the same order."
    )
    return "\n".join(lines)


def _timeout_message(seq: int, where: str, rank: int, mine: str, missing: list[int], state: _RankState, name: str) -> str:
    lines = [
        f"dbuffer debug: rank(s) {missing} of {where} did not reach call #{seq} within "
        f"{TIMEOUT:g} s ({TIMEOUT_ENV}).",
        f"  This rank ({rank}) is at #{seq}: {_show(mine)}",
    ]
    lines += _history(state, name, missing)
    lines.append(
        f"Rank(s) {missing} skipped this call, are blocked in something else (a collective outside "
        f"dbuffer, e.g. a torch.distributed call of your own, a DTensor op or DCP), have exited, "
        f"or are slower than the timeout (raise {TIMEOUT_ENV})."
    )
    return "\n".join(lines)


def _caller() -> str:
    """Where the collective was called from, innermost first: the public dbuffer methods and the
    fsdp functions on the way, then the first frame outside the toolkit, torch and the standard
    library (user code)."""
    frame = sys._getframe(2)
    parts: list[str] = []
    depth = 0
    while frame is not None and depth < 100:
        depth += 1
        code = frame.f_code
        path = code.co_filename
        if path.startswith(_TOOLKIT_DIRS):
            public = path.startswith(_FSDP_DIR) or not code.co_name.startswith("_")
            if public and len(parts) < 5 and not path.endswith(_SELF_FILES):
                parts.append(f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno} {code.co_name}")
        elif not path.startswith(_SKIP_DIRS) and not path.startswith("<"):
            parts.append(f"{os.path.basename(path)}:{frame.f_lineno} {code.co_name}")
            break
        frame = frame.f_back
    return " <- ".join(parts) if parts else "?"
