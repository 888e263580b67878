"""State dicts of fsdp modules: torch's ``get_state_dict`` (full ones always copies) and a
``set_state_dict`` that also loads full state dicts into fsdp's layouts (:mod:`fsdp.checkpoint`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, NamedTuple, Optional, Union

import torch
import torch.distributed.checkpoint.state_dict as dsd
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dbuffer import mesh_device
from dbuffer.dtensor import ElementShardedDTensor, broadcast_, broadcast_object, row_range
from fsdp.checkpoint.files import CheckpointError

__all__ = ["get_state_dict", "set_state_dict"]

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


def get_state_dict(
    model: nn.Module, optimizers: Optimizers = (), *, options: Optional[StateDictOptions] = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's ``get_state_dict`` (``optimizers`` may be empty: the second dict is then empty).

    Sharded by default: views of the live tensors. With ``options.full_state_dict``, always copies:
    torch returns live tensors where nothing is sharded, so an export would change with training.
    """
    optimizers = _optimizers(optimizers)
    out = dsd.get_state_dict(model, optimizers, options=options) if optimizers else (dsd.get_model_state_dict(model, options=options), {})
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
    """torch's ``set_state_dict``, with full state dicts checked before anything moves.

    Full dicts come from every rank, or with ``broadcast_from_rank0`` from rank 0, one tensor at a
    time; each rank copies its rows into the live state. A missing key (``strict``) or a differing
    shape raises :class:`CheckpointError` on every rank first, not part-way as torch's loaders.
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
    return [_copy_if_in(v, live) for v in obj] if isinstance(obj, list) else obj


class _TensorInfo(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _optimizers(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers or ())


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
                # the mesh's device: shards may be offloaded, the broadcast runs on the backend's
                return _Source(broadcast, mesh.get_group(0), is_src, mesh_device(mesh))
        # an HSDP mesh: the default group broadcasts, on the mesh's device (not the host's shards)
        device = next((mesh_device(p.device_mesh) if isinstance(p, DTensor) else p.device
                       for p in model.parameters()), torch.device("cpu"))
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
    """Copy ``full`` into ``local`` (live tensors): a DTensor its rows, other leaves the value;
    every key and shape checked on every rank (the source broadcasts the structure) first."""
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
        elif any(isinstance(p, _StridedShard) for p in leaf.placements):
            # FSDP x TP: DTensor's own split of the value, on this rank alone (no communication)
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
    """This rank's piece of ``value`` under a plain DTensor's placements (nested torch.chunk)."""
    mesh, coordinate = leaf.device_mesh, leaf.device_mesh.get_coordinate()
    for axis, placement in enumerate(leaf.placements):
        if isinstance(placement, Shard):
            length = value.shape[placement.dim]
            chunk = -(-length // mesh.shape[axis])
            start = min(coordinate[axis] * chunk, length)
            value = value.narrow(placement.dim, start, min(start + chunk, length) - start)
    return value
