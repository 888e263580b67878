"""Checkpoints of fsdp modules with torch.distributed.checkpoint (DCP).

torch's ``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` already work on
fsdp modules: parameters and optimizer state are DTensors whose DCP hooks describe the exact
pieces each rank holds, so a checkpoint saved at one world size, strategy and layout loads at any
other. This package adds what torch lacks: :func:`save` / :func:`load` that never leave a
half-written checkpoint and never load a damaged one, and a :func:`set_state_dict` for full state
dicts that checks every key and shape on every rank before any tensor moves (torch's own full
loaders also load every layout exactly: :mod:`dbuffer.full_load`). User guide: fsdp/README.md,
"Checkpoints".

How :func:`save` stays atomic: it writes into ``<path>.partial``; after every rank has written,
rank 0 (inside DCP's own final step, so no extra collective) checks that it sees every rank's
file (the ranks must share one file system), writes ``.metadata``, then ``.checksums`` (size and
CRC32 of every other file, and a CRC32 of its own content: :mod:`fsdp.checkpoint.files`), fsyncs
the directory, then renames it to ``path``, a previous checkpoint there set aside as
``<path>.old`` for the two renames, and fsyncs the parent before deleting ``<path>.old``. A crash
or a power cut leaves ``path`` holding the previous checkpoint or the new one, complete
(:func:`load` falls back to ``<path>.old`` between the renames). Before anything is touched, rank 0 checks that ``path``, ``<path>.partial`` and
``<path>.old`` hold nothing but checkpoint files and broadcasts the verdict, so every rank raises
:class:`CheckpointError` alike or none does.

How :func:`load` verifies before it reads: rank 0 checks ``.checksums`` and ``.metadata`` before
anything is unpickled and sends the verdict and the verified metadata to every rank; then, while
DCP is still planning, each rank checks the files it will read. Any problem (a missing,
truncated, damaged or foreign file, a missing key, a wrong shape) raises the same
:class:`CheckpointError` on every rank before anything is copied into ``state``.

What :func:`load` never does, whoever wrote the checkpoint: run code it names (``.metadata`` is
unpickled admitting only DCP's classes, non-tensor entries with ``torch.load(weights_only=True)``:
:mod:`fsdp.checkpoint.unpickler`), or read a file outside its directory (every file ``.metadata``
names is a plain name of a regular file there). ``trust_pickled_objects=True`` lifts the first
for a checkpoint the user trusts.
"""

from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp.checkpoint.atomic import load, save
from fsdp.checkpoint.files import OLD, PARTIAL, CheckpointError  # noqa: F401  (the suffixes a save reserves)
from fsdp.checkpoint.full import get_state_dict, set_state_dict

__all__ = ["CheckpointError", "StateDictOptions", "get_state_dict", "load", "save", "set_state_dict"]
