"""Memory planner: per-rank bytes of a ``fully_shard`` run, measured on a fake world and checked
against the closed form.

Run from the repository root::

    python3 tools/plan_memory.py --model llama3-70b --world 1024 --strategy optim_grads_params \\
        --param-dtype bf16 --main-grads-dtype fp32 --optimizer adamw [--rank R] [--json]
    python3 tools/plan_memory.py --model llama3-70b --world 1024 --tp 8 [--dp-replicate 2]
    python3 tools/plan_memory.py --model llama3-70b --world 1024 --dp-replicate 8 --outer-dp-sharding-strategy optim

or from Python, with a preset name or any callable that builds a module (it is called under
``torch.device("meta")``, so a plain constructor will do)::

    from tools.plan_memory import plan
    print(plan("mixtral-8x7b", world=256, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)).format())

Why measure rather than only compute: the bytes a rank holds depend on the row-atomic layout
(padding), on which buffers alias each other (the model weights *are* the main weights when the
dtypes match; ``no_shard``'s unsharded weights are its model weights) and on which buffers the
strategy keeps. So the planner runs the real thing: it joins torch's fake process group as rank
``rank`` of ``world`` (real shapes, no communication), builds the model on meta,
calls ``fully_shard`` on each block and then the root exactly as a training script would, and
reads the bytes of the DBuffers every ``ParameterGroup`` holds. The closed form is computed
independently from the parameter shapes alone; the only legitimate difference between the two is
layout padding, so every category is checked as ``|measured - closed| <= allowance`` where the
allowance is the padding the layout puts into those buffers.

Categories (bytes on this rank):

* main weights: the weights the optimizer updates (sharded unless ``no_shard``).
* model weights: a compute-dtype copy of the weights kept between steps: ``no_shard``'s full one
  when its dtype differs, HFSDP's shard-axis copy; 0 for the other sharded strategies, whose
  every gather casts the main shard straight into its own row of the gathered buffer (FSDP2's
  copy-in).
* unsharded weights: the full compute weights ``optim``/``optim_grads`` keep between steps
  (``no_shard`` uses its model weights, ZeRO-3 gathers them per use: both 0 here).
* main grads: the reduced-gradient buffer (sharded for ``optim_grads*``), counted in full: it
  holds its storage at least from a step's first reduction to the optimizer step.
* grad copies: when the main-grads dtype differs from the main dtype, ``param.grad`` is a cast
  copy of this rank's rows of ``param.main_grad`` in the main dtype (what the optimizer reads).
  0 with ``fsdp.FlatAdamW`` & co. (``--flat-optimizer``: ``flat_optimizer=True``), which upcast
  one parameter's local piece at a time (that workspace, like the kernels' temporaries, is not
  counted).
* optimizer state: closed form, because torch optimizers allocate lazily: AdamW/Adam keep two
  tensors per parameter, SGD with momentum one, each like the parameter's local piece (this rank's
  rows, no padding), in the main dtype. The per-parameter ``step`` scalars are not counted.
* unsharded working set (ZeRO-3 only; the other strategies keep them, see above): full compute
  weights gathered per use.
* reduce working set (every strategy): the full ``grad_in`` buffers (reduce dtype) gradients
  accumulate in before their reduction.

Working sets are peaks over a training step, so they depend on fsdp's schedule (prefetching, how
many reductions stay in flight), which the planner measures rather than assumes: it runs three
forward/backward passes of a tiny probe model sharded with the same strategy on the same world and
records, whenever a buffer gets its storage back, which units hold gathered weights and
``grad_in`` at once. The probe is
shaped like a decoder LM (the root's own weights used first and last, blocks in registration
order); each moment "root + k units" is then priced with the root's and the k largest other units'
buffers of the real model, and the largest is the peak. With fsdp as of this writing: gathered
root + 2 units (the root stays gathered from its forward to the end of backward, plus the unit
computing and the one prefetched); reducing root + 1 or 2 units (the root's ``grad_in`` lives
through the whole backward: its first gradient, ``lm_head``'s, comes first and the embedding's
last). Not counted: the small sharded temporaries of a reduction whose reduce dtype differs from
the main-grads dtype (1/world of a unit each).

The total adds every category: a conservative estimate of the peak of the buffers fsdp manages
(the working sets peak in backward, the optimizer state and grad copies matter at the step; both
are added). Not counted:
activations, autograd and kernel temporaries, allocator fragmentation, communication workspaces.
Padding is reported separately ("of which"): bytes of the persistent buffers that hold no tensor
element, on this rank and on average over the ranks (the last ranks hold the most).

N-D meshes (``--tp T``, ``--dp-replicate R``; ``dp_shard = world / (T * R)``): the planner builds
the mesh ``(dp_replicate, dp_shard, tp)`` (size-1 axes left out) on the fake group, applies the
Llama TP plan of :mod:`tools.tp_plan` with torch's own ``parallelize_module`` on the ``tp``
sub-mesh (torchtitan's: column-parallel q/k/v/gate/up/w1/w3 and ``lm_head``, row-parallel
o/down/w2 and ``embed_tokens``, both split on the vocabulary; RMSNorm weights and Mixtral's router
replicated, plain tensors), then shards every block and the root on the dp axes (HSDP when
``R > 1``), as README "FSDP x TP / EP" does. DTensors work on meta under the fake group: nothing
is communicated or allocated. The closed form counts each parameter's TP piece (this rank's
``torch.chunk(weight, T, dim)`` piece for the split ones, the whole weight for the replicated
ones) and shards that over ``dp_shard``; replicas (``R``) hold copies, so they do not divide
anything. The TP parameters live in fsdp's chunked groups (``torch.chunk`` pieces over dp,
fsdp/group/layouts.py), whose padding (uneven pieces) is the allowance. Not counted with TP: those
groups' shard-major gather target, which under ZeRO-3 holds one more copy of a unit's gathered
weights from a gather's start to its copy into the parameters (the schedule probe has no TP groups,
so it does not see it); and the schedule is the 1-D probe's (fsdp schedules TP units the same way).

HFSDP (``--outer-dp-sharding-strategy optim`` with ``--dp-replicate R``, no TP; see
:mod:`fsdp.compose.outer_shard`): main weights, main grads, ``.grad`` copies and optimizer state are
sharded over ``R * dp_shard`` ranks instead of ``dp_shard``; the model weights are the
``dp_shard``-sharded compute copy (kept even when its dtype is the main one: it is the replicate
all-gather's result) plus, when the dtypes differ, the ``1/(R * dp_shard)`` cast piece that
all-gather reads.

Where the buffers live: by default on a ``meta`` mesh. ``fully_shard`` builds the very same
DBuffers (layouts, dtypes, placements, aliases, released storage), but nothing is allocated or
written, so any model plans in seconds on a laptop. Real storage is available (``device="cpu"``)
and gives the same figures for models that fit, but it cannot plan big ones: the ZeRO-0..2
strategies keep full replicated buffers (70B ``no_shard``: 282 GB of main weights per rank),
the fake group's all-gather writes its whole output, ``ParameterGroup`` zero-fills the full
gather and ``grad_in`` buffers before releasing them, and a sharded module is never freed (its
gradient hooks hold it in a cycle through autograd), so memory piles up across plans.

The driver (this file) parses the flags and prints; the planner lives in ``tools/memory_plan/``:
``presets.py`` (the preset models), ``planner.py`` (``plan()``: shard on the fake world, measure,
check), ``measure.py`` (the buffers' bytes and the schedule probe), ``closed_form.py`` (bytes from
shapes alone), ``report.py`` (``Bytes``, ``Plan`` and its printout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fsdp import MixedPrecisionPolicy  # noqa: E402
from fsdp.group.layout_choice import LAYOUT_KINDS  # noqa: E402
from fsdp.group.policy import STRATEGIES  # noqa: E402
from tools.memory_plan.closed_form import OPTIMIZER_STATES  # noqa: E402
from tools.memory_plan.planner import plan  # noqa: E402
from tools.memory_plan.presets import CONFIGS, PRESETS, CausalLM, Config  # noqa: E402
from tools.memory_plan.report import Bytes, Plan  # noqa: E402

__all__ = ["Bytes", "CausalLM", "Config", "Plan", "PRESETS", "OPTIMIZER_STATES", "plan", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-70b", help=f"preset: {', '.join(CONFIGS)}")
    ap.add_argument("--world", type=int, default=1024, help="ranks in all (dp_replicate * dp_shard * tp)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: the Llama TP plan of tools/tp_plan.py")
    ap.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (dp_shard = world / (tp * this))")
    ap.add_argument(
        "--outer-dp-sharding-strategy", default="no_shard", choices=["no_shard", "optim"],
        help="optim: HFSDP, the optimizer also sharded over --dp-replicate (fsdp.compose.outer_shard)",
    )
    ap.add_argument("--rank", type=int, default=0, help="every rank allocates the same; the last ones hold the padding")
    ap.add_argument("--strategy", default="optim_grads_params", choices=list(STRATEGIES), help="ZeRO-0..3")
    ap.add_argument("--param-dtype", default="bf16", choices=list(DTYPES), help="model (compute) weights")
    ap.add_argument("--main-dtype", default="fp32", choices=list(DTYPES), help="main weights")
    ap.add_argument("--main-grads-dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--reduce-dtype", default=None, choices=list(DTYPES), help="default: the param dtype")
    ap.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATES))
    ap.add_argument("--flat-optimizer", action="store_true", help="fsdp.FlatAdamW & co.: no FP32 .grad copies")
    ap.add_argument("--layout", default="chunk", choices=list(LAYOUT_KINDS), help="default groups' layout (chunk: FSDP2's torch.chunk pieces; auto: row-atomic unless it pads > 0.1%%)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[args.param_dtype],
        main_params_dtype=DTYPES[args.main_dtype],
        main_grads_dtype=DTYPES[args.main_grads_dtype],
        reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
    )
    start = time.perf_counter()
    result = plan(
        args.model, args.world, args.rank, strategy=args.strategy, mp_policy=policy, optimizer=args.optimizer,
        flat_optimizer=args.flat_optimizer, tp=args.tp, dp_replicate=args.dp_replicate, layout=args.layout,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
    )
    result.seconds["plan total"] = time.perf_counter() - start
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.format())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
