"""What a checkpoint directory holds: file names, :class:`CheckpointError`, CRC32 of a file."""

from __future__ import annotations

import zlib

PARTIAL, OLD = ".partial", ".old"
METADATA, CHECKSUMS = ".metadata", ".checksums"
_CHUNK = 16 << 20


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
