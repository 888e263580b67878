"""Memory per rank of a training step, fsdp against torch FSDP2, with each framework's defaults.

    python3 tools/bench_memory.py                          # a BF16-built Llama, fake world 8
    python3 tools/bench_memory.py --built fp32 --world 64  # any world: shapes and memory are real

Why: what a rank holds depends on the dtypes a framework picks when the user sets no policy. A
model built in BF16 (``from_pretrained(..., dtype=torch.bfloat16)``) gets BF16 weights, gradients
and AdamW state under FSDP2, and FP32 main weights (and so FP32 main grads and AdamW state) with
BF16 compute under fsdp. This process plays rank 0 of torch's fake process group (collectives do
nothing, every buffer is allocated as on a real rank), builds the same Llama for each method,
shards it per block and on the root with no ``mp_policy``, trains two AdamW steps and measures the
third with :class:`tools.kit.memory.StorageTracker`: the bytes held when the step starts (weights,
optimizer state; fsdp's main grads too, which it frees at the next forward's start after
``zero_grad()`` dropped them) and the peak during it, against the plain unsharded model in the same
dtype (the floor, as if one rank held everything). Printed: both per method and ours/FSDP2.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools.kit.memory import StorageTracker, live_storages  # noqa: E402
from tools.kit.results import describe_host, host_info  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
METHODS = ("ours", "fsdp2", "floor")


def _build(name: str, cfg, dtype: torch.dtype, mesh) -> torch.nn.Module:
    from tests.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(cfg).to(dtype)
    if name == "floor":
        return model
    if name == "ours":
        from fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def measure(cfg, dtype: torch.dtype, world: int, batch: int, steps: int = 2) -> dict[str, dict[str, int]]:
    """Per method: ``start`` (bytes held when the measured step begins) and ``peak`` (during it),
    as rank 0 of a fake world of ``world``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.models.llama import loss_fn

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(0))
        out = {}
        for name in METHODS:
            gc.collect()
            before = live_storages()
            model = _build(name, cfg, dtype, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step() -> None:
                loss_fn(model(tokens[:, :-1]), tokens).backward()
                opt.step()
                opt.zero_grad()

            for _ in range(steps):
                step()
            tracker = StorageTracker()
            tracker.track_new(before)
            start = tracker.current
            with tracker:
                step()
            out[name] = {"start": start, "peak": tracker.peak}
            del model, opt, tracker, before
        return out
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    from tests.models.llama import LlamaConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--built", choices=tuple(DTYPES), default="bf16", help="the dtype the model is built in")
    parser.add_argument("--world", type=int, default=8, help="ranks of the fake world (this process is rank 0)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences on this rank")
    args = parser.parse_args(argv)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=args.hidden, max_seq_len=args.seq)
    result = measure(cfg, DTYPES[args.built], args.world, args.batch)
    print(f"host: {describe_host({'host': host_info()})}")
    print(f"Llama built in {args.built}, {args.layers} blocks, dim {args.dim}; no mp_policy; fake world {args.world}, "
          f"rank 0; AdamW; batch {args.batch} x {args.seq}")
    print(f"{'method':8} {'held at step start MiB':>24} {'peak in step MiB':>18}")
    for name, r in result.items():
        print(f"{name:8} {r['start'] / 2**20:24.2f} {r['peak'] / 2**20:18.2f}")
    ours, theirs = result["ours"], result["fsdp2"]
    print(f"ours/FSDP2: held {ours['start'] / theirs['start']:.2f}, peak {ours['peak'] / theirs['peak']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
