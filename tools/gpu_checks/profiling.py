"""Item 5: what a profiler sees of fsdp's training steps, and on CUDA which streams did the work.

Two steps of the matrix's Llama (``fully_shard`` per block and root, world 1 with
``singleton_groups_communicate`` on, so the NCCL kernels run) under ``torch.profiler``: the first
with lazy initialisation, then ``reset_iter_state()``, then a steady one ended by
``finalize_backward()`` (manual backward finalization, as a pipeline schedule ends a step). Reported: every ``fsdp::``
``record_function`` range seen, by phase (the unit's name dropped) with its count; checked: every
phase label fsdp defines (``fsdp.unit.state.LABELS`` and the parameter groups' labels) appears,
as tests/fsdp/test_profiler_labels.py requires on gloo.

On CUDA also the device side, from the exported trace's kernel, memcpy and memset events (their
``stream`` argument): per kind (``comm``: the collectives' work, ``copy``, ``compute``; see
:func:`kernel_streams`) the streams it ran on, with event counts. Checked: collective work ran,
none of it on the stream where most compute ran (c10d runs NCCL on its own stream, ordered after
fsdp's side streams, group/streams.py), and compute ran.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter

import torch

from tools.gpu_checks import common
from tools.gpu_checks.common import Context, Setup, move
from tools.gpu_checks.rows import Row

GROUP_LABELS = ("fsdp::all_gather", "fsdp::copy_out", "fsdp::reduce_scatter", "fsdp::optimizer_refresh")
_UNIT_SUFFIX = re.compile(r" \([^()]*\)$")  # "fsdp::pre_forward (layers.0)": the unit's name
_COPY = re.compile(r"copy|Copy|CatArray|cat_|memcpy|Memcpy|memset|Memset")
_COMM_OP = re.compile(r"c10d::|nccl:|gloo:|record_param_comms")


def names(setup: Setup) -> list[str]:
    return ["fsdp:: ranges"] + (["cuda streams"] if setup.cuda else []) + ["no host sync in a step"]


def kernel_streams(trace: dict) -> dict[str, dict[str, int]]:
    """Per kind: {stream id: device events} of a chrome trace (``torch.profiler``'s export).

    ``comm``: launched from inside a c10d collective (a CPU op ``c10d::...``, ``nccl:...``,
    ``record_param_comms``; matched through the runtime call's ``correlation``), or any kernel
    named ``nccl...``: a collective's work whatever NCCL runs for it (a group of one copies with a
    memcpy rather than a kernel). ``copy``: other memcpy / memset events and copy or concatenation
    kernels. ``compute``: every other kernel."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    spans: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op" and _COMM_OP.match(str(e.get("name", ""))):
            spans.setdefault(e.get("tid"), []).append((e.get("ts", 0), e.get("ts", 0) + e.get("dur", 0)))
    launched_in_comm = set()
    for e in events:
        if str(e.get("cat", "")) in ("cuda_runtime", "cuda_driver"):
            ts = e.get("ts", 0)
            if any(lo <= ts <= hi for lo, hi in spans.get(e.get("tid"), ())):
                launched_in_comm.add((e.get("args") or {}).get("correlation"))
    launched_in_comm.discard(None)
    out: dict[str, Counter] = {"comm": Counter(), "copy": Counter(), "compute": Counter()}
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args") or {}
        name = str(e.get("name", ""))
        if "nccl" in name.lower() or args.get("correlation") in launched_in_comm:
            kind = "comm"
        elif cat != "kernel" or _COPY.search(name):
            kind = "copy"
        else:
            kind = "compute"
        out[kind][str(args.get("stream"))] += 1
    return {kind: dict(sorted(c.items())) for kind, c in out.items()}


def _profiled(setup: Setup, mesh) -> tuple[dict, dict]:
    """Two profiled steps: (fsdp:: phase -> count, the trace as a dict or {} on the CPU)."""
    import fsdp
    from torch.profiler import ProfilerActivity, profile

    model = move(common.base_model(setup), setup)
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    opt = common.adamw(setup)(model)
    batches = common.text_batches(setup, 2)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.cuda else [])
    with profile(activities=activities) as prof:
        common.train(model, opt, batches[:1])
        model.reset_iter_state()
        model.set_manual_backward_finalization(True)  # a pipeline schedule's end of backward
        common.train(model, opt, batches[1:], finalize=model.finalize_backward)
        model.set_manual_backward_finalization(False)
        if setup.cuda:
            torch.cuda.synchronize()
    cpu = torch.autograd.DeviceType.CPU  # not the device-side copies of the same annotations
    phases = Counter(_UNIT_SUFFIX.sub("", e.name) for e in prof.events()
                     if e.name.startswith("fsdp::") and getattr(e, "device_type", cpu) == cpu)
    trace: dict = {}
    if setup.cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
    return dict(sorted(phases.items())), trace


