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
  :func:`set_state_dict` of this module: it takes the same options, ``broadcast_from_rank0=True``
  included (only rank 0 of the model's mesh needs the dict), checks every key and shape on every
  rank before any tensor is sent, and copies each rank's rows straight into the live parameters
  and optimizer state, one full tensor at a time. torch's own loaders
  (``set_model_state_dict`` / ``set_optimizer_state_dict`` / ``set_state_dict`` with
  ``full_state_dict=True``, what accelerate and Lightning call) load every layout exactly too:
  they cut each tensor where ``torch.chunk`` would, and :mod:`dbuffer.full_load` (installed when
  dbuffer is imported) has them give the flat layouts' tensors their own rows or elements instead,
  keeping the optimizer state in its parameter's pieces.

Safety of :func:`save` and :func:`load`:

* ``save(state, path)`` writes into ``<path>.partial``. Only after every rank has written its
  files does rank 0 (DCP's coordinator, inside DCP's own final step, so no extra collective)
  write ``.metadata``, then ``.checksums`` (the size and CRC32 of every other file, ``.metadata``
  included, and a CRC32 of its own content: :mod:`fsdp.checkpoint.files`), then rename the
  directory to ``path``; a previous checkpoint at ``path`` is set aside as ``<path>.old`` for the
  two renames and then removed. A crash at any point leaves ``path`` holding either the previous
  checkpoint or the new one (:func:`load` falls back to ``<path>.old`` if the crash hit between
  the renames).
* A save never moves, overwrites or deletes anything but checkpoint files: before anything is
  touched (and before DCP's first collective) rank 0 checks that ``path`` is absent, an empty
  directory or a complete checkpoint, and that ``<path>.partial`` and ``<path>.old`` (names a
  save reserves) hold nothing but files a save writes; a file, a symbolic link or a directory of
  other files raises :class:`CheckpointError` naming it and the fix. The decision is broadcast
  (one small collective), so every rank raises alike or none does.
* ``load(state, path)`` verifies before it reads: rank 0 checks ``.checksums`` (its own CRC32),
  then ``.metadata`` against it, before anything is unpickled, and sends the verdict and the
  verified metadata to every rank (one small collective); then, while DCP is still planning,
  each rank checks the size and CRC32 of every data file it will read. A missing, truncated,
  damaged or foreign file, a missing ``.checksums`` included, raises :class:`CheckpointError`
  naming it, the same error on every rank, before any rank has copied anything into ``state``:
  the model and optimizer a failed load was given are left exactly as they were. So does a
  missing key or a wrong shape (naming the key, with both shapes).
* A checkpoint written by plain ``dcp.save`` or FSDP2 has no ``.checksums``: it loads with
  ``load(state, path, allow_unverified=True)``, unverified (a warning says so). So does one
  written by an earlier version of this module, whose ``.checksums`` does not cover
  ``.metadata`` (its data files are still verified). Damage to an unverified file may then show
  as any error, after some tensors were copied.

``get_state_dict(model, opt)`` of an optimizer that has never stepped is torch's: torch creates
the optimizer's state with one step at learning rate 0 (AdamW: step 1, zero moments), and the
next real step is then its second. Build the state dict only to save or to load one, never
"in case" before a fresh start (README, Checkpoints).
"""

from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdp.checkpoint.atomic import load, save
from fsdp.checkpoint.files import OLD, PARTIAL, CheckpointError  # noqa: F401  (the suffixes a save reserves)
from fsdp.checkpoint.full import get_state_dict, set_state_dict

__all__ = ["CheckpointError", "StateDictOptions", "get_state_dict", "load", "save", "set_state_dict"]
