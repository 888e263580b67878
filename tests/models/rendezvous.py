"""The rendezvous of the processes of one host, on loopback only: shared by the test harness's
gloo workers (tests/harness.py) and the tools' launcher (tools/kit/launch.py), which imports it
from here (imports point from tools/ to tests/models/, never back).

torch (2.11 to 2.15) binds its ``TCPStore`` server to every interface whatever ``MASTER_ADDR``
says: an unauthenticated store any host could reach while the job runs. Handed a socket already
bound to 127.0.0.1 (``master_listen_fd``), it listens there instead."""

from __future__ import annotations

import socket

__all__ = ["loopback_store"]


def loopback_store(rank: int, world: int, port: int, timeout: float = 300.0):
    """The rendezvous of ``world`` processes of this host: a ``TCPStore`` whose server (on rank
    0) listens on ``127.0.0.1:port`` only, for ``init_process_group(store=...)``.

    torch (2.11 to 2.15) binds the server itself to every interface; handed a socket already
    bound (``master_listen_fd``), it listens there instead, and takes the socket over."""
    from datetime import timedelta

    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, False, wait)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        store = dist.TCPStore("127.0.0.1", port, world, True, wait, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server closes it
    return store
