"""Reading a checkpoint's pickles without running anything they name.

DCP's ``.metadata`` is a pickle, and each non-tensor state-dict entry a ``torch.save`` blob torch
reads with ``weights_only=False``: either, written by someone else, could run code when read (a
checksum proves only that it was not damaged). :func:`read_metadata` (pure Python: the file is
small) admits only what DCP writes there in torch 2.11 to 2.15 (``_ADMITTED``, the dtypes),
refusing anything else by name before importing it; it sets state only on those dataclasses, in
their fields (``BUILD`` could set a class's or shared enum's attributes), and refuses persistent
ids and copyreg extensions. :func:`read_object` uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
from typing import Any, BinaryIO

import torch

__all__ = ["Refused", "read_metadata", "read_object"]

_DCP = "torch.distributed.checkpoint.metadata"
_SHARD = "torch.distributed._shard.sharded_tensor.metadata"  # where torch < 2.4 kept TensorProperties
_PATHS = ("PurePosixPath", "PureWindowsPath", "PosixPath", "WindowsPath")

# (module, name) a .metadata may name -> (module to import, attribute): nothing else is imported
_ADMITTED: dict[tuple[str, str], tuple[str, str]] = {
    **{(_DCP, n): (_DCP, n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    (_SHARD, "TensorProperties"): (_SHARD, "TensorProperties"),
    (_SHARD, "MEM_FORMAT_ENCODING"): (_SHARD, "MEM_FORMAT_ENCODING"),
    ("torch", "Size"): ("torch", "Size"),
    ("torch.serialization", "_get_layout"): ("torch.serialization", "_get_layout"),
    # Python 3.13 defines the path classes in pathlib._local: the same classes
    **{(m, n): ("pathlib", n) for m in ("pathlib", "pathlib._local") for n in _PATHS},
}
_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class Refused(pickle.UnpicklingError):
    """A pickle names something a checkpoint never needs; ``what`` says what (``os.system``)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its opcodes can be replaced
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self.classes: set[type] = set()  # the dataclasses this file named

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        target = _ADMITTED.get((module, name))
        if target is None:
            raise Refused(f"{module}.{name}")
        obj = getattr(importlib.import_module(target[0]), target[1])
        if dataclasses.is_dataclass(obj):
            self.classes.add(obj)
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("a persistent id")

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if cls not in self.classes:  # a class, an enum member, a dtype: shared by the whole process
            raise Refused(f"state set on a {cls.__module__}.{cls.__qualname__}")
        if "__setstate__" in vars(cls):  # TensorProperties: a tuple of its fields
            inst.__setstate__(state)
            return
        fields = {f.name for f in dataclasses.fields(cls)}
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            raise Refused(f"state of a {cls.__qualname__} that is not its fields")
        inst.__dict__.update(state)

    def load_ext(self) -> None:
        raise Refused("a copyreg extension")

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.EXT1[0]] = dispatch[pickle.EXT2[0]] = dispatch[pickle.EXT4[0]] = load_ext


def read_metadata(content: bytes, trusted: bool) -> Any:
    """The object pickled in ``content`` (DCP's ``.metadata``). Raises :class:`Refused` naming the
    first thing DCP never writes there (unless ``trusted``), or an unreadable pickle's error."""
    if trusted:
        return pickle.loads(content)
    return _MetadataUnpickler(io.BytesIO(content)).load()


def read_object(stream: BinaryIO, trusted: bool) -> Any:
    """A ``torch.save`` blob read with ``weights_only=True`` (plain pickle if ``trusted``). Raises
    :class:`Refused` naming the globals ``weights_only`` does not admit."""
    if trusted:
        return torch.load(stream, map_location="cpu", weights_only=False)
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            stream.seek(0)
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
        except Exception:
            unsafe = []
        raise Refused(", ".join(unsafe) if unsafe else str(exc).splitlines()[0]) from exc
