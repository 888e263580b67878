"""Benchmark DBuffer's collectives against raw c10d and DTensor on the same bytes.

    python3 tools/bench_primitives.py [--world 2] [--sizes 1,4,16,64] [--reps 9] [--warmup 1]
                                      [--min-time 6] [--json results.json]

Launches ``--world`` gloo ranks on loopback (one CPU thread each) and, for every payload size (MiB
of fp32, counted as the *full* buffer: the all-gather output, the reduce-scatter input, the
all-reduce tensor), times:

* ``allgather``: ``Shard(0) -> Replicate()``;
* ``rs_sum`` / ``rs_avg``: reduce-scatter, ``Partial(sum|avg) -> Shard(0)``;
* ``ar_avg``: all-reduce, ``Partial(avg) -> Replicate()``, in place;

each by every method that applies:

* ``dbuffer``: the DBuffer primitive with ``out=`` (a DBuffer holding a few transformer-block
  shapes whose sizes add up to the payload);
* ``c10d``: the one-call c10d collective on the same number of elements (``all_gather_single``,
  ``reduce_scatter_single``, ``all_reduce``; gloo has no AVG, so avg adds a division);
* ``a2a``: built on ``all_to_all_single`` with its receive workspace allocated up front
  (reduce-scatter: all-to-all + local sum; all-reduce: that, then ``all_gather_single``);
* ``p2p``: built on ``isend`` / ``irecv`` into preallocated memory (all-gather: receive every
  peer's shard straight into the output; reduce-scatter: send each peer its chunk, receive
  into a ``(world - 1) * shard`` workspace, add; all-reduce: that reduce-scatter in place, then
  the all-gather);
* ``dtensor``: ``DTensor.redistribute`` of one flat DTensor of the same number of elements.

All methods of all ops run once in every repetition (round-robin, in an order shuffled anew each
repetition, the same on every rank), so drift of the machine and any effect of what ran just
before hit every method alike. A call is timed from the moment the last rank enters it (after a barrier) to the
moment the last rank leaves it (the ranks share the host's monotonic clock), and the table reports the median (``--stat``) over the repetitions after ``--warmup``
untimed ones: ``--reps`` of them, more for small sizes (up to 8x, to fill ``--min-time``
seconds per size). ``best raw`` is the fastest of ``c10d``, ``a2a`` and ``p2p``. Before timing, the
results of every method are checked against each other.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.kit import launch  # noqa: E402

MIB = 1 << 20
METHODS = ("dbuffer", "c10d", "a2a", "p2p", "dtensor")
RAW = ("c10d", "a2a", "p2p")
OPS = ("allgather", "rs_sum", "rs_avg", "ar_avg")


def block_shapes(numel: int) -> list[tuple[int, ...]]:
    """Transformer-block-like shapes (qkv, out proj, two MLP mats, norms, biases) adding up to
    exactly ``numel`` elements."""
    d = max(8, int(math.isqrt(max(numel, 1) // 12)) // 8 * 8)
    shapes: list[tuple[int, ...]] = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (d,), (d,)]
    used = sum(math.prod(s) for s in shapes)
    while used > numel and len(shapes) > 1:
        used -= math.prod(shapes.pop(0))
    rest = numel - used
    if rest:
        shapes.append((rest,))
    return shapes


# ----------------------------------------------------------------------------- one rank


def _setup(size_mib: float, world: int):
    """Every buffer, DTensor and workspace for one payload size, and the methods as closures."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from dbuffer import DBuffer, compat

    all_gather_single = getattr(dist, compat.all_gather_name())  # its name before torch 2.13
    reduce_scatter_single = getattr(dist, compat.reduce_scatter_name())
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group(0)
    shapes = block_shapes(int(size_mib * MIB) // 4)
    f32 = torch.float32
    S, R, SUM, AVG = Shard(0), Replicate(), Partial("sum"), Partial("avg")

    gen = torch.Generator().manual_seed(1234 + rank)
    sharded = DBuffer(mesh, [S], shapes, f32)
    sharded.local_buffer.copy_(torch.randn(sharded.local_buffer.numel(), generator=gen))
    partial_sum = DBuffer(mesh, [SUM], shapes, f32)
    partial_sum.local_buffer.copy_(torch.randn(partial_sum.local_buffer.numel(), generator=gen))
    partial_avg = DBuffer(mesh, [AVG], shapes, f32)
    ar_source = partial_sum.local_buffer.clone()
    replicated = DBuffer(mesh, [R], shapes, f32)
    rs_out = DBuffer(mesh, [S], shapes, f32)

    total = replicated.local_buffer.numel()  # the DBuffer's global buffer, padding included
    shard = total // world
    assert shard * world == total
    # raw c10d buffers: the same number of elements
    raw_shard = sharded.local_buffer.clone()
    raw_full = torch.empty(total, dtype=f32)
    raw_in = partial_sum.local_buffer.clone()
    raw_out = torch.empty(shard, dtype=f32)
    raw_ar = torch.empty(total, dtype=f32)
    workspace = torch.empty(total, dtype=f32)
    p2p_scratch = torch.empty(total - shard, dtype=f32).view(world - 1, shard)
    ar_shard = torch.empty(shard, dtype=f32)
    # DTensors of the same number of elements
    dt_shard = DTensor.from_local(raw_shard, mesh, [S], run_check=False)
    dt_sum = DTensor.from_local(raw_in, mesh, [SUM], run_check=False)
    dt_avg = DTensor.from_local(raw_in, mesh, [AVG], run_check=False)

    def dtensor(dt, placements):
        def run():
            out = dt.redistribute(mesh, placements).to_local()
            wait = getattr(out, "wait", None)  # an AsyncCollectiveTensor, if the transform left one
            return wait() if callable(wait) else out

        return run

    def a2a_sum(inp, out):
        dist.all_to_all_single(workspace, inp, group=group)
        rows = workspace.view(world, shard)
        torch.add(rows[0], rows[1], out=out)  # adds beat torch.sum(dim=0) on CPU
        for j in range(2, world):
            out.add_(rows[j])

    def p2p_rs_into(inp, out):
        chunks = inp.view(world, shard)
        works = []
        for k in range(1, world):
            works.append(dist.irecv(p2p_scratch[k - 1], group=group, group_src=(rank - k) % world))
            works.append(dist.isend(chunks[(rank + k) % world], group=group, group_dst=(rank + k) % world))
        for w in works:
            w.wait()
        torch.add(chunks[rank], p2p_scratch[0], out=out)
        for row in p2p_scratch[1:]:
            out.add_(row)

    def p2p_ag_into(out, inp):
        chunks = out.view(world, shard)
        works = []
        for k in range(1, world):
            works.append(dist.irecv(chunks[(rank - k) % world], group=group, group_src=(rank - k) % world))
            works.append(dist.isend(inp, group=group, group_dst=(rank + k) % world))
        if chunks[rank].data_ptr() != inp.data_ptr():
            chunks[rank].copy_(inp)
        for w in works:
            w.wait()

    def dbuffer_ag():
        sharded.allgather(0, out=replicated)
        return replicated.local_buffer

    def c10d_ag():
        all_gather_single(raw_full, raw_shard, group=group)
        return raw_full

    def p2p_ag():
        p2p_ag_into(raw_full, raw_shard)
        return raw_full

    def dbuffer_rs(src):
        def run():
            src.reduce_scatter(0, out=rs_out)
            return rs_out.local_buffer

        return run

    def c10d_rs(divide):
        def run():
            reduce_scatter_single(raw_out, raw_in, op=dist.ReduceOp.SUM, group=group)
            return raw_out.div_(world) if divide else raw_out

        return run

    def a2a_rs(divide):
        def run():
            a2a_sum(raw_in, raw_out)
            return raw_out.div_(world) if divide else raw_out

        return run

    def p2p_rs(divide):
        def run():
            p2p_rs_into(raw_in, raw_out)
            return raw_out.div_(world) if divide else raw_out

        return run

    def prepare_ar():  # untimed: every all-reduce starts from the same partial values
        partial_avg.local_buffer.copy_(ar_source)
        raw_ar.copy_(ar_source)

    def dbuffer_ar():
        partial_avg.allreduce(0, out=partial_avg)
        return partial_avg.local_buffer

    def c10d_ar():
        dist.all_reduce(raw_ar, op=dist.ReduceOp.SUM, group=group)
        return raw_ar.div_(world)

    def a2a_ar():
        a2a_sum(raw_ar, ar_shard)
        ar_shard.div_(world)
        all_gather_single(raw_ar, ar_shard, group=group)
        return raw_ar

    def p2p_ar():
        mine = raw_ar.view(world, shard)[rank]
        p2p_rs_into(raw_ar, mine)  # in place: the reduced chunk lands where it is gathered from
        mine.div_(world)
        p2p_ag_into(raw_ar, mine)
        return raw_ar

    ops = {
        "allgather": (
            {"dbuffer": dbuffer_ag, "c10d": c10d_ag, "p2p": p2p_ag, "dtensor": dtensor(dt_shard, [R])},
            None,
        ),
        "rs_sum": (
            {"dbuffer": dbuffer_rs(partial_sum), "c10d": c10d_rs(False), "a2a": a2a_rs(False),
             "p2p": p2p_rs(False),
             "dtensor": dtensor(dt_sum, [S])},
            None,
        ),
        "rs_avg": (
            {"dbuffer": dbuffer_rs(_as_avg(partial_sum, mesh, shapes)), "c10d": c10d_rs(True),
             "a2a": a2a_rs(True), "p2p": p2p_rs(True), "dtensor": dtensor(dt_avg, [S])},
            None,
        ),
        "ar_avg": (
            {"dbuffer": dbuffer_ar, "c10d": c10d_ar, "a2a": a2a_ar, "p2p": p2p_ar, "dtensor": dtensor(dt_avg, [R])},
            prepare_ar,
        ),
    }
    if world == 1:  # nothing to exchange: the hand-built raw ways do not apply
        for methods, _ in ops.values():
            methods.pop("a2a", None)
            methods.pop("p2p", None)
    info = {"shapes": [list(s) for s in shapes], "numel": total, "data_numel": sharded.layout.data_numel}
    return ops, info


def _as_avg(buf, mesh, shapes):
    """The same local values as ``buf`` (no copy), placed as ``Partial('avg')``."""
    from torch.distributed.tensor import Partial

    from dbuffer import DBuffer

    return DBuffer.from_local(buf.local_buffer, mesh, [Partial("avg")], shapes)


def _check(ops) -> list[str]:
    """Run every method once; all methods of an op must agree. Returns the mismatches."""
    import torch

    problems = []
    for op, (methods, prepare) in ops.items():
        results = {}
        for name, fn in methods.items():
            if prepare is not None:
                prepare()
            try:
                results[name] = fn().clone()
            except Exception as exc:  # a method the backend cannot run is reported, not fatal
                problems.append(f"{op}/{name} failed: {type(exc).__name__}: {exc}"[:300])
                methods[name] = None
        ref = results.get("c10d")
        for name, value in results.items():
            if ref is not None and not torch.allclose(value, ref, rtol=1e-5, atol=1e-5):
                problems.append(f"{op}/{name} differs from c10d by {(value - ref).abs().max().item():.3g}")
        for name in [n for n, f in methods.items() if f is None]:
            del methods[name]
    return problems


def _bench_size(size_mib: float, world: int, reps: int, warmup: int, min_time: float) -> dict:
    import torch
    import torch.distributed as dist

    ops, info = _setup(size_mib, world)
    problems = _check(ops)
    schedule = [(op, name) for op, (methods, _) in ops.items() for name in methods]

    def one_rep(seed: int, record=None) -> None:
        order = list(range(len(schedule)))
        random.Random(seed).shuffle(order)  # same order on every rank, a new one each repetition
        for j in order:
            op, name = schedule[j]
            methods, prepare = ops[op]
            if prepare is not None:
                prepare()
            dist.barrier()
            t0 = time.perf_counter()
            methods[name]()
            if record is not None:
                record[0, j], record[1, j] = t0, time.perf_counter()

    t0 = time.perf_counter()
    for rep in range(max(warmup, 1)):
        one_rep(-1 - rep)
    # Small sizes are cheap and noisier: give them more repetitions, up to 8x --reps, so that
    # each size is timed for about --min-time seconds. Agreed by all ranks (max over ranks).
    per_rep = torch.tensor([(time.perf_counter() - t0) / max(warmup, 1)], dtype=torch.float64)
    dist.all_reduce(per_rep, op=dist.ReduceOp.MAX)
    n = min(8 * reps, max(reps, math.ceil(min_time / max(per_rep.item(), 1e-9))))
    stamps = torch.zeros(n, 2, len(schedule), dtype=torch.float64)
    for rep in range(n):
        one_rep(rep, stamps[rep])
    # The ranks share one monotonic clock (one host). A call runs from the moment the last rank
    # enters it (no rank can finish before) to the moment the last rank leaves it, so the skew
    # of the ranks leaving the barrier is not counted.
    dist.all_reduce(stamps, op=dist.ReduceOp.MAX)
    times = stamps[:, 1] - stamps[:, 0]
    result: dict = {"size_mib": size_mib, **info, "reps": n, "problems": problems, "ops": {}}
    for j, (op, name) in enumerate(schedule):
        ms = sorted(t * 1e3 for t in times[:, j].tolist())
        result["ops"].setdefault(op, {})[name] = {
            "median_ms": statistics.median(ms),
            "mean_ms": statistics.fmean(ms),
            "p90_ms": ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))],
            "min_ms": ms[0],
        }
    del ops
    return result


