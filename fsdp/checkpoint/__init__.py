"""Checkpoints of fsdp modules with torch.distributed.checkpoint (DCP).

* **Sharded** (the normal case). torch's ``get_state_dict`` / ``set_state_dict`` (from
  ``torch.distributed.checkpoint.state_dict``) work on fsdp modules unchanged: parameters and
  optimizer state are DTensors whose DCP hooks describe the exact rows each rank holds
  (:class:`dbuffer.RowShardedDTensor`; a ragged layout's piece cut mid-row,
  :class:`dbuffer.ElementShardedDTensor`, as the few boxes its elements cover), so a checkpoint
  saved at one world size, sharding strategy and layout loads at any other. :func:`save` / :func:`load` are ``dcp.save`` / ``dcp.load`` with
  the safety described below.
* **Full.** ``get_state_dict(..., options=StateDictOptions(full_state_dict=True,
  cpu_offload=True))`` gathers plain CPU tensors on rank 0 (export). To load a full state dict use
  :func:`set_state_dict` of this module: torch's full-state-dict loaders cut each tensor where
  ``torch.chunk`` would, which is not where fsdp's row-atomic layout cuts it. It takes the same
  options, ``broadcast_from_rank0=True`` included (only rank 0 of the model's mesh needs the
  dict), and copies each rank's rows straight into the live parameters and optimizer state, one
  full tensor at a time.

Safety of :func:`save` and :func:`load`:

* ``save(state, path)`` writes into ``<path>.partial``. Only after every rank has written its
  files does rank 0 (DCP's coordinator, inside DCP's own final step, so no extra collective)
  write the metadata and a CRC32 per data file, then rename the directory to ``path``; a previous
  checkpoint at ``path`` is set aside as ``<path>.old`` for the two renames and then removed. A
  crash at any point leaves ``path`` holding either the previous checkpoint or the new one
  (:func:`load` falls back to ``<path>.old`` if the crash hit between the renames).
* A save never moves, overwrites or deletes anything but checkpoint files: before anything is
  touched (and before DCP's first collective) rank 0 checks that ``path`` is absent, an empty
  directory or a complete checkpoint, and that ``<path>.partial`` and ``<path>.old`` (names a
  save reserves) hold nothing but files a save writes; a file, a symbolic link or a directory of
  other files raises :class:`CheckpointError` naming it and the fix. The decision is broadcast
  (one small collective), so every rank raises alike or none does.
* ``load(state, path)`` raises :class:`CheckpointError` naming the key (missing key, wrong shape,
  with both shapes) or the file (missing, truncated, or failing its CRC32), the same error on
  every rank, while DCP is still planning: before any rank has copied anything into ``state``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
import zlib
from typing import Any, Iterable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.futures import Future

from dbuffer import debug
from dbuffer.dtensor import ElementShardedDTensor, broadcast_, broadcast_object, row_range
from dbuffer import mesh_device

__all__ = ["CheckpointError", "StateDictOptions", "get_state_dict", "load", "save", "set_state_dict"]

PARTIAL, OLD = ".partial", ".old"
_METADATA, _CHECKSUMS = ".metadata", ".checksums"
_CRC_KEY = "__fsdp_crc32__/"  # write results that carry a file's checksum to the coordinator
_CHUNK = 16 << 20

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message names the key or the file."""


# ----------------------------------------------------------------------------- save / load


def save(state: dict[str, Any], path: Union[str, os.PathLike], *, planner: Optional[SavePlanner] = None) -> None:
    """``dcp.save(state)`` into the directory ``path``, published atomically (module docstring).

    ``state`` is anything ``dcp.save`` takes, e.g. ``{"model": msd, "optim": osd, "step": 100}``
    from :func:`get_state_dict`. Every rank calls it. An existing ``path`` must be a checkpoint.
    """
    if debug.ENABLED:
        debug.check(None, "fsdp.checkpoint.save", repr(os.fspath(path)))
    path = os.path.abspath(os.fspath(path))
    problem = _on_rank0(lambda: _not_ours(path))
    if problem is not None:
        raise CheckpointError(problem)
    _unwrap(lambda: dcp.save(state, storage_writer=_AtomicWriter(path), planner=planner))


# What a DCP save writes into its directory (FileSystemWriter's data and metadata files, the
# temporary metadata it renames, this module's checksums); anything else is someone else's.
_SAVE_FILES = re.compile(r"__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|\.checksums")


