"""torch's full-state-dict loaders, exact for DTensors whose pieces are not ``torch.chunk``'s.

``torch.distributed.checkpoint.state_dict.set_model_state_dict`` / ``set_optimizer_state_dict`` /
``set_state_dict`` with ``StateDictOptions(full_state_dict=True)`` are how Hugging Face
accelerate and Lightning Fabric load a full checkpoint into FSDP2-style DTensors. They cut each
full tensor where DTensor's placements say, i.e. where ``torch.chunk`` would:

* with ``broadcast_from_rank0=True``, torch's ``_distribute_tensors`` copies
  ``full[chunk offsets]`` straight into ``dtensor.to_local()``. A
  :class:`~dbuffer.row_sharded.RowShardedDTensor` (a row-atomic or Owned DBuffer's rows) or an
  :class:`~dbuffer.element_sharded.ElementShardedDTensor` (a ragged DBuffer's elements) holds
  other rows, or a 1-D run of elements, so that copy fails ("The size of tensor a (64) must match
  the size of tensor b (32)") on some ranks and, where only the offsets differ, succeeds with the
  wrong rows on others. No op of the DTensor itself runs there (``to_local()`` under ``no_grad``
  is the local tensor), so its ``__torch_dispatch__`` cannot correct it.
* without it, torch's ``_distribute_state_dict`` builds a plain DTensor with ``distribute_tensor``
  (``torch.chunk`` pieces of rank 0's value). The model's ``load_state_dict`` then copies it into
  the parameter, which the subclasses' dispatch does exactly (a gather of the source); but the
  optimizer's ``load_state_dict`` *keeps* those tensors as its state, in another layout than the
  parameters, so every later step would run on gathered full tensors.

:func:`install` (run when :mod:`dbuffer` is imported) wraps those two torch functions. For a
non-meta :class:`~dbuffer.pieces.PieceShardedDTensor` they do the same thing as torch's, in the
DTensor's own pieces: the broadcast path copies this rank's exact piece of the full tensor into
its local tensor (no communication: every rank holds the broadcast full tensor); the other path
runs torch's own code (so the values are rank 0's, as torch's are) and copies its result into a
new tensor with the state's pieces. Every other value goes to torch's functions unchanged, so
plain DTensors (FSDP2's, tensor parallelism's) load exactly as without dbuffer. Meta DTensors
also go to torch: it builds plain DTensors for ``load_state_dict(assign=True)``, which fsdp
adopts at the first forward. If a torch release renames or reshapes these private functions,
nothing is wrapped (:data:`INSTALLED` says so and a test fails); ``fsdp.checkpoint.set_state_dict``
does not depend on them. :func:`uninstall` puts torch's own functions back (then these loaders
cut every DTensor where ``torch.chunk`` would again); :func:`install` wraps them again.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor, Partial

from dbuffer.pieces import PieceShardedDTensor

__all__ = ["INSTALLED", "install", "uninstall"]

INSTALLED = False
_EXPECTED = {
    "_distribute_tensors": ["local_state_dict", "keys", "device", "pg"],
    "_distribute_state_dict": ["full_state_dict", "local_state_dict", "device", "pg"],
}


def _ours(t: Any) -> bool:
    """A DTensor whose pieces only dbuffer knows, loadable in place (not meta, not Partial)."""
    return (
        isinstance(t, PieceShardedDTensor)
        and not t.is_meta
        and not any(isinstance(p, Partial) for p in t.placements)
    )


def _wrap_distribute_tensors(original: Callable) -> Callable:
    @functools.wraps(original)
    def _distribute_tensors(local_state_dict: dict, keys: list, device: torch.device, pg: Any = None) -> None:
        rest = []
        for key in keys:
            entry = local_state_dict.get(key)
            if not (isinstance(entry, tuple) and len(entry) == 2 and _ours(entry[0])):
                rest.append(key)
                continue
            target, full = entry
            if tuple(full.shape) != tuple(target.shape):  # the same on every rank: shapes were broadcast
                raise ValueError(
                    f"full state dict key {key!r}: a tensor of shape {tuple(full.shape)}, but the "
                    f"DTensor it loads into has shape {tuple(target.shape)}"
                )
            with torch.no_grad():
                local = target._local_tensor
                local.copy_(target.piece_of(full).reshape(local.shape))
            local_state_dict[key] = target
        original(local_state_dict, rest, device, pg)

    _distribute_tensors._dbuffer_full_load = True  # type: ignore[attr-defined]
    return _distribute_tensors


def _wrap_distribute_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def _distribute_state_dict(full: dict, local_state_dict: dict, device: torch.device, pg: Any = None) -> None:
        pieces = {
            key: t
            for key, t in local_state_dict.items()
            if _ours(t)
            and isinstance(full.get(key), torch.Tensor)
            and tuple(full[key].shape) == tuple(t.shape)
        }
        original(full, local_state_dict, device, pg)
        for key, t in pieces.items():
            loaded = local_state_dict.get(key)
            if isinstance(loaded, DTensor) and loaded is not t:
                # torch's value (rank 0's, torch.chunk pieces), in the state's own pieces
                with torch.no_grad():
                    local_state_dict[key] = torch.empty_like(t, dtype=loaded.dtype).copy_(loaded)

    _distribute_state_dict._dbuffer_full_load = True  # type: ignore[attr-defined]
    return _distribute_state_dict


def install() -> bool:
    """Wrap torch's full-state-dict loaders (once; idempotent). Returns whether they are wrapped:
    False, and torch left as it is, if this torch's private functions are not the expected ones."""
    global INSTALLED
    if INSTALLED:
        return True
    try:
        import torch.distributed._state_dict_utils as utils
        import torch.distributed.checkpoint.state_dict as sd
    except ImportError:  # a torch without torch.distributed
        return False
    if getattr(utils._distribute_tensors, "_dbuffer_full_load", False):  # wrapped before (a reload)
        INSTALLED = True
        return True
    for name, params in _EXPECTED.items():
        fn = getattr(utils, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != params:
            return False
    if getattr(sd, "_distribute_state_dict", None) is not utils._distribute_state_dict:
        return False
    utils._distribute_tensors = _wrap_distribute_tensors(utils._distribute_tensors)
    wrapped = _wrap_distribute_state_dict(utils._distribute_state_dict)
    utils._distribute_state_dict = wrapped
    sd._distribute_state_dict = wrapped
    INSTALLED = True
    return True


def uninstall() -> bool:
    """Put torch's own full-state-dict loaders back (idempotent), for a program that wants torch
    untouched: afterwards those loaders cut row- or element-sharded DTensors where ``torch.chunk``
    would, as without dbuffer. Returns whether anything was unwrapped."""
    global INSTALLED
    try:
        import torch.distributed._state_dict_utils as utils
        import torch.distributed.checkpoint.state_dict as sd
    except ImportError:
        return False
    unwrapped = False
    if getattr(utils._distribute_tensors, "_dbuffer_full_load", False):
        utils._distribute_tensors = utils._distribute_tensors.__wrapped__
        unwrapped = True
    wrapped = utils._distribute_state_dict
    if getattr(wrapped, "_dbuffer_full_load", False):
        utils._distribute_state_dict = wrapped.__wrapped__
        if sd._distribute_state_dict is wrapped:
            sd._distribute_state_dict = wrapped.__wrapped__
        unwrapped = True
    INSTALLED = False
    return unwrapped
