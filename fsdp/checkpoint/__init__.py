"""Checkpoints of fsdp modules with torch.distributed.checkpoint (DCP).

torch's ``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` already work on
fsdp's DTensors at any world size, strategy and layout; this package adds :func:`save` /
:func:`load`, never leaving a half-written checkpoint nor loading a damaged one, and a
:func:`set_state_dict` checking full state dicts on every rank first (guide: fsdp/README.md).

:func:`save` writes ``<path>.partial``; then rank 0, in DCP's final step (no extra collective),
checks it sees every rank's file (one shared file system), writes ``.metadata`` and ``.checksums``
(:mod:`fsdp.checkpoint.files`), fsyncs and renames it to ``path``, keeping a previous checkpoint
as ``<path>.old`` until the parent is fsynced: a crash leaves the old checkpoint or the new one
(:func:`load` falls back to ``<path>.old``). Rank 0 first checks that the three paths hold only
checkpoint files, so every rank raises :class:`CheckpointError` alike or none does.
"""

from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp.checkpoint.atomic import load, save
from fsdp.checkpoint.files import OLD, PARTIAL, CheckpointError  # noqa: F401  (the suffixes a save reserves)
from fsdp.checkpoint.full import get_state_dict, set_state_dict

__all__ = ["CheckpointError", "StateDictOptions", "get_state_dict", "load", "save", "set_state_dict"]
