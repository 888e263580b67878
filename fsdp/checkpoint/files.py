"""What a checkpoint directory holds, and its verification before DCP reads any of it.

A save (:mod:`fsdp.checkpoint.atomic`) writes DCP's data files and ``.metadata`` (a pickle), then
``.checksums``: every other file's size and CRC32 as JSON, then a line ``crc32 <8 hex digits>``
covering everything above it. :func:`inspect` (rank 0) checks ``.checksums``, then ``.metadata``
against it before unpickling; each rank checks its data files (:func:`check_file`) while DCP plans.
A checksum does not prove who wrote a file, so ``.metadata`` is also unpickled admitting only DCP's
classes (:mod:`.unpickler`), and may name only regular files of its own directory, by plain name.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from typing import NamedTuple, Optional, Union

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from fsdp.checkpoint.unpickler import Refused, read_metadata

PARTIAL, OLD = ".partial", ".old"
METADATA, CHECKSUMS = ".metadata", ".checksums"
FORMAT = "fsdp.checkpoint checksums 2"
_TRAILER = re.compile(rb"(.*)\ncrc32 ([0-9a-f]{8})\n", re.S)
_CHUNK = 16 << 20
_RESTORE = "restore it from a copy or load an earlier checkpoint"

Sums = dict[str, tuple[int, int]]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message names the key or the file."""


def crc32(path: str) -> tuple[int, int]:
    """(size in bytes, CRC32) of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def write_checksums(directory: str, sums: Sums) -> None:
    """Write ``<directory>/.checksums`` (fsynced) for ``sums``, which must cover ``.metadata``."""
    lines = [f"{json.dumps(name)}: [{size}, {crc}]" for name, (size, crc) in sorted(sums.items())]
    body = ('{"format": %s, "files": {\n%s\n}}' % (json.dumps(FORMAT), ",\n".join(lines))).encode()
    with open(os.path.join(directory, CHECKSUMS), "wb") as f:
        f.write(body + b"\ncrc32 %08x\n" % zlib.crc32(body))
        f.flush()
        os.fsync(f.fileno())


class _Legacy(NamedTuple):
    """``.checksums`` of an earlier fsdp.checkpoint: data files only, no CRC of its own."""

    sums: Sums


def _parse_checksums(content: bytes) -> Union[Sums, _Legacy, str]:
    """The files' sums, an earlier version's sums, or why ``content`` is damaged."""
    match = _TRAILER.fullmatch(content)
    if match is None:
        try:  # the format before .metadata had a checksum: {"crc32": {name: [size, crc]}}
            legacy = json.loads(content)
            if isinstance(legacy, dict) and set(legacy) == {"crc32"} and _valid(legacy["crc32"]):
                return _Legacy({k: tuple(v) for k, v in legacy["crc32"].items()})
        except ValueError:
            pass
        return "it does not end in its own CRC32 line: truncated or overwritten?"
    body, want = match.group(1), int(match.group(2), 16)
    if zlib.crc32(body) != want:
        return f"its content's CRC32 is {zlib.crc32(body):#010x}, its last line says {want:#010x}"
    try:
        parsed = json.loads(body)
    except ValueError as exc:  # a CRC-consistent file that is not JSON: not written by a save
        return f"it is not JSON ({exc})"
    if not (isinstance(parsed, dict) and parsed.get("format") == FORMAT and _valid(parsed.get("files"))):
        return f"it is not in the format {FORMAT!r}"
    if METADATA not in parsed["files"]:
        return f"it has no checksum of {METADATA}"
    return {k: tuple(v) for k, v in parsed["files"].items()}


def _valid(files) -> bool:
    return isinstance(files, dict) and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2 and all(type(x) is int and x >= 0 for x in v)
        for k, v in files.items()
    )


def mismatch(file: str, have: tuple[int, int], want: tuple[int, int], what: str = "checkpoint file") -> Optional[str]:
    """Why ``file`` with (size, CRC32) ``have`` is not the one written (``want``), or None."""
    (size, crc), (want_size, want_crc) = have, want
    if size != want_size:
        how = "truncated" if size < want_size else "grown"
        return f"{what} {file} is {size} bytes, {want_size} were written ({how}); {_RESTORE}"
    if crc != want_crc:
        return f"{what} {file} is corrupted: CRC32 {crc:#010x}, {want_crc:#010x} written; {_RESTORE}"
    return None


def check_file(directory: str, name: str, sums: Optional[Sums]) -> None:
    """Raise :class:`CheckpointError` unless data file ``name`` exists and matches any ``sums``."""
    file = os.path.join(directory, name)
    try:
        mode = os.lstat(file).st_mode
    except OSError:
        raise CheckpointError(f"checkpoint file {file} is missing; {_RESTORE}") from None
    if not stat.S_ISREG(mode):  # a link could point into another checkpoint
        raise CheckpointError(f"checkpoint file {file} is not a regular file: no save writes one; {_RESTORE}")
    if sums is None:
        return
    if name not in sums:
        raise CheckpointError(f"checkpoint file {file} has no checksum in {CHECKSUMS}: not written by this save")
    problem = mismatch(file, crc32(file), sums[name])
    if problem is not None:
        raise CheckpointError(problem)


class Verified(NamedTuple):
    """What every rank loads: a checkpoint that passed its checks (or ``allow_unverified``)."""

    path: str
    sums: Optional[Sums]  # the data files' (size, CRC32); None: unverified
    metadata: Metadata
    notes: tuple[str, ...]  # warnings every rank gives


def inspect(path: str, allow_unverified: bool, trust_pickled_objects: bool = False) -> Union[Verified, str]:
    """Rank 0's verdict on ``path``: :class:`Verified` or an error; never raises (ranks wait)."""
    try:
        return _inspect(path, allow_unverified, trust_pickled_objects)
    except CheckpointError as exc:
        return str(exc)
    except Exception as exc:
        return f"checkpoint {path} cannot be inspected: {type(exc).__name__}: {exc}"