def _not_ours(path: str) -> Optional[str]:
    """Why saving to ``path`` could move, overwrite or delete something that is not a checkpoint
    (a save replaces ``path``, clears ``<path>.partial`` and deletes ``<path>.old``), or None.
    ``path`` may be absent or an empty directory; an existing one must be a complete checkpoint;
    ``.partial`` and ``.old`` may hold only the files a save writes."""
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
        if complete and entries and _METADATA not in entries:
            return (
                f"cannot save to {path}: {target} exists and is not a checkpoint (no {_METADATA}); "
                f"refusing to replace it: {fix}"
            )
    return None


def _on_rank0(decide):
    """``decide()`` run on rank 0 of the default group and sent to every rank (one decision, taken
    before DCP's first collective, even where ranks see a shared file system differently)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    backend = str(dist.get_backend()).lower()
    if "fake" in backend:
        return decide()
    cuda = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return broadcast_object(decide() if dist.get_rank() == 0 else None, None, 0, device)


def load(state: dict[str, Any], path: Union[str, os.PathLike], *, verify: bool = True) -> None:
    """``dcp.load(state)`` from ``path``, in place, at any world size or sharding strategy.

    Every key of ``state`` must be in the checkpoint with the same global shape (extra keys in
    the checkpoint are fine). With ``verify``, each rank checks the CRC32 of the files it reads.
    Then pass the loaded dicts to ``set_state_dict`` (torch's or this module's).
    """
    if debug.ENABLED:
        debug.check(None, "fsdp.checkpoint.load", repr(os.fspath(path)))
    path = _resolve(os.path.abspath(os.fspath(path)))
    _unwrap(lambda: dcp.load(state, storage_reader=_CheckedReader(path, verify), planner=_CheckedPlanner(path)))


def _resolve(path: str) -> str:
    if os.path.exists(os.path.join(path, _METADATA)):
        return path
    if os.path.exists(os.path.join(path + OLD, _METADATA)):
        warnings.warn(f"{path} is missing; loading {path + OLD}, which a save interrupted mid-publish left behind")
        return path + OLD
    hint = f" ({path + PARTIAL} is an interrupted save and is never loaded)" if os.path.exists(path + PARTIAL) else ""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is not a complete checkpoint: {os.path.join(path, _METADATA)} is missing{hint}")
    raise CheckpointError(f"no checkpoint at {path}{hint}")


def _unwrap(fn) -> None:
    """Run a DCP call; re-raise the first failing rank's own error (same on every rank) instead
    of DCP's wrapper, keeping the wrapper (every rank's traceback) as the cause."""
    try:
        fn()
    except CheckpointException as exc:
        failures = exc.failures
        if not failures:
            raise
        raise failures[min(failures)][0] from exc


class _AtomicWriter(FileSystemWriter):
    """A FileSystemWriter into ``<path>.partial`` that records each data file's CRC32 and whose
    ``finish`` (run by the coordinator after every rank has written, before any rank returns)
    publishes the directory as ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__(path + PARTIAL)
        self.final = path

    def prepare_global_plan(self, plans):
        # Coordinator, after every rank's local plan (which creates the directory), before any
        # write: clear what an interrupted save left there.
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner) -> Future:
        results = super().write_data(plan, planner).wait()
        for name in sorted({r.storage_data.relative_path for r in results}):
            crc = _crc32(os.path.join(self.path, name))
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
        with open(os.path.join(self.path, _CHECKSUMS), "w") as f:
            json.dump({"crc32": sums}, f, indent=0, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        super().finish(metadata, kept)  # writes .metadata (fsynced): the directory is complete
        _publish(os.fspath(self.path), self.final)


def _publish(staging: str, final: str) -> None:
    old = final + OLD
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(os.path.dirname(final))
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: str) -> None:
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


