"""Item 2: several ranks moving real data on one device, fsdp against torch FSDP2 and the plain model.

World 1 cannot show a bug in which rank holds which piece, or in how pieces of different ranks are
summed. One GPU can still run worlds of 2 and 4 as threads of one process on torch's threaded
process group (:mod:`tests.models.threads`), every rank on ``cuda:0`` (``cpu`` with ``--cpu``): the
collectives are the group's own copies between the ranks' tensors, not NCCL's, but every shard,
gather and reduction of fsdp runs with real values. Each row trains the Llama on text: the plain
model on the global batch (the reference), torch FSDP2 in the same harness (the control: a
problem of the harness or of threads on this torch shows in it too) and fsdp, each rank on its
slice of the batch; the two libraries run one after the other, each in its own threaded world.

An error on any rank is the row's error, as ``rank R of W (threaded) raised Type: message`` (with
every failed rank's traceback in the JSON): on torch 2.11 with CUDA this group was seen to crash
inside DTensor's sharding propagation during fsdp's fully_shard, and the GPU session must see
what raised where. FSDP2 failing is reported in its own check ("FSDP2 control ran").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from tools.gpu_checks import common
from tools.gpu_checks.common import Context, Setup, Trained, compare, full_state, loss_checks, move, train
from tools.gpu_checks.rows import Row


@dataclass(frozen=True)
class Case:
    """``world`` threaded ranks; ``precision``: fp32, bf16 or float8 (float8 all-gather weights,
    fp32 compute); ``raf``: reshard_after_forward; ``hsdp``: a (2, world / 2) replicate x shard mesh."""

    world: int
    precision: str = "fp32"
    raf: Any = True
    hsdp: bool = False

    @property
    def name(self) -> str:
        what = {"fp32": "fp32 ZeRO-3", "bf16": "bf16", "float8": "float8 all-gather"}[self.precision]
        if self.raf is not True:
            what = f"reshard_after_forward={self.raf}"
        if self.hsdp:
            what = f"hsdp 2x{self.world // 2}"
        return f"w{self.world} {what}"


CASES = [Case(2), Case(2, "bf16"), Case(2, "float8"), Case(4), Case(4, "bf16"), Case(4, raf=2), Case(4, hsdp=True)]


def names(setup: Setup) -> list[str]:
    return [c.name for c in CASES]


def _kwargs(lib: str, case: Case) -> dict:
    """The keyword arguments of ``lib``'s fully_shard for ``case`` (mesh aside)."""
    kw: dict[str, Any] = {"reshard_after_forward": case.raf}
    if case.precision == "bf16":
        if lib == "fsdp":
            import fsdp

            kw["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return kw


def _rank(lib: str, case: Case, setup: Setup, base: torch.nn.Module, batches: list) -> Trained:
    """One threaded rank: shard a copy of ``base`` with ``lib``, train on this rank's slices."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    if case.hsdp:
        mesh = init_device_mesh(setup.device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(setup.device, (world,))
    if lib == "fsdp":
        from fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    kw = _kwargs(lib, case)
    model = move(base, setup)
    for block in model.layers:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    norms: list = []
    losses = train(model, common.adamw(setup)(model), batches, rank=rank, world=world, norms=norms)
    return Trained(full_state(model), losses, norms)


def _run_world(lib: str, case: Case, setup: Setup, base, batches) -> tuple[Trained, bool]:
    """``lib`` on ``case.world`` threaded ranks: rank 0's weights and gradient norms with the
    global loss per step (the mean of the ranks' losses on equal slices), and whether every rank
    saw the same weights."""
    from tests.models.threads import run_threaded

    results = run_threaded(_rank, case.world, lib, case, setup, base, batches, timeout=240.0)
    agree = all(common.max_diff(r.state, results[0].state) == 0.0 for r in results[1:])
    losses = [sum(per_rank) / case.world for per_rank in zip(*(r.losses for r in results))]
    return Trained(results[0].state, losses, results[0].norms), agree


class Worlds:
    """The base weights, batches and single-process references shared by the rows."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.base = common.base_model(setup)
        self.start = full_state(self.base)
        self.batches = common.text_batches(setup)
        self._refs: dict[str, Trained] = {}

    def model(self, case: Case) -> torch.nn.Module:
        if case.precision == "float8":
            return common.float8(self.base, self.setup)
        return self.base

    def reference(self, case: Case) -> Trained:
        """The plain model on the global batch (straight-through float8 for the float8 rows)."""
        key = "float8" if case.precision == "float8" else "plain"
        if key not in self._refs:
            model = self.base
            if key == "float8":
                from tests.models.float8_weight import reference_float8_model

                model = reference_float8_model(self.base)
            model = move(model, self.setup)
            norms: list = []
            losses = train(model, common.adamw(self.setup)(model), self.batches, norms=norms)
            self._refs[key] = Trained(full_state(model), losses, norms)
        return self._refs[key]


def _row(w: Worlds, case: Case, row: Row) -> None:
    plain = w.reference(case)
    runs = {"plain": plain}
    fsdp2: Optional[Trained] = None
    try:
        fsdp2, fsdp2_agree = _run_world("fsdp2", case, w.setup, w.model(case), w.batches)
        runs["FSDP2"] = fsdp2
    except Exception as exc:  # noqa: BLE001 - the control's failure is this row's finding, fsdp still runs
        row.figures["FSDP2 error"] = str(exc)
        row.traceback = getattr(exc, "details", "") or str(exc)
    row.check("FSDP2 control ran", fsdp2 is not None, True, op="==")
    got, agree = _run_world("fsdp", case, w.setup, w.model(case), w.batches)
    runs["fsdp"] = got
    row.check("ranks agree", agree and (fsdp2 is None or fsdp2_agree), True, op="==")
    precision = "fp32" if case.precision == "float8" else case.precision
    compare(row, w.setup, f"{precision} w>1", got, plain, fsdp2, w.start)
    loss_checks(row, runs)


def run(ctx: Context) -> None:
    common.deterministic(ctx.setup)
    w = Worlds(ctx.setup)
    for case in CASES:
        ctx.row(case.name, lambda row, case=case: _row(w, case, row))