def _inspect(path: str, allow_unverified: bool, trust_pickled_objects: bool) -> Verified:
    directory, notes = _resolve(path)
    sums_file, md_file = os.path.join(directory, CHECKSUMS), os.path.join(directory, METADATA)
    opt_in = "pass allow_unverified=True to load it"
    md_sum: Optional[tuple[int, int]] = None  # .metadata's (size, CRC32), where .checksums has it
    if not os.path.lexists(sums_file):
        if not allow_unverified:
            raise CheckpointError(
                f"checkpoint {directory} cannot be verified: {sums_file} is missing. Every checkpoint "
                f"fsdp.checkpoint.save writes has one, so this one is damaged or was written by something "
                f"else: restore the file, load an earlier checkpoint, or, for a checkpoint written by plain "
                f"dcp.save or FSDP2, {opt_in} unverified"
            )
        sums: Optional[Sums] = None
        notes += (f"loading {directory} unverified: it has no {CHECKSUMS} (allow_unverified=True)",)
    else:
        with open(sums_file, "rb") as f:
            parsed = _parse_checksums(f.read())
        if isinstance(parsed, str):
            raise CheckpointError(f"checksum file {sums_file} is damaged: {parsed}; {_RESTORE}")
        if isinstance(parsed, _Legacy):
            if not allow_unverified:
                raise CheckpointError(
                    f"checksum file {sums_file} was written by an earlier fsdp.checkpoint and does not "
                    f"cover {md_file}: {opt_in} (its data files are still verified), then save it again"
                )
            sums = parsed.sums
            notes += (f"loading {directory} with {METADATA} unverified: its {CHECKSUMS} predates its checksum",)
        else:
            sums = dict(parsed)
            md_sum = sums.pop(METADATA)
    with open(md_file, "rb") as f:
        content = f.read()
    if md_sum is not None:  # before anything unpickles it
        problem = mismatch(md_file, (len(content), zlib.crc32(content)), md_sum, "checkpoint metadata file")
        if problem is not None:
            raise CheckpointError(problem)
    try:
        metadata = read_metadata(content, trust_pickled_objects)
    except Refused as exc:
        raise CheckpointError(
            f"checkpoint metadata file {md_file} names {exc.what}, which DCP never writes there: refusing "
            f"to unpickle it (unpickling runs what a pickle names). A checkpoint written by fsdp.checkpoint.save "
            f"or dcp.save never holds it; load it with trust_pickled_objects=True only if you trust whoever "
            f"wrote the file"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint metadata file {md_file} cannot be read: {exc!r}; {_RESTORE}") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"checkpoint metadata file {md_file} holds no DCP metadata; {_RESTORE}")
    _check_names(directory, md_file, metadata.storage_data, sums)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return Verified(directory, sums, metadata, notes)


def _check_names(directory: str, md_file: str, storage_data: dict, sums: Optional[Sums]) -> None:
    """Every file ``.metadata`` names is a plain name of a regular file in ``directory`` (and of
    ``.checksums`` when verified): a load reads nothing outside the checkpoint."""
    names = set()
    for index, info in storage_data.items():
        name = getattr(info, "relative_path", None)
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo) and isinstance(name, str)):
            raise CheckpointError(f"checkpoint metadata file {md_file} holds no DCP file-system metadata; {_RESTORE}")
        names.add(name)
    for name in sorted(names):
        if name in ("", ".", "..") or os.path.basename(name) != name or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointError(
                f"checkpoint metadata file {md_file} names the data file {name!r}, which is not a plain file name "
                f"in {directory}: a checkpoint reads only its own files (a crafted or damaged .metadata); {_RESTORE}"
            )
        if sums is not None and name not in sums:
            raise CheckpointError(
                f"checkpoint metadata file {md_file} names the data file {name!r}, which {CHECKSUMS} does not list: "
                f"not written by this save; {_RESTORE}"
            )
        check_file(directory, name, None)


def _resolve(path: str) -> tuple[str, tuple[str, ...]]:
    """The directory to load (``path``, or a mid-publish save's ``<path>.old``) and a warning."""
    if os.path.exists(os.path.join(path, METADATA)):
        return path, ()
    if os.path.exists(os.path.join(path + OLD, METADATA)):
        return path + OLD, (f"{path} is missing; loading {path + OLD}, which a save interrupted mid-publish left behind",)
    hint = f" ({path + PARTIAL} is an interrupted save and is never loaded)" if os.path.exists(path + PARTIAL) else ""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is not a complete checkpoint: {os.path.join(path, METADATA)} is missing{hint}")
    raise CheckpointError(f"no checkpoint at {path}{hint}")
