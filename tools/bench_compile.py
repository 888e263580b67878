"""Benchmark compiled sharded layers: ``fsdp.fully_shard`` vs torch FSDP2, each layer compiled
with ``layer.compile()`` after sharding, each library in its own fresh processes.

    python3 tools/bench_compile.py                           # world 2 gloo, inductor, 3 repeats
    python3 tools/bench_compile.py --layers 2 --dim 64 --steps 3 --repeats 2 --backend eager   # quick

Model: ``tests.models.llama.Llama`` (``--vocab/--dim/--layers/--heads/--hidden``), ``--batch``
sequences of ``--seq`` random tokens per rank, one CPU thread per rank, fp32, AdamW. A method
(``ours``: ``fsdp.fully_shard``; ``fsdp2``: ``torch.distributed.fsdp.fully_shard``; on every
layer, then on the root, every layer then ``layer.compile(backend=--backend)``) is measured by
launching ``--world`` fresh gloo ranks that run only it:

* first step: forward, backward, optimizer step of the freshly sharded model, compilation
  included. Each launch has a fresh, empty inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``)
  and inductor's FX-graph and autograd caches off, so no method reuses kernels another compiled
  (in one process, or through the on-disk kernel cache, the method measured second compiled less:
  that, not fsdp, made earlier single-process runs swing from 0.84x to 3.3x with the order). The
  compiler's one-time start-up (imports, toolchain probe, first trace) is paid beforehand on an
  unrelated function, in the same process.
* a second, untimed step, after which dynamo's counters give the graph breaks, the frames it
  compiled and the recompilations (none expected).
* steady steps: ``--steps`` steps; the median is reported.

``--repeats`` pairs of launches alternate which library goes first (ours, fsdp2 / fsdp2, ours /
...). Every step is timed from a barrier to a barrier (the slowest rank). Ratios are ours / FSDP2
within a pair; the report gives their median and maximum: the target is a first step within 1.2x
in every pair. The losses of the two methods are compared step by step (the same model, batches
and arithmetic: they agree to rounding). The machine is shared and noisy: compare ratios from
one run, not absolute times.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdp  # noqa: E402
from tests.models.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from tools.kit import launch  # noqa: E402
from tools.kit.timing import timed_across_ranks  # noqa: E402

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
        self.phases: list[tuple[float, float, float]] = []

    def step(self, tokens: torch.Tensor) -> None:
        t0 = time.perf_counter()
        loss = loss_fn(self.model(tokens[:, :-1]), tokens)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())
        self.phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))  # this rank's forward, backward, step


def _warm_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ x).sum()


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the compiler): unlike wall time,
    barely moved by other work on a shared machine."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def run_method(args: argparse.Namespace, name: str) -> dict:
    """Every rank of a fresh world runs this for one method; returns its measurements (the same
    on every rank up to rounding)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as inductor_metrics
    from torch._dynamo.utils import counters

    inductor_config.fx_graph_cache = False  # nothing from an earlier launch is reused
    functorch_config.enable_autograd_cache = False
    inductor_config.compile_threads = 1  # compile in this process (and its reaped gcc children): CPU time counts it
    rank = dist.get_rank()
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=args.hidden, max_seq_len=args.seq)
    torch.manual_seed(args.seed)
    base = Llama(cfg)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(2 + args.steps)]
    # Dynamo's and the backend's one-time start-up (imports, first trace, inductor's C++
    # toolchain probe and headers, forward and backward): paid on an unrelated function.
    torch.compile(_warm_up, backend=args.backend)(torch.ones(4, 4, requires_grad=True)).backward()
    torch._dynamo.reset()
    counters.clear()
    inductor_metrics.reset()
    method = Method(name, base, args.backend)
    cpu = _cpu_seconds()
    first = timed_across_ranks(lambda: method.step(batches[0]))
    cpu = _cpu_seconds() - cpu
    frames = counters["frames"]["ok"]
    work = {  # what was compiled: independent of the machine's load
        "ops_captured": counters["stats"]["calls_captured"],
        "graphs": counters["stats"]["unique_graphs"],
        "kernels": inductor_metrics.generated_kernel_count,
    }
    method.step(batches[1])
    result = {
        "first_s": first,
        "first_phases_s": method.phases[0],
        "first_cpu_s": cpu,
        "compiled": work,
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": frames,
        "recompiles": counters["frames"]["ok"] - frames,  # frames compiled again by the second step
        "steady_s": [timed_across_ranks(lambda: method.step(b)) for b in batches[2:]],
    }
    result["steady_median_s"] = statistics.median(result["steady_s"])
    result["losses"] = method.losses
    torch._dynamo.reset()
    return result


