"""Writes tests/data/legacy_92f3820/: checkpoints saved by the code *before* fsdp/ moved into
subpackages (main at 92f3820), which test_legacy_checkpoints.py loads with today's code.

Kept to document how the data was made; run it from a checkout of that commit:
``git worktree add /tmp/old 92f3820 && cd /tmp/old && python <this file> <out dir>``.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

import fsdp.checkpoint as ckpt
from fsdp.layout_choice import layout_policy
from tests.fsdp.models import full_state, make_batches, make_model, train
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks


def _save(out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for layout in ("chunk", "row"):
        with layout_policy(layout):
            m = shard(copy.deepcopy(make_model()), True)
        opts: list = []
        train(m, make_batches(2), rank=rank, world=world, make_opt=lambda ps: opts.append(torch.optim.AdamW(ps, lr=1e-2)) or opts[-1])
        opt = opts[-1]
        msd, osd = ckpt.get_state_dict(m, opt)
        ckpt.save({"model": msd, "optim": osd}, os.path.join(out, layout))
        # the sharded parameters themselves, pickled (RowShardedDTensor in the row layout)
        torch.save({n: p.detach().clone() for n, p in m.named_parameters()}, os.path.join(out, f"{layout}_params_rank{rank}.pt"))
        full = full_state(m)
        if rank == 0:
            torch.save(full, os.path.join(out, f"{layout}_full.pt"))
        dist.barrier()


if __name__ == "__main__":
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    run_ranks(_save, 2, out, backend="gloo")
