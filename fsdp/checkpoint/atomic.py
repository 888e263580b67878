"""``save`` / ``load``: DCP with an atomic publish and verification before anything is read
(the guarantees are in :mod:`fsdp.checkpoint`'s docstring; the files in :mod:`.files`)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import warnings
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dbuffer import debug
from dbuffer.dtensor import broadcast_object
from fsdp.checkpoint.files import (
    METADATA,
    OLD,
    PARTIAL,
    CheckpointError,
    Verified,
    check_file,
    crc32,
    inspect,
    write_checksums,
)
from fsdp.checkpoint.unpickler import Refused, read_object

__all__ = ["load", "save"]

_CRC_KEY = "__fsdp_crc32__/"  # write results that carry a file's checksum to the coordinator


def save(state: dict[str, Any], path: Union[str, os.PathLike], *, planner: Optional[SavePlanner] = None) -> None:
    """``dcp.save(state, planner=planner)`` into directory ``path``, on every rank, published
    atomically (:mod:`fsdp.checkpoint`). Raises :class:`CheckpointError` if ``path`` exists and is
    not a checkpoint."""
    if debug.ENABLED:
        debug.check(None, "fsdp.checkpoint.save", repr(os.fspath(path)))
    path = os.path.abspath(os.fspath(path))
    problem = _on_rank0(lambda: _not_ours(path))
    if problem is not None:
        raise CheckpointError(problem)
    _unwrap(lambda: dcp.save(state, storage_writer=_AtomicWriter(path), planner=planner))


# What a save writes (DCP's data, metadata and its temporary, the checksums); nothing else is ours.
_SAVE_FILES = re.compile(r"__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|\.checksums")


def _not_ours(path: str) -> Optional[str]:
    """Why a save (replacing ``path``, clearing ``.partial``, deleting ``.old``) could destroy what
    is not a checkpoint, or None: ``path`` must be absent, empty or a complete checkpoint, the
    others may hold only files a save writes."""
    fix = "choose another path, or move it away yourself"
    for target, complete in ((path, True), (path + PARTIAL, False), (path + OLD, False)):
        try:
            if not os.path.lexists(target):
                continue
            if os.path.islink(target):
                return (
                    f"cannot save to {path}: {target} is a symbolic link, which a save would replace; "
                    f"pass the directory it points to ({os.path.realpath(target)}) or {fix}"
                )
            if not os.path.isdir(target):
                return f"cannot save to {path}: {target} exists and is a file, not a checkpoint directory; {fix}"
            entries = sorted(os.listdir(target))
        except OSError as exc:
            return f"cannot save to {path}: {target} cannot be inspected ({exc!r}); {fix}"
        foreign = [e for e in entries if not _SAVE_FILES.fullmatch(e)]
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            return (
                f"cannot save to {path}: {target} exists and is not a checkpoint (it holds {shown}, "
                f"which no save writes), and a save would replace it; {fix}"
            )
        if complete and entries and METADATA not in entries:
            return (
                f"cannot save to {path}: {target} exists and is not a checkpoint (no {METADATA}); "
                f"refusing to replace it: {fix}"
            )
    return None


def _on_rank0(decide):
    """``decide()`` on rank 0, sent to every rank: one decision before DCP's first collective, even
    where ranks see a shared file system differently. It must not raise: the others would wait."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    backend = str(dist.get_backend()).lower()
    if "fake" in backend:
        return decide()
    return broadcast_object(decide() if dist.get_rank() == 0 else None, None, 0, object_device(backend))


