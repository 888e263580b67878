"""CPU offload: step time and peak memory of fsdp against torch FSDP2, both with CPUOffloadPolicy.

    python3 tools/bench_offload.py                       # world 2, gloo on CPU (or NCCL: --cuda)
    python3 tools/bench_offload.py --dim 64 --layers 1 --vocab 256 --steps 2   # a quick check

Trains the Llama-style decoder of ``tests/models/llama.py`` (``fully_shard`` per block + root, AdamW)
three ways in one run, interleaved step by step so that machine noise hits all alike:

* ``ours``: ``fsdp.fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=...))``;
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` with the same policy;
* ``ours_no_offload``: fsdp without offload (what offloading costs in time, saves in memory).

Reported per method: the median step time over the timed steps (after ``--warmup`` untimed
ones) and the peak memory of one measured step. On CUDA the peak is the device's
(``torch.cuda.max_memory_allocated``: what offload saves) and the host side is what is
offloaded; on CPU everything is host memory, so the peak is that of every tensor storage the
step holds or touches (``tools.kit.memory.StorageTracker``), offloaded state included. Then the
ratios ours/FSDP2. On this shared 2-core CPU machine read the ratios, not the milliseconds; on
CPU, the offload copies are host-to-host and cost little, so the figures that matter are the
GPU ones.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.models.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from tools.kit import launch  # noqa: E402
from tools.kit.memory import StorageTracker  # noqa: E402

METHODS = ("ours", "fsdp2", "ours_no_offload")


def build(name: str, base: torch.nn.Module, mesh, pin_memory: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``base`` copied and sharded the way ``name`` says, with its AdamW."""
    model = copy.deepcopy(base)
    if name == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    else:
        import fsdp

        fully_shard = fsdp.fully_shard
        kw = dict(mesh=mesh)
        if name == "ours":
            kw["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=pin_memory)
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, tokens: torch.Tensor) -> None:
    loss_fn(model(tokens[:, :-1]), tokens).backward()
    opt.step()
    opt.zero_grad()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, device: torch.device) -> dict:
    """Every rank: build the three methods, warm up, time ``args.steps`` interleaved steps, then
    one measured step each for peak memory. Returns times (s) and peaks (bytes) by method."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=3 * args.dim, max_seq_len=args.seq)
    torch.manual_seed(0)
    base = Llama(cfg).to(device)  # fully_shard keeps the shards on the host
    mesh = init_device_mesh(device.type, (world,))
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
               for _ in range(args.warmup + args.steps + 1)]
    methods = {name: build(name, base, mesh, args.pin_memory) for name in METHODS}
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for i, tokens in enumerate(batches[:-1]):
        for name, (model, opt) in methods.items():
            _sync(device)
            t0 = time.perf_counter()
            step(model, opt, tokens)
            _sync(device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    peaks = {}
    for name, (model, opt) in methods.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            step(model, opt, batches[-1])
            peaks[name] = torch.cuda.max_memory_allocated(device)
        else:
            with StorageTracker() as tracker:
                tracker.track(list(model.parameters()), list(model.buffers()), opt.state_dict()["state"])
                step(model, opt, batches[-1])
            peaks[name] = tracker.peak
    medians = torch.tensor([statistics.median(times[n]) for n in METHODS] + [peaks[n] for n in METHODS],
                           dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank, the largest peak
    k = len(METHODS)
    return {"time": dict(zip(METHODS, medians[:k].tolist())), "peak": dict(zip(METHODS, medians[k:].tolist()))}


def report(result: dict, args, device: torch.device, world: int) -> None:
    t, p = result["time"], result["peak"]
    where = "device (CUDA)" if device.type == "cuda" else "host storages (CPU run)"
    print(f"world {world}, {device.type}, Llama dim {args.dim} x {args.layers} layers, vocab {args.vocab}, "
          f"batch {args.batch} x {args.seq}; median of {args.steps} steps after {args.warmup}; "
          f"pin_memory={args.pin_memory}; peak memory of {where}, max over ranks")
    print("| method | step ms | peak MiB |")
    print("| --- | --- | --- |")
    for name in METHODS:
        print(f"| {name} | {1e3 * t[name]:.1f} | {p[name] / 2**20:.2f} |")
    print(f"ours/FSDP2: step time {t['ours'] / t['fsdp2']:.2f}, peak memory {p['ours'] / p['fsdp2']:.2f}")
    print(f"ours offload/no offload: step time {t['ours'] / t['ours_no_offload']:.2f}, "
          f"peak memory {p['ours'] / p['ours_no_offload']:.2f}")


def _measure_and_report(args) -> None:
    """Every rank measures (on ``cuda:rank`` with ``--cuda``); rank 0 prints."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if args.cuda else torch.device("cpu")
    result = measure(args, device)
    if rank == 0:
        report(result, args, device, world)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cuda", action="store_true", help="one GPU per rank, NCCL (default: CPU, gloo)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--pin-memory", type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                        help="CPUOffloadPolicy(pin_memory=); default: true with --cuda, false on CPU "
                        "(where torch FSDP2 cannot pin)")
    args = parser.parse_args(argv)
    if args.pin_memory is None:
        args.pin_memory = args.cuda
    if args.cuda and torch.cuda.device_count() < args.world:
        parser.error(f"--cuda needs {args.world} GPUs, found {torch.cuda.device_count()}")
    launch.spawn(args.world, _measure_and_report, args, backend="nccl" if args.cuda else "gloo",
                 threads=args.threads, cuda=args.cuda)


if __name__ == "__main__":
    main()