def summarize(pairs: list[dict[str, dict]], backend: str, world: int) -> dict:
    """The report from ``pairs`` (one ``{method: run_method's result}`` per repeat)."""
    first = [p["ours"]["first_s"] / p["fsdp2"]["first_s"] for p in pairs]
    first_cpu = [p["ours"]["first_cpu_s"] / p["fsdp2"]["first_cpu_s"] for p in pairs]
    steady = [p["ours"]["steady_median_s"] / p["fsdp2"]["steady_median_s"] for p in pairs]
    methods = {}
    for name in METHODS:
        runs = [p[name] for p in pairs]
        methods[name] = {
            "first_median_s": statistics.median(r["first_s"] for r in runs),
            "first_phases_s": [statistics.median(r["first_phases_s"][i] for r in runs) for i in range(3)],
            "first_cpu_median_s": statistics.median(r["first_cpu_s"] for r in runs),
            "compiled": runs[0]["compiled"],
            "steady_median_s": statistics.median(r["steady_median_s"] for r in runs),
            "graph_breaks": max(r["graph_breaks"] for r in runs),
            "frames": max(r["frames"] for r in runs),
            "recompiles": max(r["recompiles"] for r in runs),
        }
    loss_diff = max(abs(a - b) for p in pairs for a, b in zip(p["ours"]["losses"], p["fsdp2"]["losses"]))
    return {
        "world": world,
        "backend": backend,
        "repeats": len(pairs),
        "methods": methods,
        "first_ratios": first,
        "first_cpu_ratios": first_cpu,
        "ratios": {
            "first_step_median": statistics.median(first),
            "first_step_max": max(first),
            "first_step_cpu_median": statistics.median(first_cpu),
            "first_step_cpu_max": max(first_cpu),
            "steady_step_median": statistics.median(steady),
        },
        "max_loss_diff": loss_diff,
    }


def format_report(report: dict) -> str:
    lines = [
        f"world {report['world']} (gloo, cpu, 1 thread per rank); every layer compiled with "
        f"layer.compile(backend={report['backend']!r}) after fully_shard; each method in fresh processes "
        f"with an empty inductor cache, {report['repeats']} pairs, order alternating",
        f"{'method':8} {'first step':>11} {'(fwd/bwd/optim)':>19} {'steady':>10} {'graph breaks':>13} {'frames':>7} "
        f"{'recompiles':>11}   (medians)",
    ]
    for name, m in report["methods"].items():
        phases = "/".join(f"{t:.2f}" for t in m["first_phases_s"])
        lines.append(
            f"{name:8} {m['first_median_s']:10.2f}s {phases:>19} {m['steady_median_s'] * 1e3:8.1f}ms "
            f"{m['graph_breaks']:13d} {m['frames']:7d} {m['recompiles']:11d}"
        )
    r = report["ratios"]
    pairs = " ".join(f"{x:.2f}" for x in report["first_ratios"])
    lines.append(
        f"ours / fsdp2: first step median {r['first_step_median']:.2f}x, max {r['first_step_max']:.2f}x "
        f"(target <= 1.2x in every pair; pairs: {pairs}); steady step median {r['steady_step_median']:.2f}x"
    )
    lines.append(
        f"first step CPU time (rank 0 and its compiler processes): ours / fsdp2 median "
        f"{r['first_step_cpu_median']:.2f}x, max {r['first_step_cpu_max']:.2f}x (pairs: "
        + " ".join(f"{x:.2f}" for x in report["first_cpu_ratios"]) + "); compiled (ops captured, graphs, "
        f"kernels): " + ", ".join(f"{n} {tuple(m['compiled'].values())}" for n, m in report["methods"].items())
    )
    lines.append(f"max |loss difference| between the methods: {report['max_loss_diff']:.3g}")
    return "\n".join(lines)


def _measure_and_save(args: argparse.Namespace, name: str, out: str) -> None:
    """Every rank measures ``name``; rank 0 writes the result to ``out`` (JSON)."""
    result = run_method(args, name)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))


def _launch(args: argparse.Namespace, name: str, scratch: Path) -> dict:
    """``name`` measured by ``args.world`` fresh ranks with a fresh inductor cache directory."""
    cache = tempfile.mkdtemp(prefix=f"inductor-{name}-", dir=scratch)
    out = scratch / f"{Path(cache).name}.json"
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # inherited by the spawned ranks
    try:
        launch.spawn(args.world, _measure_and_save, args, name, str(out))
    finally:
        if saved is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    return json.loads(out.read_text())


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to launch per method")
    parser.add_argument("--steps", type=int, default=5, help="steady steps per method (default 5)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of fresh launches, order alternating (default 3)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768, help="SwiGLU hidden width")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("world", "steps", "repeats", "layers", "dim", "heads", "hidden", "vocab", "seq", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        parser.error("--dim must be a multiple of --heads with an even quotient (rotary embeddings)")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if launch.under_torchrun():
        raise SystemExit("bench_compile launches its own fresh ranks per method; run it with python3, not torchrun")
    pairs = []
    with tempfile.TemporaryDirectory(prefix="bench_compile-") as scratch:
        for k in range(args.repeats):
            order = METHODS if k % 2 == 0 else tuple(reversed(METHODS))
            pairs.append({name: _launch(args, name, Path(scratch)) for name in order})
    for k, pair in enumerate(pairs):  # each launch, in the order run
        for name, r in pair.items():
            print(f"pair {k} {name:6} first step {r['first_s']:7.2f}s wall, {r['first_cpu_s']:7.2f}s CPU", flush=True)
    print(format_report(summarize(pairs, args.backend, args.world)), flush=True)


if __name__ == "__main__":
    main()
