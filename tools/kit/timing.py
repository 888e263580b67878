"""Timing helpers: one call on this rank, one call across the ranks, and the matmul probe that
says how fast this machine computes in each dtype (on a CPU without bf16 units a bf16 matmul is
many times slower than an fp32 one, which decides how long a bf16 benchmark runs)."""

from __future__ import annotations

import resource
import time
from typing import Callable

import torch

PHASES = ("forward", "backward", "optimizer")


def cpu_mark() -> tuple[float, float, int]:
    """``(this thread's CPU s, the process's CPU s, minor page faults so far)``: the difference of
    two marks splits a stretch of work into the calling thread's own CPU time, the CPU time of the
    process's other threads (gloo's, where c10d does its work), and the fresh pages it touched
    (each one a kernel fault that zeroes 4 KiB: big buffers allocated anew every step pay them)."""
    return time.thread_time(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def phase_costs(marks: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Per stretch between consecutive :func:`cpu_mark` marks: ``(own thread ms, other threads
    ms, page faults)``."""
    return [(1e3 * (b[0] - a[0]), 1e3 * ((b[1] - a[1]) - (b[0] - a[0])), b[2] - a[2])
            for a, b in zip(marks, marks[1:])]


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes on this rank (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_across_ranks(fn: Callable[[], object]) -> float:
    """Seconds from a barrier before ``fn()`` to a barrier after it: the time of the slowest rank
    (every rank must call it)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def gemm_probe(dtypes: dict[str, torch.dtype], rows: int = 256, dim: int = 512, reps: int = 3) -> dict:
    """GFLOP/s of one-thread matmuls in the two layouts a linear layer uses: ``x @ W.T``
    (forward) and ``g @ W`` (backward, input gradient); best of ``reps``, by name of ``dtypes``."""
    out: dict[str, dict[str, float]] = {}
    for name, dtype in dtypes.items():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, dim, generator=gen).to(dtype)
        w = torch.randn(dim, dim, generator=gen).to(dtype)
        res = {}
        for layout, fn in (("x@W.T", lambda: x @ w.t()), ("g@W", lambda: x @ w)):
            fn()
            best = min(timed(fn) for _ in range(reps))
            res[layout] = 2 * rows * dim * dim / best / 1e9
        out[name] = res
    return out


def fault_probe(mib: int = 64, reps: int = 3) -> float:
    """Microseconds one page fault costs here: writing ``mib`` MiB of freshly mapped anonymous
    memory (every 4 KiB page faults and is zeroed by the kernel, as for a buffer glibc maps anew)
    minus writing it again (warm); best of ``reps``, per page."""
    import mmap

    nbytes = mib << 20
    fresh, warm = [], []
    for _ in range(reps):
        with mmap.mmap(-1, nbytes) as region:
            buf = torch.frombuffer(region, dtype=torch.uint8)
            t0 = time.perf_counter()
            buf.fill_(1)
            t1 = time.perf_counter()
            buf.fill_(2)
            t2 = time.perf_counter()
            del buf
        fresh.append(t1 - t0)
        warm.append(t2 - t1)
    return max(0.0, min(fresh) - min(warm)) * 1e6 / (nbytes / 4096)
