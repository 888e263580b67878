"""Float8 all-gather against bf16 all-gather, fsdp against torch FSDP2, in one run.

    python3 tools/bench_fp8_gather.py                  # 2 gloo ranks, a small MLP stack
    python3 tools/bench_fp8_gather.py --dim 1024 --layers 8 --steps 20

Four methods train the same model (blocks of Linear(d, 4d) -> ReLU -> Linear(4d, d), no bias;
``fully_shard`` per block and on the root, ZeRO-3, AdamW, compute in bf16, gradients reduced in
fp32):

* ``ours bf16`` / ``fsdp2 bf16``: plain weights, ``MixedPrecisionPolicy(param_dtype=bf16)``;
* ``ours fp8`` / ``fsdp2 fp8``: every weight a
  :class:`tests.models.float8_weight.Float8RowwiseWeight`, whose ``fsdp_pre_all_gather`` sends
  float8 data plus one fp32 scale per row.

Per method, measured on the counted steps (after the warm-up), rank 0 prints: the median step
time, the bytes this rank sends in all-gathers per step (counted at the c10d calls with
:class:`tools.kit.comm.CommCounter`), the reduce-scatter bytes, and the float8 casts per step
(``fsdp_pre_all_gather`` calls: fsdp casts once per optimizer step, FSDP2 at every gather, i.e.
forward and backward under ZeRO-3, times the micro-batches). Methods run interleaved, one step
each per round, so machine noise hits them alike; read ratios, not absolute times. The first
losses of each pair (same weights, same batch) are printed side by side as a sanity check.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from tests.models.float8_weight import cast_count, float8_weights  # noqa: E402
from tools.kit import launch  # noqa: E402
from tools.kit.comm import CommCounter  # noqa: E402

METHODS = ("ours bf16", "ours fp8", "fsdp2 bf16", "fsdp2 fp8")
DEFAULTS = dict(dim=256, layers=4, batch=16, micro=1, steps=10, warmup=2, seed=0)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def make_model(cfg: dict) -> nn.Sequential:
    torch.manual_seed(cfg["seed"])
    return nn.Sequential(*[Block(cfg["dim"]) for _ in range(cfg["layers"])])


class Method:
    """One sharded copy of the model, its optimizer and its measurements."""

    def __init__(self, name: str, base: nn.Module) -> None:
        import fsdp
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        self.name = name
        model = float8_weights(base) if name.endswith("fp8") else copy.deepcopy(base)
        if name.startswith("ours"):
            policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            shard = lambda m: fsdp.fully_shard(m, mp_policy=policy)  # noqa: E731
        else:
            policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            shard = lambda m: torch_fully_shard(m, mp_policy=policy)  # noqa: E731
        for block in model:
            shard(block)
        self.model = shard(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times_ms: list[float] = []
        self.casts: list[int] = []
        self.losses: list[float] = []

    def step(self, batches: list[torch.Tensor], timed: bool) -> None:
        dist.barrier()
        casts, start = cast_count(), time.perf_counter()
        loss = 0.0
        for x in batches:
            out = self.model(x.to(torch.bfloat16))
            l = out.float().square().mean()  # noqa: E741
            l.backward()
            loss += l.item()
        self.opt.step()
        self.opt.zero_grad()
        elapsed = (time.perf_counter() - start) * 1e3
        self.losses.append(loss)
        if timed:
            self.times_ms.append(elapsed)
            self.casts.append(cast_count() - casts)


def run_benchmark(cfg: dict) -> dict[str, Any]:
    """Every rank of an initialised process group runs this; every rank returns the report."""
    cfg = dict(DEFAULTS, **cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_model(cfg)
    methods = [Method(name, base) for name in METHODS]
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    steps = cfg["warmup"] + cfg["steps"]
    data = [torch.randn(cfg["batch"] * world, cfg["dim"], generator=g) for _ in range(steps)]
    counter = CommCounter()
    counter.install()
    try:
        for step, x in enumerate(data):
            mine = x.chunk(world)[rank].chunk(cfg["micro"])
            timed = step >= cfg["warmup"]
            for m in methods:  # interleaved: one step of each per round
                if timed:
                    with counter.counting(m.name):
                        m.step(list(mine), timed)
                else:
                    m.step(list(mine), timed)
    finally:
        counter.uninstall()
    report: dict[str, Any] = {"config": cfg, "world": world, "methods": {}}
    for m in methods:
        stats = counter.stats.get(m.name, {"by_kind": {}})
        kinds = stats["by_kind"]
        gather = kinds.get("all_gather", {}).get("bytes_sent", 0.0)
        # dbuffer sends large gloo gathers point to point; FSDP2 never does: count them as gathers
        gather += kinds.get("p2p_send", {}).get("bytes_sent", 0.0)
        report["methods"][m.name] = {
            "median_ms": statistics.median(m.times_ms),
            "times_ms": m.times_ms,
            "gather_bytes_per_step": gather / cfg["steps"],
            # dbuffer reduce-scatters on gloo as all-to-all + a local sum
            "reduce_bytes_per_step": sum(kinds.get(k, {}).get("bytes_sent", 0.0) for k in ("reduce_scatter", "all_to_all"))
            / cfg["steps"],
            "casts_per_step": statistics.median(m.casts),
            "losses": m.losses,
            "weights": sum(1 for _ in m.model.parameters()),
        }
    r = report["methods"]
    report["ratios"] = {
        "ours fp8/bf16 gather bytes": r["ours fp8"]["gather_bytes_per_step"] / r["ours bf16"]["gather_bytes_per_step"],
        "fsdp2 fp8/bf16 gather bytes": r["fsdp2 fp8"]["gather_bytes_per_step"] / r["fsdp2 bf16"]["gather_bytes_per_step"],
        "ours fp8/bf16 step time": r["ours fp8"]["median_ms"] / r["ours bf16"]["median_ms"],
        "fsdp2 fp8/bf16 step time": r["fsdp2 fp8"]["median_ms"] / r["fsdp2 bf16"]["median_ms"],
        "ours/fsdp2 fp8 step time": r["ours fp8"]["median_ms"] / r["fsdp2 fp8"]["median_ms"],
    }
    return report


def format_report(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"world {report['world']} (gloo), {cfg['layers']} blocks of Linear({cfg['dim']}, {4 * cfg['dim']}) + "
        f"Linear({4 * cfg['dim']}, {cfg['dim']}), batch {cfg['batch']} rows per rank in {cfg['micro']} micro-batch(es), "
        f"{cfg['steps']} counted steps after {cfg['warmup']} warm-up",
        "",
        "| method | median step | all-gather sent/step | reduce-scatter sent/step | fp8 casts/step | first loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in report["methods"].items():
        lines.append(
            f"| {name} | {m['median_ms']:.1f} ms | {_size(m['gather_bytes_per_step'])} | "
            f"{_size(m['reduce_bytes_per_step'])} | {m['casts_per_step']:g} | {m['losses'][0]:.5f} |"
        )
    lines.append("")
    lines += [f"{k}: {v:.3f}" for k, v in report["ratios"].items()]
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _bench_and_report(cfg: dict) -> None:
    """Every rank benchmarks; rank 0 prints."""
    report = run_benchmark(cfg)
    if dist.get_rank() == 0:
        print(format_report(report), flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    args = parser.parse_args(argv)
    cfg = {k: getattr(args, k) for k in DEFAULTS}
    if cfg["batch"] % cfg["micro"]:
        parser.error("--micro must divide --batch")
    launch.spawn(args.world, _bench_and_report, cfg)


if __name__ == "__main__":
    main()