def object_device(backend: str) -> torch.device:
    """Where ``backend``'s default group moves objects: CUDA if only NCCL serves it, else CPU."""
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _AtomicWriter(FileSystemWriter):
    """Writes ``<path>.partial``, recording each data file's CRC32; ``finish`` (the coordinator's,
    after every rank wrote) writes ``.metadata``, then ``.checksums``, then publishes ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__(path + PARTIAL)
        self.final = path

    def prepare_global_plan(self, plans):
        # After every local plan (which makes the dir), before any write: clear an interrupted save.
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner) -> Future:
        results = super().write_data(plan, planner).wait()
        for name in sorted({r.storage_data.relative_path for r in results}):
            crc = crc32(os.path.join(self.path, name))
            results.append(WriteResult(index=MetadataIndex(_CRC_KEY + name), size_in_bytes=0, storage_data=crc))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results) -> None:
        sums, kept = {}, []
        for rank_results in results:
            kept.append([])
            for r in rank_results:
                if r.index.fqn.startswith(_CRC_KEY):
                    sums[r.index.fqn[len(_CRC_KEY) :]] = r.storage_data
                else:
                    kept[-1].append(r)
        _check_shared(os.fspath(self.path), sums)
        super().finish(metadata, kept)  # writes .metadata (fsynced)
        sums[METADATA] = crc32(os.path.join(self.path, METADATA))
        write_checksums(os.fspath(self.path), sums)  # fsynced
        _publish(os.fspath(self.path), self.final)


def _check_shared(staging: str, sums: dict) -> None:
    """Every rank's data file is where the coordinator publishes from, as that rank wrote it:
    else the ranks do not share one file system, and publishing would lose the other ranks' data."""
    for name, (size, _) in sorted(sums.items()):
        file = os.path.join(staging, name)
        try:
            with open(file, "rb") as f:  # opened, not stat'ed: NFS revalidates a file on open
                seen = os.fstat(f.fileno()).st_size
        except OSError:
            seen = None
        if seen != size:
            raise CheckpointError(
                f"cannot save to {staging[: -len(PARTIAL)]}: rank 0 does not see {file} as the rank that wrote "
                f"it does ({size} bytes): a save needs a directory every rank shares (one file system, e.g. NFS "
                f"or Lustre), not a local disk per node; nothing was published"
            )