def _crc32(path: str) -> tuple[int, int]:
    """(size in bytes, CRC32) of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


class _CheckedPlanner(DefaultLoadPlanner):
    """Every key of the (flattened) state dict must be in the checkpoint with the same shape."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

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
    """Checks the size and CRC32 of every file a rank will read (when the checkpoint records
    them) while planning, then reads file by file, so that any failure names its file."""

    def __init__(self, path: str, verify: bool) -> None:
        super().__init__(path)
        self.verify = verify
        self.sums: Optional[dict[str, list[int]]] = None

    def read_metadata(self, *args, **kwargs):
        try:
            return super().read_metadata(*args, **kwargs)
        except Exception as exc:
            file = os.path.join(self.path, _METADATA)
            raise CheckpointError(f"checkpoint metadata {file} cannot be read: {exc!r}") from exc

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        sums_path = os.path.join(self.path, _CHECKSUMS)
        if self.verify and os.path.exists(sums_path):
            try:
                with open(sums_path) as f:
                    self.sums = json.load(f)["crc32"]
            except Exception as exc:
                raise CheckpointError(f"checksum file {sums_path} cannot be read: {exc!r}") from exc

    def prepare_local_plan(self, plan):
        # Still planning (DCP gathers a failure from any rank): check every file this rank will
        # read before any rank copies anything into its state.
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            file = os.path.join(self.path, name)
            if not os.path.exists(file):
                raise CheckpointError(f"checkpoint file {file} is missing")
            if self.sums is not None:
                self._check(name, file)
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

    def _check(self, name: str, file: str) -> None:
        if name not in self.sums:
            raise CheckpointError(f"checkpoint file {file} has no checksum in {_CHECKSUMS}: not written by this save")
        want_size, want_crc = self.sums[name]
        size, crc = _crc32(file)
        if size != want_size:
            raise CheckpointError(f"checkpoint file {file} is {size} bytes, {want_size} were written: truncated?")
        if crc != want_crc:
            raise CheckpointError(f"checkpoint file {file} is corrupted: CRC32 {crc:#010x}, {want_crc:#010x} written")


# ----------------------------------------------------------------------------- state dicts