def run(ctx: Context) -> None:
    from dbuffer.collectives import singleton_groups_communicate
    from fsdp.unit.state import LABELS

    setup = ctx.setup
    cache: dict = {}

    def profiled() -> tuple[dict, dict]:  # once for both rows (again if it raised)
        if "run" not in cache:
            cache["run"] = _profiled(setup, mesh)
        return cache["run"]

    def ranges(row: Row) -> None:
        phases, _ = profiled()
        row.figures["fsdp:: ranges"] = phases
        missing = [label for label in LABELS + GROUP_LABELS if label not in phases]
        row.check("fsdp:: phases missing", len(missing), 0, op="==")
        if missing:
            row.note = f"missing: {', '.join(missing)}"

    def streams(row: Row) -> None:
        by_kind = kernel_streams(profiled()[1])
        row.figures["streams {id: events}"] = by_kind
        compute = by_kind["compute"]
        main = max(compute, key=compute.get) if compute else None
        row.check("compute kernels", sum(compute.values()), 0, op=">")
        row.check("collective work", sum(by_kind["comm"].values()), 0, op=">")
        row.check("collective work on the main compute stream", by_kind["comm"].get(main, 0), 0, op="==")
        row.figures["main compute stream"] = main

    with common.world_one(setup) as mesh, singleton_groups_communicate():
        ctx.row("fsdp:: ranges", ranges)
        if setup.cuda:
            ctx.row("cuda streams", streams)
        ctx.row("no host sync in a step", lambda row: _no_host_sync(row, setup, mesh))


def _no_host_sync(row: Row, setup: Setup, mesh) -> None:
    """Two steady ZeRO-3 bf16 steps (micro-batches, AdamW) with nothing on the host waiting for
    the device: under ``torch.cuda.set_sync_debug_mode("error")`` on CUDA (any synchronising
    call raises), under the CPU seam ``tests/models/device_standins.py``'s ``SyncCounter``
    (every aten op that needs a device value on the host counted) with ``--cpu``."""
    import fsdp
    from tests.models.device_standins import SyncCounter
    from tests.models.llama import loss_fn

    model = move(common.base_model(setup), setup)
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fsdp.fully_shard(block, mesh=mesh, mp_policy=policy)
    fsdp.fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = common.adamw(setup)(model)
    batches = common.text_batches(setup, 3)

    def step(tokens):
        for part in tokens.chunk(2):
            (loss_fn(model(part[:, :-1]), part) / 2).backward()
        opt.step()
        opt.zero_grad()

    step(batches[0])  # lazy initialisation first
    if setup.cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for tokens in batches[1:]:
                step(tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        row.check("steps under set_sync_debug_mode('error')", len(batches) - 1, len(batches) - 1, op="==")
        return
    counter = SyncCounter()
    with counter:
        for tokens in batches[1:]:
            step(tokens)
    row.figures["syncing calls"] = counter.calls
    row.check("syncing calls in 2 steps", sum(counter.calls.values()), 0, op="==")
