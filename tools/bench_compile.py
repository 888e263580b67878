"""Benchmark compiled sharded layers: ``fsdp.fully_shard`` vs torch FSDP2, each layer compiled
with ``layer.compile()`` after sharding, in one run.

    python3 tools/bench_compile.py                           # world 2 gloo, inductor
    python3 tools/bench_compile.py --layers 2 --dim 64 --steps 3 --backend eager   # a quick look
    torchrun --nproc-per-node 2 tools/bench_compile.py

Model: ``tools.llama.Llama`` (``--vocab/--dim/--layers/--heads/--hidden``), ``--batch`` sequences
of ``--seq`` random tokens per rank, one CPU thread per rank, fp32, AdamW. For each method
(``ours``: ``fsdp.fully_shard``; ``fsdp2``: ``torch.distributed.fsdp.fully_shard``; both on every
layer, then on the root, every layer then ``layer.compile(backend=--backend)``):

* first step: forward, backward, optimizer step of a freshly sharded model, compilation
  included. Inductor's on-disk and in-memory graph caches are off, so the method measured second
  compiles as much as the first, and the compiler's one-time start-up is paid beforehand on an
  unrelated function; ``--order`` picks which goes first.
* a second, untimed step (no recompilation expected), after which the graph breaks dynamo
  counted for that method and the frames it compiled are reported.
* steady steps: ``--steps`` steps per method, round-robin, the order rotated every step; the
  table shows medians.

Every step is timed from a barrier to a barrier (the slowest rank). Ratios are ours / FSDP2:
the target is a first step within 1.2x. The losses of the two methods are compared step by step
(the same model, batches and arithmetic: they agree to rounding). The machine is shared and
noisy: compare ratios from one run, not absolute times.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdp  # noqa: E402
from tools.llama import Llama, LlamaConfig, loss_fn  # noqa: E402

METHODS = ("ours", "fsdp2")


def _shard_fn(method: str) -> Callable:
    if method == "ours":
        return fsdp.fully_shard
    from torch.distributed.fsdp import fully_shard

    return fully_shard


class Method:
    """One sharded, compiled copy of the model with its optimizer."""

    def __init__(self, name: str, base: torch.nn.Module, backend: str) -> None:
        self.name = name
        self.model = copy.deepcopy(base)
        shard = _shard_fn(name)
        for layer in self.model.layers:
            shard(layer)
            layer.compile(backend=backend)
        shard(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.losses: list[float] = []

    def step(self, tokens: torch.Tensor) -> None:
        loss = loss_fn(self.model(tokens[:, :-1]), tokens)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())


def _warm_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ x).sum()


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def run_benchmark(args: argparse.Namespace) -> dict:
    """Every rank runs this; returns the report (the same on every rank up to rounding)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.fx_graph_cache = False  # the second method must not reuse the first's kernels
    functorch_config.enable_autograd_cache = False
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=args.hidden, max_seq_len=args.seq)
    torch.manual_seed(args.seed)
    base = Llama(cfg)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    steps = 2 + args.steps
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(steps)]
    order = list(METHODS) if args.order == "ours" else list(reversed(METHODS))
    # Dynamo's and the backend's one-time start-up (imports, first trace, inductor's C++
    # toolchain probe and headers, forward and backward) would otherwise be charged to whichever
    # method compiles first: pay it on a function unrelated to both.
    torch.compile(_warm_up, backend=args.backend)(torch.ones(4, 4, requires_grad=True)).backward()
    torch._dynamo.reset()
    methods: dict[str, Method] = {}
    report: dict = {"world": world, "backend": args.backend, "methods": {}}
    for name in order:
        counters.clear()
        methods[name] = method = Method(name, base, args.backend)
        first = _timed(lambda: method.step(batches[0]))
        method.step(batches[1])
        report["methods"][name] = {
            "first_s": first,
            "graph_breaks": sum(counters["graph_break"].values()),
            "frames": counters["frames"]["ok"],
            "steady_s": [],
        }
    for k in range(args.steps):
        shift = k % len(order)
        for name in order[shift:] + order[:shift]:
            report["methods"][name]["steady_s"].append(_timed(lambda: methods[name].step(batches[2 + k])))
    for name, m in report["methods"].items():
        m["steady_median_s"] = statistics.median(m["steady_s"]) if m["steady_s"] else float("nan")
        m["losses"] = methods[name].losses
    ours, theirs = report["methods"]["ours"], report["methods"]["fsdp2"]
    report["ratios"] = {
        "first_step": ours["first_s"] / theirs["first_s"],
        "steady_step": ours["steady_median_s"] / theirs["steady_median_s"],
    }
    report["max_loss_diff"] = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
    torch._dynamo.reset()
    return report


def format_report(report: dict) -> str:
    lines = [
        f"world {report['world']} (gloo, cpu, 1 thread per rank); every layer compiled with "
        f"layer.compile(backend={report['backend']!r}) after fully_shard",
        f"{'method':8} {'first step':>11} {'steady (median)':>16} {'graph breaks':>13} {'frames':>7}",
    ]
    for name, m in report["methods"].items():
        lines.append(
            f"{name:8} {m['first_s']:10.2f}s {m['steady_median_s'] * 1e3:14.1f}ms {m['graph_breaks']:13d} {m['frames']:7d}"
        )
    r = report["ratios"]
    lines.append(f"ours / fsdp2: first step {r['first_step']:.2f}x (target <= 1.2x), steady step {r['steady_step']:.2f}x")
    lines.append(f"max |loss difference| over {len(report['methods']['ours']['losses'])} steps: {report['max_loss_diff']:.3g}")
    return "\n".join(lines)


def _rank_main(rank: int, world: int, port: Optional[int], args: argparse.Namespace) -> NoReturn:
    from dbuffer.teardown import shutdown

    torch.set_num_threads(1)
    if port is None:  # torchrun: rendezvous from the environment
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        report = run_benchmark(args)
        if dist.get_rank() == 0:
            print(format_report(report), flush=True)
    except BaseException:
        shutdown(barrier=False)  # a peer may be gone; the error goes on to the launcher
        raise
    shutdown(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5, help="steady steps per method (default 5)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--order", choices=METHODS, default="ours", help="which method compiles first")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768, help="SwiGLU hidden width")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("world", "steps", "layers", "dim", "heads", "hidden", "vocab", "seq", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        parser.error("--dim must be a multiple of --heads with an even quotient (rotary embeddings)")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return
    import torch.multiprocessing as tmp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # our own ranks talk over loopback
    tmp.start_processes(_rank_main, args=(args.world, _free_port(), args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
