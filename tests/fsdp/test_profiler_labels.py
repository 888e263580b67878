"""Profiler labels and debug logs: a profiled training step shows every phase fsdp runs, and lazy
initialisation logs the tree it found (fsdp/unit/state.py)."""

from __future__ import annotations

import copy
import logging
import re

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fsdp.unit.state import LABELS
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks

# The unit-level labels fsdp/unit/state.py adds, and the parameter groups' (fsdp/group/).
UNIT_LABELS = LABELS
GROUP_LABELS = ("fsdp::all_gather", "fsdp::copy_out", "fsdp::reduce_scatter", "fsdp::optimizer_refresh")
EXPECTED = UNIT_LABELS + GROUP_LABELS

_UNIT_SUFFIX = re.compile(r" \([^()]*\)$")  # "fsdp::pre_forward (blocks.0)": the unit's name


def _profiled_step(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    per = batches[0][0].shape[0] // world
    x, y = (t[rank * per : (rank + 1) * per] for t in batches[0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_fn(m, x, y).backward()  # the first step: lazy initialisation included
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            loss_fn(m, x, y)  # the next forward refreshes the weights the optimizer changed
        m.reset_iter_state()  # between steps it resets nothing, but runs (and is labelled)
        m.set_manual_backward_finalization(True)  # a pipeline schedule's end of backward
        loss_fn(m, x, y).backward()
        m.finalize_backward()
    names = {e.name for e in prof.events()}
    fsdp_names = sorted(n for n in names if n.startswith("fsdp::"))
    return {"phases": sorted({_UNIT_SUFFIX.sub("", n) for n in fsdp_names}), "names": fsdp_names}


def test_a_profiled_training_step_shows_every_phase() -> None:
    model, batches = make_model(), make_batches(1)
    for r in run_ranks(_profiled_step, 2, model, batches, backend="gloo"):
        missing = [label for label in EXPECTED if label not in r["phases"]]
        assert not missing, (missing, r["names"])
        # a unit below the root carries its name; the root's labels are bare
        assert "fsdp::pre_forward (blocks.1)" in r["names"] and "fsdp::pre_forward" in r["names"], r["names"]
        assert "fsdp::post_backward (blocks.0)" in r["names"], r["names"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _two_steps(model, batches) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True)
    per = batches[0][0].shape[0] // world
    for x, y in batches[:2]:
        loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()


def test_lazy_init_logs_the_tree_and_its_forward_order_at_debug_level() -> None:
    model, batches = make_model(), make_batches(2)
    logger, handler = logging.getLogger("fsdp"), _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        run_ranks(_two_steps, 2, model, batches, backend="threaded", timeout=60)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    init = [m for m in handler.messages if m.startswith("lazy init")]
    order = [m for m in handler.messages if m.startswith("forward order")]
    assert len(init) == 2 and len(order) == 2, handler.messages  # once per rank
    assert all("of 3 units ['<root>', 'blocks.0', 'blocks.1']" in m for m in init), init
    assert all(m.endswith("['<root>', 'blocks.0', 'blocks.1']") for m in order), order
