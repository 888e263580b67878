"""The ranks this project starts listen on loopback only (issue 46): the rendezvous ``TCPStore``
of the test harness's gloo workers and of ``tools.kit.launch.spawn``'s ranks, and gloo's own
sockets. torch's ``tcp://127.0.0.1:PORT`` / ``env://`` rendezvous binds the store's server to
every interface (the wildcard address, seen in the kernel's socket table while a job runs);
``tests.models.rendezvous.loopback_store`` hands it a socket bound to 127.0.0.1 instead.

Each rank reads its own listening sockets from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (those
whose inode is one of the process's file descriptors) while the job runs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys

import pytest
import torch.distributed as dist

from tests.harness import run_ranks
from tools.kit import launch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/net")


def _address(hex_address: str) -> str:
    """``/proc/net/tcp{,6}``'s ``ADDR:PORT`` (the address as 32-bit words in host order) as text."""
    addr, port = hex_address.split(":")
    words = struct.pack("<" + "I" * (len(addr) // 8), *(int(addr[i : i + 8], 16) for i in range(0, len(addr), 8)))
    return f"{ipaddress.ip_address(words)}:{int(port, 16)}"


def listening() -> list[str]:
    """``address:port`` of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, gone
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # TCP_LISTEN
                out.append(_address(fields[1]))
    return sorted(out)


def _store_port() -> int:
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.port


def _rank_sockets() -> tuple[int, list[str]]:
    return _store_port(), listening()


def _loopback_only(store_port: int, addresses: list[str], rank: int) -> None:
    assert addresses, "no listening socket found: the reader is broken"
    assert all(a.startswith("127.0.0.1:") for a in addresses), (rank, addresses)
    if rank == 0:
        assert f"127.0.0.1:{store_port}" in addresses, (store_port, addresses)  # the store's server


def test_the_reader_sees_a_socket_bound_to_every_interface() -> None:
    """The check below can fail: a socket on the wildcard address is seen as such."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            s.listen()
            port = s.getsockname()[1]
            assert f"{host}:{port}" in listening()


def test_harness_gloo_workers_listen_on_loopback_only() -> None:
    for rank, (port, addresses) in enumerate(run_ranks(_rank_sockets, 2)):
        _loopback_only(port, addresses, rank)


def _spawned_body() -> None:
    _loopback_only(*_rank_sockets(), dist.get_rank())


def test_launch_spawn_ranks_listen_on_loopback_only() -> None:
    launch.spawn(2, _spawned_body)  # a failed check raises in a rank, and so here
