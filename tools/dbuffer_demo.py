"""DBuffer demo: ZeRO-3 style data-parallel training written directly on DBuffer, on 2 CPU ranks.

    python3 tools/dbuffer_demo.py        # launches its own 2 gloo ranks
    torchrun --nproc-per-node 2 tools/dbuffer_demo.py

The README's demo (``tools/demo.py``) trains a Llama with ``fsdp.fully_shard``; this one shows
what such a library is built from, using the DBuffer primitives by hand on a small MLP.

Every rank keeps only its shard of the weights (``Shard(0)``). Each step all-gathers them into a
reused full buffer, runs forward/backward on its own slice of the batch, writes the gradients into
a ``Partial("avg")`` buffer, reduce-scatters that straight into the sharded gradient buffer and
takes an SGD step on its shard. The losses printed are those of the *global* batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402

from dbuffer import DBuffer, distribute_tensors  # noqa: E402
from tools.kit import launch  # noqa: E402


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    )


def train(steps: int, lr: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    params = list(model.parameters())
    shapes = [p.shape for p in params]

    weights = distribute_tensors([p.detach() for p in params], mesh, [Shard(0)])  # what a rank keeps
    full = DBuffer(mesh, [Replicate()], shapes, torch.float32)  # reused gather target
    grads_partial = DBuffer(mesh, [Partial("avg")], shapes, torch.float32)
    grads = DBuffer(mesh, [Shard(0)], shapes, torch.float32)
    for i, p in enumerate(params):  # the module computes with views of the full buffer
        p.data = full.get_local_tensor(i)

    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(1024, 16, generator=g)
    targets = torch.tanh(inputs @ torch.randn(16, 1, generator=g))
    mine = slice(rank * len(inputs) // world, (rank + 1) * len(inputs) // world)
    if rank == 0:
        layout = weights.layout
        print(
            f"{len(shapes)} tensors, {layout.data_numel} parameters, world {world}: "
            f"{weights.local_buffer.numel()} elements per rank, padding {layout.padding_fraction:.2%}"
        )
    reference = make_model()  # single-process training on the global batch, to compare against
    start = time.perf_counter()
    for step in range(steps):
        full.reallocate_storage()
        weights.allgather(0, out=full)  # unshard
        loss = torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine])
        model.zero_grad(set_to_none=True)
        loss.backward()
        full.release_storage()  # reshard: the full weights are gone until the next step
        for i, p in enumerate(params):
            grads_partial.get_local_tensor(i).copy_(p.grad)
        grads_partial.reduce_scatter(0, out=grads)  # mean over ranks, straight into the shard
        weights.local_buffer.add_(grads.local_buffer, alpha=-lr)
        if rank == 0:
            reference.zero_grad()
            torch.nn.functional.mse_loss(reference(inputs), targets).backward()
            with torch.no_grad():
                for p in reference.parameters():
                    p.add_(p.grad, alpha=-lr)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        if rank == 0 and (step % max(1, steps // 10) == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {global_loss.item() / world:.5f}")
    if rank == 0:
        elapsed = time.perf_counter() - start
        moved = 2 * weights.layout.total_numel * 4 * (world - 1) / world
        print(f"{steps} steps in {elapsed:.2f} s; about {moved / 1e6:.2f} MB sent per rank per step")
    final = weights.redistribute([Replicate()])
    if rank == 0:
        gap = max(
            (final.get_local_tensor(i) - p.detach()).abs().max().item() for i, p in enumerate(reference.parameters())
        )
        print(f"max |weight - single-process reference| after {steps} steps: {gap:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.3)
    args = parser.parse_args()
    if launch.under_torchrun():
        launch.run_rank(train, args.steps, args.lr, threads=None)  # torch's threads (OMP_NUM_THREADS)
    launch.spawn(args.world, train, args.steps, args.lr)


if __name__ == "__main__":
    main()
