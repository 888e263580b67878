"""Launching a tool's ranks: the ritual every multi-rank tool shares.

    from tools.kit import launch

    def body(cfg) -> None:                    # every rank, in the initialised default group
        ...

    if launch.under_torchrun():
        launch.run_rank(body, cfg)            # this process is one of torchrun's ranks
    launch.spawn(world, body, cfg)            # or: ``world`` fresh processes on this host

:func:`spawn` picks a free loopback port, makes gloo talk over loopback (``GLOO_SOCKET_IFNAME=lo``
unless set) and starts ``world`` processes (``spawn`` start method: ``body`` and its arguments
must pickle, i.e. be module-level). Each process gets the environment torchrun would give it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and runs
:func:`run_rank`, so a spawned rank and a torchrun rank run the same code. A rank that raises
makes :func:`spawn` raise (torch.multiprocessing's ``ProcessRaisedException``, the rank's
traceback in it).

The rendezvous listens on loopback only (:func:`tests.models.rendezvous.loopback_store`). torch's own (``env://``,
``tcp://127.0.0.1:...``) binds its ``TCPStore`` server to every interface whatever
``MASTER_ADDR`` says, an unauthenticated store any host could reach while the job runs. Under
``torchrun`` the store is torchrun's agent's, which listens on every interface too: a job
started so is reachable from the network while it runs (give torchrun ``--rdzv-endpoint
127.0.0.1:PORT`` and keep the port firewalled).

:func:`run_rank` sets the rank's device and torch threads, joins the default process group from
that environment, runs ``body(*args)`` and ends the process through
:func:`dbuffer.teardown.shutdown`: ``shutdown(0)`` when ``body`` returns (barrier, free the
groups, exit 0 without finalising), ``shutdown(barrier=False)`` and re-raise when it raises (a
peer may be gone; the error goes on to the launcher). It never returns.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, NoReturn, Optional

from tests.models.rendezvous import loopback_store


def under_torchrun() -> bool:
    """Whether torchrun (or a launcher like it) started this process as one rank of a world."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def free_port() -> int:
    """A TCP port free on the loopback interface now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, body: Callable[..., Any], *args: Any, backend: str = "gloo", threads: Optional[int] = 1,
          cuda: bool = False) -> None:
    """Run ``body(*args)`` on ``world`` fresh ranks of this host (see :func:`run_rank` for the
    keywords); returns when every rank has exited 0, raises when one failed."""
    import torch.multiprocessing as tmp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # our own ranks talk over loopback
    tmp.start_processes(_spawned, args=(world, free_port(), body, args, backend, threads, cuda), nprocs=world,
                        start_method="spawn")


def _spawned(rank: int, world: int, port: int, body: Callable[..., Any], args: tuple, backend: str,
             threads: Optional[int], cuda: bool) -> NoReturn:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run(body, args, backend, threads, cuda, lambda: loopback_store(rank, world, port))


def run_rank(body: Callable[..., Any], *args: Any, backend: str = "gloo", threads: Optional[int] = 1,
             cuda: bool = False) -> NoReturn:
    """This process as one rank: ``cuda`` selects ``cuda:LOCAL_RANK`` first; ``threads`` torch
    threads (None: torch's default; 1: the ranks share the host's cores); the default group
    joins with ``backend`` from the environment (torchrun's store); then ``body(*args)``, then
    :func:`dbuffer.teardown.shutdown`."""
    _run(body, args, backend, threads, cuda, None)


def _run(body: Callable[..., Any], args: tuple, backend: str, threads: Optional[int], cuda: bool,
         make_store: Optional[Callable[[], Any]]) -> NoReturn:
    import torch
    import torch.distributed as dist

    from dbuffer.teardown import shutdown

    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if threads is not None:
        torch.set_num_threads(threads)
    if make_store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=make_store(), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    try:
        body(*args)
    except BaseException:
        shutdown(barrier=False)  # a peer may be gone; the error goes on to the launcher
        raise
    shutdown(0)  # barrier, free the groups, exit 0 without finalising (see dbuffer.teardown)
