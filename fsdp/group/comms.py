"""How a group's collectives run: dbuffer's ``redistribute`` by default.

A group calls its comms object for its two collectives, the all-gather of the weights and the
reduction of the gradients. FSDP2's custom comm objects (``set_custom_all_gather`` /
``set_custom_reduce_scatter`` and the comm-memory setters) replace it with one of
:mod:`fsdp.compose.custom_comm`, which the core never imports.
"""

from __future__ import annotations

from dbuffer import DBuffer, Pending

__all__ = ["DBUFFER_COMMS", "DBufferComms"]


class DBufferComms:
    """dbuffer's own collectives (the algorithm each backend does best; see :mod:`dbuffer.collectives`)."""

    all_gather_comm = None  # FSDP2's comm objects, if any (none here)
    reduce_scatter_comm = None

    def all_gather(self, source: DBuffer, placements: tuple, target: DBuffer) -> Pending:
        """``target`` = ``source`` gathered to ``placements``, in flight."""
        return source.redistribute(placements, out=target, async_op=True)

    def reduce(self, source: DBuffer, placements: tuple, out: DBuffer, async_op: bool = True):
        """``out`` = ``source`` (Partial) reduced to ``placements``: a Pending, or ``out`` when not async."""
        return source.redistribute(placements, out=out, async_op=async_op)


DBUFFER_COMMS = DBufferComms()
