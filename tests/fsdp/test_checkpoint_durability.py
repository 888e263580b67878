"""A save survives a power cut at any point (issue 46): the previous checkpoint is kept until the
new one is complete on disk.

The save's directory fsyncs go through one seam, ``fsdp.checkpoint.atomic.fsync_dir``; the test
replaces it with a recorder that syncs nothing, records the renames and deletions too, and replays
the recording through a model of what a power cut may leave: a directory's new, renamed or
removed names are durable only once that directory is fsynced (files themselves are fsynced
by DCP and ``write_checksums`` as they are written), names change in the order they were made, and
a deleted checkpoint's data is gone at once. After every step, every state a power cut could
leave must let ``fsdp.checkpoint.load`` (``path``, else ``path.old``) find a complete checkpoint.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from fsdp import checkpoint as ckpt
from fsdp.checkpoint import atomic
from fsdp.checkpoint.files import OLD, PARTIAL


def _save(step: int, path: str) -> None:
    ckpt.save({"w": torch.full((8,), float(step)), "step": step}, path)


def _record(monkeypatch) -> list[tuple]:
    events: list[tuple] = []
    rename, rmtree = os.rename, shutil.rmtree

    def recording_rename(src, dst, *args, **kwargs):
        events.append(("rename", os.fspath(src), os.fspath(dst)))
        return rename(src, dst, *args, **kwargs)

    def recording_rmtree(path, *args, **kwargs):
        events.append(("rmtree", os.fspath(path)))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(atomic, "fsync_dir", lambda path: events.append(("fsync", os.fspath(path))))
    monkeypatch.setattr(os, "rename", recording_rename)
    monkeypatch.setattr(atomic.shutil, "rmtree", recording_rmtree)
    return events


def _survivors(events: list[tuple], path: str) -> list[tuple[int, str]]:
    """For each step of the save, every checkpoint a power cut there could leave for ``load``:
    ``(step, "old" | "new" | "lost")``."""
    parent = os.path.dirname(path)
    new_durable = False  # the entries of <path>.partial are on disk
    old_gone = False  # the previous checkpoint's data deleted
    durable = {path: "old"}  # parent's names as on disk
    pending: list[tuple[str, str]] = []  # renames in the parent since its last fsync, in order
    out = []
    for step, event in enumerate(events):
        kind, target = event[0], event[1]
        if kind == "fsync" and target == path + PARTIAL:
            new_durable = True
        elif kind == "fsync" and target == parent:
            durable = _apply(durable, pending)
            pending = []
        elif kind == "rename" and os.path.dirname(target) == parent:
            pending.append((target, event[2]))
        elif kind == "rmtree" and target == path + OLD:  # its data gone at once, whatever the names say
            old_gone = old_gone or _apply(durable, pending).get(target) == "old"
        for k in range(len(pending) + 1):  # names on disk: any prefix of the pending renames
            names = _apply(durable, pending[:k])
            found = names.get(path, names.get(path + OLD))
            ok = (found == "old" and not old_gone) or (found == "new" and new_durable)
            out.append((step, found if ok else "lost"))
    return out


def _apply(names: dict, renames: list[tuple[str, str]]) -> dict:
    names = dict(names)
    for src, dst in renames:
        if src in names:
            names[dst] = names.pop(src)
        elif src.endswith(PARTIAL):
            names[dst] = "new"
    return names


def test_the_previous_checkpoint_survives_a_power_cut_at_every_point_of_a_save(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ck")
    _save(1, path)
    events = _record(monkeypatch)
    _save(2, path)
    monkeypatch.undo()
    ours = [e for e in events if e[0] != "rename" or os.path.dirname(e[2]) == str(tmp_path)]
    order = [e for e in ours if e in {("fsync", path + PARTIAL), ("rename", path, path + OLD),
                                       ("rename", path + PARTIAL, path), ("fsync", str(tmp_path)),
                                       ("rmtree", path + OLD)}]
    assert order == [("fsync", path + PARTIAL), ("rename", path, path + OLD), ("rename", path + PARTIAL, path),
                     ("fsync", str(tmp_path)), ("rmtree", path + OLD)], events
    survivors = _survivors(ours, path)
    assert all(found != "lost" for _, found in survivors), [ours[s] for s, f in survivors if f == "lost"]
    assert survivors[-1][1] == "new"  # and in the end the new one, whatever the power did
    state = {"w": torch.zeros(8), "step": 0}
    ckpt.load(state, path)  # (the real files: the fsyncs skipped, the save complete)
    assert state["step"] == 2 and torch.equal(state["w"], torch.full((8,), 2.0))
    assert not os.path.exists(path + OLD) and not os.path.exists(path + PARTIAL)


def test_a_save_whose_ranks_do_not_share_a_file_system_publishes_nothing(tmp_path) -> None:
    """Rank 0 publishes only after seeing every rank's data file as that rank wrote it: a file
    another rank wrote on its own local disk (absent here, or of another size) raises, naming
    the file and the shared file system a save needs."""
    staging = tmp_path / ("ck" + PARTIAL)
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"x" * 10)
    atomic._check_shared(str(staging), {"__0_0.distcp": (10, 0)})  # as written: nothing to say
    for sums in ({"__0_0.distcp": (10, 0), "__1_0.distcp": (7, 0)}, {"__0_0.distcp": (11, 0)}):
        with pytest.raises(ckpt.CheckpointError, match="a directory every rank shares") as refused:
            atomic._check_shared(str(staging), sums)
        missing = next(n for n, (size, _) in sums.items() if not (staging / n).exists() or size != 10)
        assert str(staging / missing) in str(refused.value)