def _bench_and_report(args: argparse.Namespace) -> None:
    """Every rank benchmarks every size; rank 0 prints (and writes) the results."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    results = []
    for size in args.sizes:
        results.append(_bench_size(size, world, args.reps, args.warmup, args.min_time))
        if rank == 0:
            print(f"  {size:g} MiB done ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    if rank == 0:
        report = {
            "world": world,
            "backend": "gloo",
            "torch": torch.__version__,
            "reps": args.reps,
            "warmup": args.warmup,
            "threads_per_rank": 1,
            "wall_s": time.perf_counter() - started,
            "results": results,
        }
        print(format_table(report, args.stat))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))


# ----------------------------------------------------------------------------- report


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def format_table(report: dict, stat: str = "median") -> str:
    head = (f"{'op':<10}{'MiB':>6}{'reps':>5}" + "".join(f"{m + ' ms':>12}" for m in METHODS)
            + f"{'best raw':>10}{'DB/raw':>9}{'DB/DT':>9}")
    lines = [
        f"gloo, world {report['world']}, 1 thread/rank, torch {report['torch']}; {stat} over "
        f"reps (at least {report['reps']}, after {report['warmup']} warmup), last rank in to last rank out",
        head,
        "-" * len(head),
    ]
    for res in report["results"]:
        for op in OPS:
            row = res["ops"].get(op)
            if row is None:
                continue
            med = {m: row[m][f"{stat}_ms"] for m in METHODS if m in row}
            raws = {m: med[m] for m in RAW if m in med}
            best = min(raws, key=raws.get) if raws else None
            cells = "".join(f"{med[m]:>12.2f}" if m in med else f"{'-':>12}" for m in METHODS)
            lines.append(
                f"{op:<10}{res['size_mib']:>6g}{res['reps']:>5}{cells}{best or '-':>10}"
                f"{_ratio(med.get('dbuffer'), raws.get(best)):>9}{_ratio(med.get('dbuffer'), med.get('dtensor')):>9}"
            )
        for p in res["problems"]:
            lines.append(f"  ! {res['size_mib']:g} MiB: {p}")
    lines.append(f"wall time {report['wall_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="number of gloo ranks (default 2)")
    parser.add_argument("--sizes", default="1,4,16,64", help="payload sizes in MiB of fp32, comma separated")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per method (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    parser.add_argument("--min-time", type=float, default=6.0,
                        help="seconds to spend timing each size; small sizes get more reps (default 6)")
    parser.add_argument("--stat", choices=("median", "mean", "p90", "min"), default="median",
                        help="statistic the table shows (the JSON holds all four)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    if args.world < 1 or args.reps < 1 or args.warmup < 0 or not args.sizes:
        parser.error("need --world >= 1, --reps >= 1, --warmup >= 0 and at least one size")

    launch.spawn(args.world, _bench_and_report, args)


if __name__ == "__main__":
    main()
