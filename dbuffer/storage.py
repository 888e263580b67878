"""The lifetime of a DBuffer's local storage: the :class:`StorageLifetime` mixin of
:class:`~dbuffer.buffer.DBuffer`.

:meth:`~StorageLifetime.release_storage` frees the local buffer's storage while its views stay
valid objects; :meth:`~StorageLifetime.reallocate_storage` gives it back, and the first
primitive that writes it refills it without bumping autograd's version counter. Async
collectives that read or write the buffer are tracked until waited for, so that a release never
frees memory a collective still touches.

A mixin rather than functions: these are DBuffer's public methods and act on the buffer's own
state (its storage, its capacity, the collectives in flight on it).
"""

from __future__ import annotations

import contextlib

import torch

from dbuffer.collectives import Pending

__all__ = ["StorageLifetime"]

_NO_REFILL = contextlib.nullcontext()  # stateless: shared by every write that refills nothing


class StorageLifetime:
    """Mixin of :class:`~dbuffer.buffer.DBuffer`: release and reallocation of its local storage
    (see the module docstring). The attributes below are set by :meth:`_hold`, which DBuffer's
    constructors call."""

    local_buffer: torch.Tensor
    _capacity_bytes: int  # the storage's size when allocated
    _refill_pending: bool  # reallocated: the next write is a refill, not a modification
    _owns_storage: bool  # the local buffer is its whole storage, which release may free

    def _hold(self, local_buffer: torch.Tensor) -> None:
        """Make ``local_buffer`` this buffer's, deciding once whether it owns its storage (a view
        of a larger one, from ``scatter()`` or a user's ``local_buffer``, does not)."""
        self.local_buffer = local_buffer
        self._refill_pending = False
        self._capacity_bytes = local_buffer.untyped_storage().nbytes()
        self._owns_storage = (
            local_buffer.storage_offset() == 0
            and self._capacity_bytes == local_buffer.numel() * local_buffer.element_size()
        )

    def release_storage(self) -> None:
        """Free the local storage. Views (``get_local_tensor``, parameters, tensors autograd saved)
        stay valid objects and see the storage again after :meth:`reallocate_storage`; their
        values are undefined until something writes the buffer again.

        A collective started with ``async_op=True`` that still reads this buffer (its source) or
        writes it (its ``out``) is waited for first, so that it never touches freed memory; its
        handle's ``wait()`` then returns at once."""
        if not self._owns_storage:
            self._refuse_shared_storage("release_storage")
        in_flight = self.__dict__.pop("_in_flight", None)
        for pending in in_flight or ():
            pending.wait()
        self.local_buffer.untyped_storage().resize_(0)

    def _track(self, pending: Pending) -> None:
        """Remember an async collective that reads or writes this buffer until it is waited for."""
        self.__dict__.setdefault("_in_flight", []).append(pending)

    def _untrack(self, pending: Pending) -> None:
        in_flight = self.__dict__.get("_in_flight")
        if in_flight and pending in in_flight:
            in_flight.remove(pending)

    def reallocate_storage(self) -> None:
        """Give the local buffer its storage back (uninitialised); a no-op if it has it.

        The first primitive that then writes into this buffer (as ``out=``) refills it without
        bumping autograd's version counter, so tensors saved for backward before the release
        stay usable: the refill restores data, it is not an in-place modification. A storage
        cut to a prefix (fsdp's forward-only release) is freed first: growing it would copy the
        prefix into the new allocation, bytes the refill overwrites.
        """
        if not self._owns_storage:
            self._refuse_shared_storage("reallocate_storage")
        storage = self.local_buffer.untyped_storage()
        if storage.nbytes() != self._capacity_bytes:
            if storage.nbytes():
                storage.resize_(0)
            storage.resize_(self._capacity_bytes)
            self._refill_pending = True

    def _refill_guard(self):
        if not self._refill_pending:
            return _NO_REFILL
        self._refill_pending = False
        return _KeepVersion(self.local_buffer)

    def is_storage_released(self) -> bool:
        """Whether :meth:`release_storage` freed the local storage and nothing gave it back."""
        return self.local_buffer.untyped_storage().nbytes() == 0 and self._capacity_bytes > 0

    def _refuse_shared_storage(self, op: str) -> None:
        raise ValueError(
            f"{op}: the local buffer is a view into a larger storage (from scatter() or a "
            f"user-supplied local_buffer), so freeing it would free its neighbours too"
        )


class _KeepVersion:
    """``torch.autograd._unsafe_preserve_version_counter`` for one tensor, without its decorator
    machinery (a refill of every gather target): the version read at entry is restored at exit."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        torch._C._autograd._unsafe_set_version_counter((self.tensor,), (self.version,))
