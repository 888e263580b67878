"""``bench_fsdp --counts``: the collectives of one training step, counted for ours (both layouts)
and torch FSDP2 on each model of :data:`tools.step_bench.methods.MODELS`: no timing, a couple of
steps per method, so it is quick and its figures do not depend on the machine's load.

A collective is what the step asks for (:class:`tools.kit.comm.CommCounter`'s ``collectives``:
one ``dbuffer.collectives`` call of ours is one all-gather or reduce-scatter, whatever c10d calls
carry it on gloo; FSDP2 calls c10d directly). The issue's rule is that ours makes no more
all-gathers, reduce-scatters or collectives in all than FSDP2 on every model: the head-only root
(a root whose gradients are done first in backward, where prefetching it again is a wasted
gather) and the tensor-subclass weights (gathered through ``fsdp_pre_all_gather``) are the two
shapes where ours once made more.
"""

from __future__ import annotations

import dataclasses
import gc

import torch
import torch.distributed as dist

from tests.models.llama import Llama
from tools.kit.comm import CommCounter
from tools.step_bench.methods import MODELS, BenchConfig, build_method, check_config, make_batches, model_config

COUNT_METHODS = ("ours", "row", "fsdp2")
# The kinds a table column each; anything else (broadcast, all-to-all, point-to-point outside the
# library, barrier) is summed as "other".
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MIB = 1 << 20


def run_counts(cfg: BenchConfig | dict, models: tuple = tuple(MODELS), methods: tuple = COUNT_METHODS) -> dict:
    """Per dtype mode of ``cfg`` and model: each method built, ``cfg.warmup`` steps, then one
    counted step. Every rank of the initialised process group returns the same dict: per mode,
    model and method, the collectives by kind and the c10d ops, calls and bytes sent (each the
    largest over the ranks), the first loss, and whether every rank counted the same."""
    from torch.distributed.device_mesh import init_device_mesh

    if isinstance(cfg, dict):
        cfg = BenchConfig(**cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    counter = CommCounter()
    counter.install()
    out: dict = {"world": world, "backend": str(dist.get_backend()), "torch": torch.__version__,
                 "config": dataclasses.asdict(cfg), "methods": list(methods), "modes": {}}
    try:
        for mode in cfg.dtypes:
            by_model = out["modes"][mode] = {}
            for model in models:
                mcfg = dataclasses.replace(cfg, model=model, methods=tuple(methods))
                check_config(mcfg)
                by_model[model] = _count_model(mcfg, mode, mesh, counter, rank, world)
    finally:
        counter.uninstall()
    return out


def _count_model(cfg: BenchConfig, mode: str, mesh, counter: CommCounter, rank: int, world: int) -> dict:
    torch.manual_seed(cfg.seed)
    base = Llama(model_config(cfg))
    batches = make_batches(cfg, cfg.warmup + 1, rank, world)
    losses = {}
    for name in cfg.methods:
        method = build_method(name, base, mode, cfg, mesh)
        for i in range(cfg.warmup):
            method.step(batches[i])
        dist.barrier()
        with counter.counting(name):
            losses[name] = method.step(batches[-1]).item()
        del method
        gc.collect()
    stats_by_rank = [None] * world
    dist.all_gather_object(stats_by_rank, {n: counter.stats.get(n) for n in cfg.methods})
    counter.stats.clear()
    result = {}
    for name in cfg.methods:
        per_rank = [s[name] or _EMPTY for s in stats_by_rank]
        kinds = sorted({k for s in per_rank for k in s["collectives"]})
        result[name] = {
            "collectives": {k: max(s["collectives"].get(k, 0) for s in per_rank) for k in kinds},
            "library_ops": max(s["library_ops"] for s in per_rank),
            "ops": max(s["ops"] for s in per_rank),
            "calls": max(s["calls"] for s in per_rank),
            "bytes_sent": max(s["bytes_sent"] for s in per_rank),
            "same_on_every_rank": all(s["collectives"] == per_rank[0]["collectives"] for s in per_rank),
            "loss": losses[name],
        }
    return result


_EMPTY = {"calls": 0, "ops": 0, "bytes_sent": 0.0, "by_kind": {}, "collectives": {}, "library_ops": 0}


def split_kinds(collectives: dict) -> dict:
    """``collectives`` by :data:`KINDS`, the rest summed as ``other``, and ``all``."""
    out = {k: collectives.get(k, 0) for k in KINDS}
    out["other"] = sum(n for k, n in collectives.items() if k not in KINDS)
    out["all"] = sum(collectives.values())
    return out


def excess(ours: dict, fsdp2: dict) -> list[str]:
    """Where ``ours`` (a method's counts) makes more collectives than ``fsdp2``: ``kind a > b``."""
    a, b = split_kinds(ours["collectives"]), split_kinds(fsdp2["collectives"])
    return [f"{k} {a[k]} > {b[k]}" for k in (*KINDS, "all") if a[k] > b[k]]


def format_counts(report: dict) -> str:
    cfg = report["config"]
    lines = [f"Collectives per training step (one step after {cfg['warmup']} warmup; world {report['world']}, "
             f"{report['backend']}, torch {report['torch']}; Llama vocab {cfg['vocab']}, dim {cfg['dim']}, "
             f"{cfg['layers']} layers; ours = FSDP2's torch.chunk layout, row = layout_policy('auto'))"]
    for mode, by_model in report["modes"].items():
        lines.append(f"\n== {mode} ==")
        head = (f"  {'model':<10}{'method':<7}{'all-gather':>11}{'reduce-scatter':>15}{'all-reduce':>11}{'other':>6}"
                f"{'all':>5}{'c10d ops':>9}{'calls':>7}{'MiB sent':>10}{'loss':>9}")
        lines += [head, "  " + "-" * (len(head) - 2)]
        for model, methods in by_model.items():
            for j, (name, m) in enumerate(methods.items()):
                k = split_kinds(m["collectives"])
                lines.append(f"  {model if j == 0 else '':<10}{name:<7}{k['all_gather']:>11}{k['reduce_scatter']:>15}"
                             f"{k['all_reduce']:>11}{k['other']:>6}{k['all']:>5}{m['ops']:>9}{m['calls']:>7}"
                             f"{m['bytes_sent'] / MIB:>10.2f}{m['loss']:>9.4f}")
        lines.append("")
        for model, methods in by_model.items():
            if "fsdp2" not in methods:
                continue
            verdicts = []
            for name in (n for n in methods if n != "fsdp2"):
                over = excess(methods[name], methods["fsdp2"])
                verdicts.append(f"{name} " + ("<= FSDP2 in every kind" if not over else "MORE than FSDP2: " + ", ".join(over)))
            uneven = [n for n, m in methods.items() if not m["same_on_every_rank"]]
            lines.append(f"  {model}: " + "; ".join(verdicts) + (f" (ranks differ: {', '.join(uneven)})" if uneven else ""))
    return "\n".join(lines)
