"""Benchmark one Llama training step: our ``fsdp.fully_shard`` (both layouts), torch FSDP2 and the
compute-only floor, interleaved in one run with a raw-c10d reference (ours' communication alone).

    python3 tools/bench_fsdp.py                       # both modes, default model (~6 min on 2 cores)
    python3 tools/bench_fsdp.py --counts              # collectives per step, 3 models, ours vs FSDP2 (no timing)
    python3 tools/bench_fsdp.py --dtype fp32 --layers 2 --dim 128 --steps 4   # a quick look
    torchrun --nproc-per-node 2 tools/bench_fsdp.py --dtype fp32
    python3 tools/bench_fsdp.py --json out.json --plot out.png --profile ours
    python3 tools/render_results.py                   # README.md's table from the saved results

Results as data: a run of the default model (any ``--steps``, ``--dtype``, ``--methods``) saves
each mode it ran as the latest run of that mode in ``tools/results/bench_fsdp.json`` (with the
date, the command, the host's CPU, speed flags and cores, torch; :mod:`tools.kit.results`) and
rewrites ``tools/results/bench_fsdp.md``, the markdown table ``tools/render_results.py`` puts into
README.md. Another model saves only where ``--results PATH`` says; ``--no-results`` saves nothing.

Model: ``tests.models.llama.Llama`` (defaults: vocab 8192, dim 512, 6 layers, 8 heads, SwiGLU hidden
1536), sequence 128, ``--batch`` 4 sequences per rank, on ``--world`` 2 gloo ranks over loopback,
one CPU thread per rank. ``--model`` (``tools/step_bench/methods.py`` ``MODELS``): ``llama``
(``fully_shard`` per block, then the root: embedding, final norm, lm_head), ``head_root`` (the
embedding its own unit: the root holds only the final norm and lm_head, torchtitan's and
torchao's shape), ``float8`` (every ``nn.Linear`` weight a
:class:`tests.models.float8_weight.Float8RowwiseWeight`, a tensor subclass with a float8
all-gather; the floor trains the straight-through single-process reference). Every rank builds the same model from the same seed; each method trains
its own copy of it on the same batches (real text: ``tools.text_data.ByteText``, or ``--data
random`` tokens), each rank on its own rows of the global batch.

Methods, each (but ``c10d``) running forward, loss, backward, ``AdamW.step()`` and ``zero_grad()``
every step:

* ``ours``: ``fsdp.fully_shard`` on every block, then on the root (``--strategy``, default
  ``optim_grads_params`` = ZeRO-3), in fully_shard's default layout: FSDP2's ``torch.chunk``
  pieces (copied out of each gather, into each reduction);
* ``row``: ``ours`` built under ``fsdp.layout_policy("auto")``, Megatron's flat row-atomic
  layout: no copy out of each gather or into each reduction. Run by default next to ``ours``
  so that every run measures the choice of the default layout: the table prints both layouts'
  ratios to FSDP2 and the floor, their peak memory, and row/chunk (also paired per round);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then on the root (always its
  default, ZeRO-3 with ``reshard_after_forward=True``; ``--strategy`` changes ours only);
* ``floor``: the plain model on every rank: the same local batch, no sharding, no communication;
* ``c10d``: raw c10d, no model: the c10d calls ``ours`` made in its last untimed step, replayed
  alone on preallocated tensors (:mod:`tools.kit.comm_replay`); what the communication itself
  costs.
  Where the ranks' compute threads fill every core, no data-parallel step can take less CPU time
  than ``floor`` + ``c10d``: the table prints that bound over the floor and over this run's
  FSDP2 step (the least ours/FSDP2 a framework costing nothing would reach), next to the targets;
* ``flat``: ``ours`` with ``fsdp.FlatAdamW`` (the step over the flat shards, :mod:`fsdp.optim`)
  and, in bf16, ``main_grads_dtype=bf16`` (no FP32 gradient copy at the step);
* ``lean`` (only with ``--methods``): ``flat`` with ``persistent_param_shard=False`` (the same
  as ``flat`` here: in these packed layouts every gather casts into its own row and no BF16
  shard is kept with either setting).

The table prints peak memory and step time of each variant against FSDP2 and ``ours``.

Precision (``--dtype``; ``both`` runs fp32, then bf16):

* fp32: no policy for either library (fp32 weights, grads and reductions); the floor is fp32.
* bf16: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 sharded
  weights, AdamW and gradients); ours ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32, main_params_dtype=fp32, main_grads_dtype=fp32)`` (the same four dtypes). The
  floor is a bf16 *copy* of the model (``.to(bfloat16)``: weights, gradients and AdamW states in
  bf16), so its forward and backward run exactly the bf16 arithmetic the two sharded methods run;
  autocast would instead keep the residual stream in fp32 (the embedding is not autocast) and
  recast every weight in every step, i.e. a different and slower computation.

On a CPU without native bf16 arithmetic (AVX2 only) bf16 matmuls run at 1-10 GFLOP/s against
~80 for fp32 (the table prints this machine's figures), so a bf16 step of the default model takes
~30 s and is almost all matmul: there the default times one bf16 step per method (``--steps`` for
more), where a CPU with bf16 units (AVX512-BF16, AMX) gets six, as fp32 does.

Measurements:

* Warmup and measurement: each method in turn (the others idle) is built, runs ``--warmup``
  untimed steps, then one untimed *measured* step with the memory tracker and the collective
  counter below installed.
* Time: then the methods run round-robin, one step each, in an order rotated every step (the
  same on every rank), so drift of the machine hits them alike. A step is timed from the moment
  the last rank enters it (after a barrier) to the moment the last rank leaves it; the table
  shows the median over ``--steps`` timed steps and the targets use the ratio of medians. As
  checks against a shared, noisy machine it also gives the median of the per-round ratios, the
  ratio of the fastest steps, and the CPU time of a step (``time.process_time`` of the rank's
  process, all its threads, gloo's included; mean over ranks, median over steps).
* Memory: a storage-level tracker of our own (``tools.kit.memory.StorageTracker``: a
  ``TorchDispatchMode`` plus a hook on ``UntypedStorage.resize_``;
  ``torch.distributed._tools.mem_tracker`` is not used).
  When the measured step starts it holds every storage that a Python-visible tensor of the
  process holds and that did not exist before the method was built (found through ``gc``:
  parameters, gradients, optimizer state, the library's own buffers and caches, e.g. dbuffer's
  collective scratch, which is released before each mode). During the step it adds every storage
  an operator reads or writes (DTensors count by their local tensors, c10d operators included),
  each once at its current size, and drops freed ones (weak references). The peak is the
  largest total after any operator or resize. Memory the c10d backend allocates inside a
  collective (gloo's staging buffers) is not a torch storage and is not seen.
* Communication: the ``torch.distributed`` collective and point-to-point functions are wrapped
  during the measured step only (``tools.kit.comm.CommCounter``). ``calls`` counts every c10d
  call (isend and irecv each count one); ``ops`` counts collectives, with the isend/irecv calls
  of one point-to-point all-gather or reduce-scatter (``world - 1`` sends and receives posted
  together) counted as one op. ``sent`` is the bytes this rank must send for them with a
  bandwidth-optimal algorithm: all-gather ``(W-1) * input``, reduce-scatter and all-to-all
  ``(W-1)/W * input``, all-reduce ``2 (W-1)/W * tensor``, send the tensor; gloo's own algorithms
  may move more (its ``reduce_scatter_single`` runs as an all-reduce). ``collectives`` counts
  what the step asks for by kind (all-gather, reduce-scatter, all-reduce, other), whatever c10d
  calls carry it: one call of ``dbuffer.collectives`` is one collective (on gloo ours' big
  gathers are isend/irecv pairs), FSDP2's c10d calls one each; the table prints them side by
  side and the targets hold ours to at most FSDP2's all-gathers and reduce-scatters.
* Where the time goes: every step of every method marks this thread's CPU time, the process's
  and the minor page faults (``tools.kit.timing.cpu_mark``) before forward, before backward,
  before the optimizer and at the end; the table gives per method the training thread's CPU ms
  of each phase, the other threads' (gloo's), the faults (median over timed steps, mean over
  ranks), ours minus the floor, and ours' CPU time beyond floor + c10d by phase, its extra faults
  priced by ``tools.kit.timing.fault_probe`` (a fresh buffer written minus the same buffer
  written again, per page, on all ranks at once).
* ``--counts``: only that count, quickly (``--warmup`` steps and one counted step per method, no
  timing, no memory tracking), for ``ours``, ``row`` and ``fsdp2`` on each of the three models,
  with a verdict per model: ours may not make more all-gathers, reduce-scatters or collectives
  in all than FSDP2 (``tools/step_bench/counts.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from tools.kit import launch, results  # noqa: E402
from tools.step_bench import markdown  # noqa: E402
from tools.step_bench.counts import format_counts, run_counts  # noqa: E402
from tools.step_bench.methods import (  # noqa: E402
    ALL_METHODS,
    DEFAULT_STEPS,
    METHODS,
    MODELS,
    STRATEGIES,
    BenchConfig,
    check_config,
    default_methods,
    model_config,
)
from tools.step_bench.report import format_table, write_plot  # noqa: E402
from tools.step_bench.run import profile_method, run_benchmark  # noqa: E402

# The fields that make a run "the default model", whose results README.md's table shows.
_MODEL_FIELDS = ("vocab", "dim", "layers", "heads", "hidden", "seq", "batch", "strategy", "data", "model", "foreach")
DEFAULT_WORLD = 2

# ----------------------------------------------------------------------------- launcher


def results_path(cfg: BenchConfig, args: argparse.Namespace, world: int) -> Optional[Path]:
    """Where this run saves its results: ``--results``, else the default file for a run of the
    default model, else nowhere (a quick look must not replace the table's figures)."""
    if args.no_results:
        return None
    if args.results:
        return Path(args.results)
    default = BenchConfig()
    if world == DEFAULT_WORLD and all(getattr(cfg, f) == getattr(default, f) for f in _MODEL_FIELDS):
        return results.RESULTS_DIR / "bench_fsdp.json"
    return None


def save_results(path: Optional[Path], runs: dict, command: str) -> str:
    """Save ``runs`` ({mode: measured fields}) as the latest runs of their modes at ``path`` and
    rewrite the markdown table next to it; returns what to tell the user."""
    if path is None:
        return ("results not saved (--no-results, or not the default model: --results PATH saves them; "
                "tools/results/bench_fsdp.json holds the default model's)")
    data = {}
    for mode, measured in runs.items():
        data = results.save(path, mode, results.record(command, **measured), "bench_fsdp")
    table = path.with_suffix(".md")
    table.write_text(markdown.render(data))
    return f"results saved to {path} and {table} (python3 tools/render_results.py puts them into README.md)"


def _bench_and_report(cfg: BenchConfig, args: argparse.Namespace) -> None:
    """Every rank benchmarks; rank 0 prints (and writes) the results."""
    report = run_benchmark(cfg, progress=not args.quiet)
    if dist.get_rank() == 0:
        print(format_table(report), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
            print(f"results written to {args.json}")
        if args.plot:
            print(write_plot(report, args.plot))
        common = {k: report[k] for k in ("config", "world", "backend", "threads_per_rank", "model", "data")}
        runs = {mode: dict(common, result=res) for mode, res in report["modes"].items()}
        print(save_results(results_path(cfg, args, report["world"]), runs, args.command))
    if args.profile:
        for mode in cfg.dtypes:
            text = profile_method(args.profile, mode, cfg, steps=args.profile_steps)
            if dist.get_rank() == 0:
                print(text, flush=True)


def _counts_and_report(cfg: BenchConfig, args: argparse.Namespace) -> None:
    """Every rank counts; rank 0 prints (and saves) the counts."""
    report = run_counts(cfg)
    if dist.get_rank() == 0:
        print(format_counts(report), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
            print(f"results written to {args.json}")
        print(save_results(results_path(cfg, args, report["world"]), {"counts": {"counts": report}}, args.command))


def parse_args(argv: Optional[list[str]] = None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("both", "fp32", "bf16"), default="both")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed steps per method (default: {DEFAULT_STEPS['fp32']}; bf16 on a CPU "
                             f"without bf16 units: 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per method first (default 1)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="optim_grads_params",
                        help="our sharding_strategy (default optim_grads_params = ZeRO-3)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(ALL_METHODS)} (default {','.join(METHODS)}, "
                             f"without flat for --model float8; c10d: ours' communication replayed "
                             f"alone, after ours; flat: fsdp.FlatAdamW + BF16 main "
                             f"grads in bf16; lean: flat + persistent_param_shard=False; row: ours on Megatron's flat row-atomic layout)")
    parser.add_argument("--model", choices=tuple(MODELS), default="llama",
                        help="which modules are units and what the weights are: " + "; ".join(
                            f"{k}: {v}" for k, v in MODELS.items()).replace("%", "%%"))
    parser.add_argument("--counts", action="store_true",
                        help="only count the collectives of one step (after --warmup) for ours, row and fsdp2 on "
                             "every model (--model is ignored); no timing")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1536, help="SwiGLU hidden width")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--data", choices=("text", "random"), default="text")
    parser.add_argument("--foreach", choices=("default", "on", "off"), default="default",
                        help="AdamW foreach (default: torch's choice, the for-loop on CPU)")
    parser.add_argument("--no-measure", action="store_true", help="skip the memory/communication step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write all results to this JSON file")
    parser.add_argument("--results", default=None,
                        help="results file to update (default: tools/results/bench_fsdp.json for the default model)")
    parser.add_argument("--no-results", action="store_true", help="save no results file")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")
    parser.add_argument("--profile", choices=[m for m in ALL_METHODS if m != "c10d"], default=None,
                        help="afterwards, profile this method on rank 0: torch.profiler, the step by fsdp:: "
                             "range (ours), cProfile")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    cfg = BenchConfig(
        dtypes=("fp32", "bf16") if args.dtype == "both" else (args.dtype,),
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, hidden=args.hidden,
        seq=args.seq, batch=args.batch, steps=args.steps, warmup=args.warmup, strategy=args.strategy,
        data=args.data, foreach={"default": None, "on": True, "off": False}[args.foreach],
        seed=args.seed, measure=not args.no_measure,
        methods=(tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods is not None
                 else default_methods(args.model)), model=args.model,
    )
    if args.counts and args.profile:
        parser.error("--counts counts collectives only; run --profile without it")
    try:
        check_config(cfg)
        model_config(cfg)
    except ValueError as exc:
        parser.error(str(exc))
    if args.world < 1:
        parser.error("--world must be >= 1")
    return cfg, args


def main(argv: Optional[list[str]] = None) -> None:
    cfg, args = parse_args(argv)
    launcher = (f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', '?')}" if launch.under_torchrun()
                else "python3")
    args.command = results.command_line([sys.argv[0], *(sys.argv[1:] if argv is None else argv)], launcher)
    body = _counts_and_report if args.counts else _bench_and_report
    if launch.under_torchrun():
        launch.run_rank(body, cfg, args)
    launch.spawn(args.world, body, cfg, args)


if __name__ == "__main__":
    main()
