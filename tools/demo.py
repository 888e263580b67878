"""Demo: train a small Llama on real text with ``fsdp.fully_shard``, on 2 CPU ranks.

    python3 tools/dev.py demo                       # 2 gloo ranks that it launches itself
    python3 tools/demo.py --steps 100 --resume      # 100 more steps from the saved checkpoint
    python3 tools/demo.py --size base --steps 500   # a bigger model, for longer
    torchrun --nproc-per-node 2 tools/demo.py       # the same, ranks started by torchrun

What runs: the Llama-style decoder of ``tests/models/llama.py`` (RMSNorm, causal attention with
rotary embeddings, SwiGLU) with ``fsdp.fully_shard`` on every block and then on the root (ZeRO-3:
each rank keeps only its rows of the weights, gradients and AdamW state). The text is the Python
standard library's own sources as bytes (``tools/text_data.py``; vocabulary 256, no download).
The global batch of step ``s`` depends only on ``s``, and each rank trains on its own rows of it,
so a run resumed from a checkpoint sees exactly the batches an uninterrupted run would have.

What it prints: the model, data and world; a progress bar (tqdm, rank 0, on stderr) with the
loss and global tokens/s; the first and last loss of the global batch (the mean over ranks of
their losses); and per rank, measured on the last step: peak memory, bytes sent and collectives
per step. It then saves a DCP checkpoint (model, optimizer and step counter) with
``fsdp.checkpoint.save``; ``--resume`` loads it and trains ``--steps`` more.

Memory: on CPU, a storage-level tracker (``StorageTracker`` of ``tools/kit/memory.py``) counts
every tensor storage the model, its gradients, the optimizer, fsdp's buffers and the step itself
hold (the text data is left out); on CUDA, ``torch.cuda.max_memory_allocated`` over the last step.
Communication: ``CommCounter`` of ``tools/kit/comm.py`` wraps the ``torch.distributed``
functions; "sent" is what this rank sends with a bandwidth-optimal algorithm. Only the training
step is counted, not the demo's own all-reduce of the loss for printing.

Devices: on CPU, backend gloo with one torch thread per rank (the ranks share the machine). When
``torch.cuda.is_available()`` (or ``--device cuda``), rank ``LOCAL_RANK`` uses ``cuda:LOCAL_RANK``
and backend nccl, and the self-launched world defaults to one rank per GPU. The CUDA path is a
few lines (device, backend, memory figure) and has not been run where this demo was written,
which had no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from fsdp import checkpoint as ckpt  # noqa: E402
from fsdp import fully_shard  # noqa: E402
from tests.models.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from tools.kit import launch  # noqa: E402
from tools.kit.comm import CommCounter  # noqa: E402
from tools.kit.memory import StorageTracker, live_storages  # noqa: E402
from tools.text_data import ByteText  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "demo"
MIB = 1 << 20
# Model and batch presets: dim, layers, sequence length, global batch (sequences). Heads are
# dim // 32 and the SwiGLU width 3 * dim; the vocabulary is 256 because tokens are bytes.
SIZES = {
    "tiny": {"dim": 64, "layers": 2, "seq": 32, "batch": 8},  # for tests: a few seconds
    "small": {"dim": 128, "layers": 2, "seq": 64, "batch": 16},  # the default: well under a minute
    "base": {"dim": 256, "layers": 4, "seq": 128, "batch": 32},  # minutes on a laptop CPU
}


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=ByteText.vocab_size, dim=args.dim, n_layers=args.layers,
                       n_heads=max(1, args.dim // 32), hidden_dim=3 * args.dim, max_seq_len=args.seq)


def use_cuda(args: argparse.Namespace) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def train(args: argparse.Namespace) -> None:
    """Every rank runs this inside an initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda(args):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    data = ByteText()
    cfg = model_config(args)
    tokens_per_step = args.batch * args.seq

    gc.collect()
    before = live_storages()  # what existed before the model: not counted as its memory
    torch.manual_seed(args.seed)  # every rank builds the same weights and keeps its own rows
    with device:
        model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(device.type, (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)  # one unit per block: gathered one at a time
    fully_shard(model, mesh=mesh)  # the root: embedding, final norm, lm_head
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    start = 0
    if args.resume:
        model_sd, optim_sd = ckpt.get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        ckpt.load(state, args.checkpoint)  # in place, each rank reading its own rows
        ckpt.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
        for group in opt.param_groups:  # the saved hyperparameters came back too; --lr wins
            group["lr"] = args.lr
    end = start + args.steps

    if rank == 0:
        print(f"Llama: {cfg.n_layers} blocks, dim {cfg.dim}, {cfg.n_heads} heads, SwiGLU {cfg.hidden_dim}, "
              f"vocab {cfg.vocab_size} (bytes): {n_params:,} parameters, {n_params * 4 / MIB:.1f} MiB in fp32")
        print(f"data: {len(data) / MIB:.1f} MiB of Python's standard library sources; global batch "
              f"{args.batch} x {args.seq} tokens, {args.batch // world} sequences per rank")
        threads = "" if device.type == "cuda" else f", {torch.get_num_threads()} thread per rank"
        print(f"world {world} ({dist.get_backend()}, {device.type}{threads}); fsdp.fully_shard per block + root "
              f"(ZeRO-3); AdamW lr {args.lr:g}")
        print(f"resumed from {_shown(args.checkpoint)} at step {start}" if args.resume
              else "fresh start from random weights")
        print(f"training steps {start}..{end - 1}", flush=True)

    counter = CommCounter()
    counter.install()
    losses: list[float] = []
    bar = _progress(rank == 0, args.steps)
    t0 = t_measured = time.perf_counter()
    try:
        for step in range(start, end):
            batch = data.batch(step, args.batch, args.seq, rank=rank, world_size=world).to(device)
            last = step == end - 1
            if last:  # measured: memory and communication (slower, so left out of tokens/s)
                t_measured = time.perf_counter()
                counting, measure = counter.counting("step"), _measure_step(device, before)
            else:
                counting = measure = contextlib.nullcontext()
            with counting, measure as memory:
                loss = loss_fn(model(batch[:, :-1]), batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)  # sum over ranks; each rank's loss is a mean of equal-sized rows
            losses.append(global_loss.item() / world)
            if bar is not None:
                rate = tokens_per_step * (step - start + 1) / (time.perf_counter() - t0)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", refresh=False)
                bar.update(1)
        elapsed = time.perf_counter() - t0
    finally:
        if bar is not None:
            bar.close()
        counter.uninstall()
    before = None

    comm = counter.stats.get("step") or {"ops": 0, "calls": 0, "bytes_sent": 0.0}
    held = sum(p.to_local().numel() for p in model.parameters())
    mine = {"device": str(device), "params": held, "peak": memory["peak"], "start": memory["start"],
            "sent": comm["bytes_sent"], "ops": comm["ops"], "calls": comm["calls"]}
    per_rank: list[Optional[dict]] = [None] * world
    dist.all_gather_object(per_rank, mine)

    if rank == 0:
        note = "; a uniform guess scores ln 256 = 5.545" if start == 0 else ""
        print(f"first loss {losses[0]:.4f}  (step {start}{note})")
        print(f"last loss  {losses[-1]:.4f}  (step {end - 1})")
        timed = (args.steps - 1, t_measured - t0) if args.steps > 1 else (1, elapsed)
        print(f"{args.steps} steps in {elapsed:.1f} s; {tokens_per_step * timed[0] / timed[1]:,.0f} tokens/s "
              f"over all ranks")
        print(_rank_table(per_rank))
        if args.loss_log:
            Path(args.loss_log).write_text(json.dumps({"start": start, "losses": losses}))

    model_sd, optim_sd = ckpt.get_state_dict(model, opt)
    ckpt.save({"model": model_sd, "optim": optim_sd, "step": end}, args.checkpoint)
    if rank == 0:
        print(f"checkpoint of step {end} saved to {_shown(args.checkpoint)} (--resume continues from it)", flush=True)


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (shorter to read)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _rank_table(per_rank: list[dict]) -> str:
    """One line per rank: what it holds and what its last step cost."""
    lines = ["per rank (memory and communication measured on the last step):",
             f"  {'rank':>4}  {'device':<7}{'params held':>12}{'peak memory':>13}{'held between steps':>20}"
             f"{'sent/step':>11}  collectives/step"]
    for r, f in enumerate(per_rank):
        lines.append(f"  {r:>4}  {f['device']:<7}{f['params']:>12,}{f['peak'] / MIB:>9.2f} MiB"
                     f"{f['start'] / MIB:>16.2f} MiB{f['sent'] / MIB:>7.2f} MiB"
                     f"  {f['ops']} ({f['calls']} c10d calls)")
    return "\n".join(lines)


def _progress(enabled: bool, total: int):
    """tqdm on rank 0 only; it goes to stderr and redraws less often when that is not a terminal
    (a CI log keeps every redraw)."""
    if not enabled:
        return None
    import threading

    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore; a rank leaves through os._exit
    # (dbuffer.teardown.shutdown), so it would be reported as leaked at exit. One bar, one thread.
    tqdm.set_lock(threading.RLock())
    interactive = sys.stderr.isatty()
    return tqdm(total=total, desc="training", unit="step", mininterval=0.2 if interactive else 5.0,
                dynamic_ncols=True)


@contextlib.contextmanager
def _measure_step(device: torch.device, before: dict):
    """Memory of one step, the persistent state included (weights, gradients, AdamW state, fsdp's
    buffers): yields a dict whose ``start`` (bytes held as the step starts) and ``peak`` are filled
    in. On CPU it counts every storage created since ``before`` plus those the step touches."""
    figures = {"start": 0, "peak": 0}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        figures["start"] = torch.cuda.memory_allocated(device)
        yield figures
        figures["peak"] = torch.cuda.max_memory_allocated(device)
        return
    tracker = StorageTracker()
    tracker.track_new(before)
    figures["start"] = tracker.current
    with tracker:
        yield figures
    figures["peak"] = tracker.peak


# ----------------------------------------------------------------------------- launching


def _rank_options(args: argparse.Namespace) -> dict:
    """How a rank joins (:func:`tools.kit.launch.run_rank`): ``cuda:LOCAL_RANK`` and nccl on CUDA;
    gloo with one torch thread per rank on CPU (the ranks share the CPU cores)."""
    cuda = use_cuda(args)
    return dict(backend="nccl" if cuda else "gloo", threads=None if cuda else 1, cuda=cuda)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps (more steps with --resume)")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks to launch (default 2 on CPU, one per GPU on CUDA; ignored under torchrun)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="model and batch preset")
    parser.add_argument("--dim", type=int, default=None, help="model width (overrides --size)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (overrides --size)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (overrides --size)")
    parser.add_argument("--batch", type=int, default=None, help="global batch in sequences (overrides --size)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (constant)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch.cuda.is_available(), else cpu")
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint and train --steps more")
    parser.add_argument("--loss-log", default=None, help="write the global loss of every step to this JSON file")
    args = parser.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.checkpoint = os.path.abspath(args.checkpoint)
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else args.world
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.dim < 32 or args.dim % 32:
        parser.error(f"--dim must be a positive multiple of 32 (heads of 32), got {args.dim}")
    if args.layers < 1 or args.seq < 1:
        parser.error("--layers and --seq must be >= 1")
    if world is not None and (world < 1 or args.batch % world):
        parser.error(f"--batch {args.batch} must be a multiple of the world size {world}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here")
    if args.resume and not os.path.isdir(args.checkpoint):
        parser.error(f"--resume: no checkpoint at {args.checkpoint}; run once without --resume first")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if launch.under_torchrun():
        launch.run_rank(train, args, **_rank_options(args))
    if args.world is None:
        args.world = torch.cuda.device_count() if use_cuda(args) else 2
    if args.batch % args.world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --world {args.world}")
    if use_cuda(args) and args.world > torch.cuda.device_count():
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs, {torch.cuda.device_count()} visible")
    launch.spawn(args.world, train, args, **_rank_options(args))


if __name__ == "__main__":
    main()
