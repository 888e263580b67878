"""tools/bench_host.py on a tiny Llama at fake world 4: every method's row and phase, both ratios
against FSDP2 with their verdicts, and ours' fsdp:: ranges per unit, where each unit's forward and
backward hooks run once per step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--layers", "3", "--heads", "2", "--hidden", "64", "--vocab", "128", "--seq", "16",
        "--batch", "2", "--steps", "2", "--warmup", "1", "--world", "4"]


def test_bench_host_reports_every_method_phase_and_range() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_host.py"), *TINY], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "fake world of 4" in out and "avx512f" in out, out[:500]
    for mode in ("fp32", "bf16"):
        section = out.split(f"== {mode}:")[1].split("== ")[0]
        assert "(4 units;" in section, section
        rows = {m.group(1): [float(x) for x in m.group(2).split()]
                for m in re.finditer(r"^  (ours|row|fsdp2|flat)\s+(\S+\s+\S+\s+\S+\s+\S+\s+\S+)$", section, re.M)}
        assert set(rows) == {"ours", "row", "fsdp2", "flat"}, section
        for name, (total, forward, backward, optimizer, ratio) in rows.items():
            assert abs(total - (forward + backward + optimizer)) < 2e-3, (name, rows[name])
            assert abs(ratio - total / rows["fsdp2"][0]) < 0.01, (name, rows[name])
        assert rows["fsdp2"][-1] == 1.0
        for name in ("ours", "row", "flat"):
            assert re.search(rf"target host overhead per unit {name}/FSDP2 <= 0.5: [\d.-]+ (MET|MISSED)", section)
        cycle = re.search(r"unshard\(\)\+reshard\(\), host us: ours ([\d.]+) warm, ([\d.]+) after a 16 MiB cache flush; "
                          r"FSDP2 ([\d.]+) warm, ([\d.]+) flushed; ours/FSDP2 ([\d.]+) warm, ([\d.]+) flushed", section)
        assert cycle, section
        ours_warm, ours_cold, fsdp2_warm, fsdp2_cold, warm, cold = (float(x) for x in cycle.groups())
        assert min(ours_warm, ours_cold, fsdp2_warm, fsdp2_cold) > 0, cycle.group(0)
        assert abs(warm - ours_warm / fsdp2_warm) < 0.01 and abs(cold - ours_cold / fsdp2_cold) < 0.01, cycle.group(0)
        ranges = {m.group(1): float(m.group(2)) for m in re.finditer(r"(fsdp::\w+)\s+([\d.]+)\s+[\d.]+", section)}
        # every unit (3 blocks + the root) enters its forward and backward hooks once per step
        assert ranges["fsdp::pre_forward"] == ranges["fsdp::post_forward"] == ranges["fsdp::pre_backward"] == 1.0, ranges
        assert abs(ranges["fsdp::root_pre_forward"] - 0.25) <= 0.05, ranges  # once per step, 4 units (1 decimal)


def test_each_mode_starts_with_empty_sharding_caches() -> None:
    """A DTensor op's sharding, cached in Python and in the C++ fast path, is forgotten before a
    mode is measured (entries of an earlier mode's destroyed mesh would be compared at lookups)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tools.bench_host import forget_sharding_caches

    cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", lambda: (0, 0))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        t = distribute_tensor(torch.ones(8, 2), init_device_mesh("cpu", (4,)), [Shard(0)])
        torch._foreach_add_([t], [t * 2])
        torch._foreach_mul_([t], 3.0)
    finally:
        dist.destroy_process_group()
    assert cached.cache_info().currsize + sum(stats()) > 0, "the ops above cached nothing to forget"
    forget_sharding_caches()
    assert cached.cache_info().currsize == 0 and sum(stats()) == 0