def get_state_dict(
    model: nn.Module, optimizers: Optimizers = (), *, options: Optional[StateDictOptions] = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's ``get_state_dict`` (``optimizers`` may be empty: the second dict is then empty).

    Sharded by default: views of the live tensors, for DCP to save or load in place. With
    ``full_state_dict=True`` the tensors are gathered, and always copies: torch returns the live
    tensors themselves where nothing is sharded (``no_shard``, or world 1) and no device move
    happens, so an export taken before more training would silently change with it.
    """
    optimizers = _optimizers(optimizers)
    if not optimizers:
        out = dsd.get_model_state_dict(model, options=options), {}
    else:
        out = dsd.get_state_dict(model, optimizers, options=options)
    if options is not None and options.full_state_dict:
        live = {_storage(t) for t in _live_tensors(model, optimizers)}
        out = tuple(_copy_if_in(sd, live) for sd in out)
    return out


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers = (),
    *,
    model_state_dict: Optional[dict[str, Any]] = None,
    optim_state_dict: Optional[dict[str, Any]] = None,
    options: Optional[StateDictOptions] = None,
):
    """torch's ``set_state_dict``, plus full state dicts for fsdp's row-sharded tensors.

    With ``full_state_dict=True`` every rank passes the full dicts; with
    ``broadcast_from_rank0=True`` only rank 0 of the model's mesh does (others may pass ``{}``)
    and each full tensor is sent from it in turn. Each rank copies its own rows into the live
    parameters and optimizer state (the optimizer's state is created first if it has none).
    A key missing (with ``strict``) or a shape that differs raises :class:`CheckpointError` on
    every rank before any tensor is sent or copied.
    """
    options = options or StateDictOptions()
    optimizers = _optimizers(optimizers)
    model_state_dict = model_state_dict or {}
    optim_state_dict = optim_state_dict or {}
    if options.full_state_dict or options.broadcast_from_rank0:
        sharded = dataclasses.replace(options, full_state_dict=False, broadcast_from_rank0=False, cpu_offload=False)
        local_model, local_optim = get_state_dict(model, optimizers, options=sharded)
        source = _Source.of(model, options.broadcast_from_rank0)
        _fill(local_model, model_state_dict, "model", options.strict, source)
        if optimizers:
            _fill(local_optim, optim_state_dict, "optimizer", options.strict, source)
        model_state_dict, optim_state_dict, options = local_model, local_optim, sharded
    if not optimizers:
        return dsd.set_model_state_dict(model, model_state_dict, options=options)
    return dsd.set_state_dict(
        model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict, options=options
    )


def _storage(t: torch.Tensor) -> int:
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()._cdata


def _live_tensors(model: nn.Module, optimizers) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    for opt in optimizers:
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _copy_if_in(obj: Any, live: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone() if _storage(obj) in live else obj
    if isinstance(obj, dict):
        return {k: _copy_if_in(v, live) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_if_in(v, live) for v in obj]
    return obj


class _TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _optimizers(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers or ())


class _Source(NamedTuple):
    """Where the full state dict comes from: every rank's own (``broadcast`` False), or rank 0
    of ``group`` (None: the default group) via ``broadcast_``; ``device`` stages the tensors."""

    broadcast: bool
    group: Any
    is_src: bool
    device: torch.device

    @staticmethod
    def of(model: nn.Module, broadcast: bool) -> "_Source":
        for p in model.parameters():
            if isinstance(p, DTensor) and p.device_mesh.ndim == 1:
                mesh = p.device_mesh
                is_src = not broadcast or mesh.get_local_rank(0) == 0
                # the mesh's device: under CPU offload the shards are on the host, but the
                # broadcast runs on the mesh's backend
                return _Source(broadcast, mesh.get_group(0), is_src, mesh_device(mesh))
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        is_src = not broadcast or torch.distributed.get_rank() == 0
        return _Source(broadcast, None, is_src, device)


def _leaves(obj: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    """Every leaf of nested dicts and lists, by path."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return {prefix: obj}
    out: dict[tuple, Any] = {}
    for key, value in items:
        out.update(_leaves(value, prefix + (key,)))
    return out


def _set(obj: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


@torch.no_grad()
def _fill(local: dict, full: dict, what: str, strict: bool, source: _Source) -> None:
    """Copy ``full`` into ``local``, a sharded state dict of live tensors: each DTensor gets its
    own rows, every other leaf the whole value. Every key and shape is checked (on every rank
    alike: the source broadcasts the structure first) before any tensor is sent or copied."""
    fulls = _leaves(full) if source.is_src else {}
    header = {p: _TensorInfo(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for p, v in fulls.items()}
    if source.broadcast:
        header = broadcast_object(header, source.group, 0, source.device)
    todo = []
    for path, leaf in _leaves(local).items():
        name = ".".join(map(str, path))
        if path not in header:
            if strict:
                raise CheckpointError(f"{what} state dict key {name!r} is missing from the full state dict")
            continue
        info = header[path]
        if not isinstance(info, _TensorInfo):
            _set(local, path, info)
        elif isinstance(leaf, torch.Tensor) and tuple(leaf.shape) == info.shape:
            todo.append((path, leaf, info))
        else:
            have = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise CheckpointError(f"{what} state dict key {name!r}: {info.shape} in the full state dict, {have} here")
    for path, leaf, info in todo:
        if not source.broadcast:
            value = fulls[path].detach().to(device=source.device)
        else:  # one full tensor at a time, from the source rank
            if source.is_src:
                value = fulls[path].detach().to(device=source.device, copy=True).contiguous()
            else:
                value = torch.empty(info.shape, dtype=info.dtype, device=source.device)
            broadcast_(value, source.group, 0)
        _copy_rows(leaf, value)


def _copy_rows(leaf: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(leaf, DTensor):
        local = leaf._local_tensor
        if leaf.dim() == 0:
            local.copy_(value)
        elif any(isinstance(p, _StridedShard) for p in leaf.placements):  # FSDP x TP (fsdp.compose.tensor_parallel)
            # DTensor's own split of the full value, on this rank alone (no communication)
            local.copy_(distribute_tensor(value, leaf.device_mesh, leaf.placements, src_data_rank=None)._local_tensor)
        elif any(isinstance(p, Shard) and p.dim != 0 for p in leaf.placements):
            local.copy_(_chunk_piece(leaf, value))  # a plain DTensor (shard_placement_fn's)
        elif isinstance(leaf, ElementShardedDTensor):  # a ragged layout's piece: elements, 1-D
            e0, e1 = leaf.element_range
            local.copy_(value.reshape(-1)[e0:e1])
        else:
            r0, r1 = row_range(leaf)
            local.copy_(value[r0:r1].reshape(local.shape))
    else:
        leaf.copy_(value)


def _chunk_piece(leaf: DTensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``value`` under a plain DTensor's placements: torch.chunk's, nested
    over the mesh axes."""
    mesh, coordinate = leaf.device_mesh, leaf.device_mesh.get_coordinate()
    for axis, placement in enumerate(leaf.placements):
        if isinstance(placement, Shard):
            length = value.shape[placement.dim]
            chunk = -(-length // mesh.shape[axis])
            start = min(coordinate[axis] * chunk, length)
            value = value.narrow(placement.dim, start, min(start + chunk, length) - start)
    return value