def _publish(staging: str, final: str) -> None:
    """Make the complete ``staging`` directory ``final``; what a crash or a power cut leaves at
    each point is in fsdp/README.md, "Checkpoints". Every file in ``staging`` is fsynced."""
    old, parent = final + OLD, os.path.dirname(final)
    fsync_dir(staging)  # its entries are on disk before anything that depends on them
    if os.path.exists(final):
        if os.path.lexists(old):  # a save cut after it published: its renames on disk, then its .old goes
            fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(parent)  # both renames on disk before the previous checkpoint goes
    shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: str) -> None:
    """fsync a directory's entries where the file system can (tests replace it to see the order)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(state: dict[str, Any], path: Union[str, os.PathLike], *, allow_unverified: bool = False,
         trust_pickled_objects: bool = False) -> None:
    """``dcp.load(state)`` from ``path``, in place, at any world size or sharding strategy.

    Every key of ``state`` must be in the checkpoint with the same global shape. Every file read is
    verified first (size, CRC32) and nothing in it runs (:mod:`fsdp.checkpoint.unpickler`; admit a
    class with ``torch.serialization.add_safe_globals``); a problem raises :class:`CheckpointError`
    naming the file on every rank before anything is copied. ``allow_unverified=True`` loads, with
    a warning, a checkpoint without ``.checksums`` (plain ``dcp.save``, FSDP2);
    ``trust_pickled_objects=True`` unpickles without restriction: its writer can then run any code.
    """
    if debug.ENABLED:
        debug.check(None, "fsdp.checkpoint.load", repr(os.fspath(path)))
    path = os.path.abspath(os.fspath(path))
    verdict = _on_rank0(lambda: inspect(path, allow_unverified, trust_pickled_objects))
    if isinstance(verdict, str):
        raise CheckpointError(verdict)
    for note in verdict.notes:
        warnings.warn(note, stacklevel=2)
    reader = _CheckedReader(verdict, trust_pickled_objects)
    planner = _CheckedPlanner(verdict.path, trust_pickled_objects)
    _unwrap(lambda: dcp.load(state, storage_reader=reader, planner=planner))


def _unwrap(fn) -> None:
    """Run a DCP call, re-raising the first failing rank's error on every rank (DCP's as cause)."""
    try:
        fn()
    except CheckpointException as exc:
        failures = exc.failures
        if not failures:
            raise
        raise failures[min(failures)][0] from exc


def _entry(stream, key: str, file: str, trusted: bool) -> Any:
    """Non-tensor entry ``key`` read from ``stream`` (a slice of data file ``file``)."""
    try:
        return read_object(stream, trusted)
    except Refused as exc:
        raise CheckpointError(
            f"key {key!r} of checkpoint file {file} is a pickle naming {exc.what}, which torch.load("
            f"weights_only=True) does not admit: refusing to unpickle it (unpickling runs what a pickle names). "
            f"If it is a class of your own, admit it with torch.serialization.add_safe_globals([...]); load with "
            f"trust_pickled_objects=True only if you trust whoever wrote the checkpoint"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"key {key!r} of checkpoint file {file} cannot be read (corrupted?): {exc!r}") from exc


class _CheckedPlanner(DefaultLoadPlanner):
    """Checks every key and shape; non-tensor entries are read by :func:`.unpickler.read_object`."""

    def __init__(self, path: str, trusted: bool) -> None:
        super().__init__()
        self.path = path
        self.trusted = trusted

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        file = os.path.join(self.path, self.metadata.storage_data[read_item.storage_index].relative_path)
        obj = _entry(value, key, file, self.trusted)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if md is None:
                raise CheckpointError(f"key {fqn!r} of the state dict is missing from checkpoint {self.path}")
            if isinstance(obj, torch.Tensor):
                if not isinstance(md, TensorStorageMetadata):
                    raise CheckpointError(f"key {fqn!r}: checkpoint {self.path} holds a non-tensor value there")
                if tuple(md.size) != tuple(obj.size()):
                    raise CheckpointError(
                        f"key {fqn!r}: shape {tuple(md.size)} in checkpoint {self.path}, "
                        f"but {tuple(obj.size())} in the state dict being loaded"
                    )
        return super().create_local_plan()


class _CheckedReader(FileSystemReader):
    """Reads a :class:`Verified` checkpoint: rank 0's verified metadata (never the file again), each
    data file this rank reads checked while planning, then read file by file (failures name it)."""

    def __init__(self, verified: Verified, trusted: bool) -> None:
        super().__init__(verified.path)
        self.verified = verified
        self.trusted = trusted

    def read_metadata(self, *args, **kwargs):
        metadata = self.verified.metadata
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader's
        return metadata

    def prepare_local_plan(self, plan):
        # Still planning (DCP gathers any rank's failure): check this rank's files before any copy.
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            check_file(os.fspath(self.path), name, self.verified.sums)
        entries = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if entries and not self.trusted:  # each non-tensor entry read once now, nothing kept
            super().read_data(dataclasses.replace(plan, items=entries), _EntryCheck(self.path, self.storage_data)).wait()
        return super().prepare_local_plan(plan)

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:
                file = os.path.join(self.path, name)
                raise CheckpointError(f"checkpoint file {file} cannot be read (corrupted?): {exc!r}") from exc
        fut: Future = Future()
        fut.set_result(None)
        return fut


class _EntryCheck:
    """:meth:`_CheckedReader.prepare_local_plan`'s planner: checks each non-tensor entry
    (:func:`_entry`), keeping nothing, so a refused one fails every rank while DCP still plans."""

    def __init__(self, path, storage_data) -> None:
        self.path, self.storage_data = os.fspath(path), storage_data

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        file = os.path.join(self.path, self.storage_data[read_item.storage_index].relative_path)
        _entry(value, read_item.dest_index.fqn, file, False)
