"""Which files of fsdp/ and dbuffer/ one steady training step runs through.

    python3 tools/step_files.py                 # ZeRO-3, the default chunked layout, fp32
    python3 tools/step_files.py --mode bf16     # BF16 compute, FP32 main weights and grads
    python3 tools/step_files.py --functions     # also each file's functions, by calls

A step is ``loss = model(x); loss.backward(); opt.step(); opt.zero_grad()`` with
``torch.optim.AdamW`` on a small Llama whose blocks and root went through ``fully_shard``, on
rank 0 of torch's fake process group (world 8: every framework line runs, collectives do
nothing). After two warm-up steps, ``sys.setprofile`` records every Python function called during
one step; the report lists the files of this repository's ``fsdp/`` and ``dbuffer/`` those
functions live in, by calls. It is the reading behind CONTRIBUTING's "A step, top-down": a step
that needs many files to read is one a change has to cross many files for.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools.kit.results import describe_host, host_info  # noqa: E402
from tools.step_bench.methods import BenchConfig, build_method, make_batches, model_config  # noqa: E402

PACKAGES = ("fsdp", "dbuffer")


def record_step(mode: str, world: int) -> collections.Counter:
    """Calls per (file, function) under PACKAGES during one steady step of ``ours``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.models.llama import Llama

    cfg = BenchConfig(model="llama", warmup=2, steps=1, dim=64, hidden=128, heads=4, vocab=256, seq=16, batch=1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(cfg.seed)
        method = build_method("ours", Llama(model_config(cfg)), mode, cfg, mesh)
        batches = make_batches(cfg, cfg.warmup + 1, 0, world)
        for tokens in batches[: cfg.warmup]:
            method.step(tokens)
        roots = {str(ROOT / package) + "/": package for package in PACKAGES}
        calls: collections.Counter = collections.Counter()

        def profiler(frame, event, arg):
            if event != "call":
                return
            path = frame.f_code.co_filename
            for root, package in roots.items():
                if path.startswith(root):
                    calls[(package + "/" + path[len(root):], frame.f_code.co_name)] += 1
                    return

        previous = sys.getprofile()
        sys.setprofile(profiler)
        try:
            method.step(batches[cfg.warmup])
        finally:
            sys.setprofile(previous)
        return calls
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("fp32", "bf16"), default="fp32", help="compute dtype")
    parser.add_argument("--world", type=int, default=8, help="fake world size")
    parser.add_argument("--functions", action="store_true", help="list each file's functions too")
    args = parser.parse_args()
    calls = record_step(args.mode, args.world)
    by_file: collections.Counter = collections.Counter()
    for (path, _), n in calls.items():
        by_file[path] += n
    print(f"# files one steady ZeRO-3 step runs through ({args.mode}, fake world {args.world})")
    print(f"# {describe_host({'host': host_info()})}")
    for path, n in by_file.most_common():
        print(f"{n:7d}  {path}")
        if args.functions:
            for (where, name), k in sorted(calls.items(), key=lambda kv: -kv[1]):
                if where == path:
                    print(f"         {k:7d}  {name}")
    per_package = {p: sum(1 for f in by_file if f.startswith(p + "/")) for p in PACKAGES}
    print(f"files: {len(by_file)} ({', '.join(f'{p} {n}' for p, n in per_package.items())})")


if __name__ == "__main__":
    main()
