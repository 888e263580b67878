"""Abort rate at exit of scripts shaped like a framework's end, fsdp against torch FSDP2.

    python tests/dbuffer/exit_frameworks.py [--launches N] [--parallel P] [--impls fsdp,fsdp2,...]

Not a test (tests/dbuffer/test_teardown.py forces the race instead); a measurement. Each launch
forks two gloo ranks (after importing torch and fsdp once, as exit_race.py does) that run one of
two recipes and then leave through full interpreter finalisation, never calling
``dbuffer.teardown.shutdown``:

* ``trainer`` (Hugging Face ``Trainer`` through accelerate's FSDP2 plugin with
  ``cpu_ram_efficient_loading``): one ``fully_shard`` per block and the root, the full weights
  broadcast from rank 0 and loaded with ``distribute_tensor``, AdamW steps, metrics through
  ``all_gather_object``, the model, optimizer and a DTensor kept in a global (the ``trainer``
  object); every other launch calls ``destroy_process_group`` at the end, the others not.
* ``fabric`` (Lightning Fabric's ``ModelParallelStrategy``): a 2-D ``("data_parallel",
  "tensor_parallel")`` mesh, ``fully_shard`` on its data-parallel axis, gradient accumulation
  with ``set_requires_gradient_sync``, ``all_reduce`` of the loss and a barrier, the model and
  the mesh kept in a global; ``destroy_process_group`` every other launch.

* ``lightning-fabric``: Lightning Fabric itself (``lightning`` must be installed; the recipes
  above need nothing beyond torch): ``Fabric(accelerator="cpu", devices=2,
  strategy=ModelParallelStrategy(parallelize_fn))``, ``setup``, ``no_backward_sync``,
  ``backward``, ``all_reduce``, ``barrier``, a DCP checkpoint through ``fabric.save``, the
  ``fabric`` object and the model kept in a global; ``destroy_process_group`` every other launch.
  Each rank gets the environment torchrun would give it, so Fabric joins the group itself;
  fsdp's launches call ``fsdp.torch_names()`` first (Fabric imports torch's names when it
  calls them).

``--impls``: ``fsdp`` (fsdp's ``fully_shard``, with the exit guard ``import dbuffer`` registers),
``fsdp-unguarded`` (the same, the guard unregistered: the code before it), ``fsdp2`` (torch's
``fully_shard``; the guard unregistered, as a process that never imports dbuffer). Launches of
the implementations alternate in one loop. Prints one JSON line per recipe and implementation:
launches, aborted (a rank died of SIGABRT), failed (other bad exits).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.distributed.tensor import distribute_tensor  # noqa: E402

import fsdp  # noqa: E402
from dbuffer.teardown import exit_guard  # noqa: E402
from tests.dbuffer.exit_race import _describe, _free_port  # noqa: E402

WORLD = 2
_SCRATCH = os.path.join(tempfile.gettempdir(), f"exit_frameworks_{os.getpid()}")  # fabric.save's checkpoints
_KEPT: list = []  # what the framework object keeps until the interpreter ends


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)], nn.Linear(32, 4))


def _trainer(rank: int, shard) -> None:
    model = _model()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for block in model[:-1]:
        shard(block)
    shard(model)
    sharded = {}
    for name, piece in model.state_dict().items():  # fsdp2_load_full_state_dict
        value = full[name]
        dist.broadcast(value, src=0)
        sharded[name] = distribute_tensor(value, piece.device_mesh, piece.placements)
    model.load_state_dict(sharded, assign=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        logs: list = [None] * WORLD
        dist.all_gather_object(logs, {"loss": loss.item(), "step": step})  # the Trainer's metrics
    _KEPT.extend([model, opt, next(iter(model.parameters()))])


def _fabric(rank: int, shard) -> None:
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = _model()
    for block in model[:-1]:
        shard(block, mesh=mesh["data_parallel"])
    shard(model, mesh=mesh["data_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        for micro in range(2):  # fabric.no_backward_sync(model, enabled=micro == 0)
            model.set_requires_gradient_sync(micro == 1)
            torch.manual_seed(100 * step + 10 * micro + rank)
            loss = model(torch.randn(8, 32)).square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach())  # fabric.all_reduce
        dist.barrier()  # fabric.barrier
    _KEPT.extend([model, opt, mesh])


def _parallelize(model: nn.Module, device_mesh) -> nn.Module:
    """A ``parallelize_fn`` written for FSDP2 (torch's names, bound to fsdp's by ``torch_names``)."""
    from torch.distributed.fsdp import fully_shard

    for block in model[:-1]:
        fully_shard(block, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def _lightning_fabric(rank: int, port: int, impl: str, checkpoint: str) -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(WORLD))
    if impl != "fsdp2":
        fsdp.torch_names()
    strategy = ModelParallelStrategy(_parallelize, data_parallel_size=WORLD, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch()
    model = fabric.setup(_model())
    assert isinstance(model.module, fsdp.FSDPModule) == (impl != "fsdp2"), type(model.module)  # whose fully_shard
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(2):
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                torch.manual_seed(100 * step + 10 * micro + rank)
                loss = model(torch.randn(8, 32)).square().mean()
                fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        fabric.all_reduce(loss.detach())
        fabric.barrier()
    fabric.save(checkpoint, {"model": model, "optimizer": opt, "step": 2})
    _KEPT.extend([fabric, model, opt])


def _rank(rank: int, port: int, recipe: str, impl: str, destroy: bool) -> int:
    torch.set_num_threads(1)
    if impl != "fsdp":
        atexit.unregister(exit_guard)
    if recipe == "lightning-fabric":
        _lightning_fabric(rank, port, impl, os.path.join(_SCRATCH, f"{port}"))
        if destroy:
            dist.destroy_process_group()
        return 0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    shard = torch_fully_shard if impl == "fsdp2" else fsdp.fully_shard
    (_trainer if recipe == "trainer" else _fabric)(rank, shard)
    if destroy:
        dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--recipes", default="trainer,fabric")
    parser.add_argument("--impls", default="fsdp,fsdp2")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    impls = args.impls.split(",")
    if "lightning-fabric" in args.recipes:
        import lightning.fabric  # noqa: F401  (once, before the forks)
        import lightning.fabric.strategies  # noqa: F401
    for recipe in args.recipes.split(","):
        start = time.monotonic()
        counts = {impl: {"done": 0, "aborted": 0, "failed": []} for impl in impls}
        jobs = [(n, impl) for n in range(args.launches) for impl in impls]  # alternating
        for first in range(0, len(jobs), args.parallel):
            batch = []
            for n, impl in jobs[first : first + args.parallel]:
                port, pids = _free_port(), []
                for rank in range(WORLD):
                    pid = os.fork()
                    if pid == 0:
                        try:
                            status = _rank(rank, port, recipe, impl, destroy=n % 2 == 1)
                        except BaseException:
                            import traceback

                            traceback.print_exc()
                            status = 1
                        sys.stdout.flush()
                        raise SystemExit(status)  # a full finalisation
                    pids.append(pid)
                batch.append((n, impl, pids))
            for n, impl, pids in batch:
                statuses = [os.waitpid(pid, 0)[1] for pid in pids]
                abort = [os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGABRT for s in statuses]
                counts[impl]["aborted"] += any(abort)
                counts[impl]["failed"] += [f"{n}/{r}: {_describe(s)}" for r, s in enumerate(statuses) if s and not abort[r]]
                counts[impl]["done"] = n + 1
            print(json.dumps({"recipe": recipe, "so far": counts}), file=sys.stderr, flush=True)
        for impl in impls:
            print(json.dumps({"recipe": recipe, "impl": impl, **counts[impl],
                              "seconds": round(time.monotonic() - start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
