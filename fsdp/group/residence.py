"""Where a group's main state lives when it is not offloaded: on the mesh's device.

A group always has an ``offload`` part and calls it without asking which it is: this one
(:data:`NO_OFFLOAD`), whose moves are no-ops, or :class:`fsdp.compose.offload.HostOffload`
(``CPUOffloadPolicy``), which keeps the main weights, main grads and optimizer state on the host
and copies between host and device. ``on_host`` answers the few decisions that do differ (which
buffer a reduction may write directly, what ``module.to`` may accept).
"""

from __future__ import annotations

from typing import Optional

from dbuffer import DBuffer

__all__ = ["NO_OFFLOAD", "NoOffload"]


class NoOffload:
    """The main state on the mesh's device: nothing to upload, download, pin or wait for."""

    on_host = False

    def adopt(self, buf: DBuffer) -> DBuffer:
        return buf

    def upload(self, src: DBuffer, out: Optional[DBuffer] = None) -> DBuffer:
        """The gather reads the model shard where it is."""
        return src

    def release_upload(self) -> None:
        pass

    def settle(self) -> None:
        pass


NO_OFFLOAD = NoOffload()
