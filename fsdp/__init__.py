"""fsdp: fully sharded data parallel on DBuffers, with torch FSDP2's API and Megatron-FSDP's
sharding strategies and precision policy. All communication happens inside :mod:`dbuffer`.

From torch FSDP2, change the import: ``fully_shard(module, mesh=, reshard_after_forward=,
mp_policy=MixedPrecisionPolicy(param_dtype=, reduce_dtype=, output_dtype=, cast_forward_inputs=),
shard_placement_fn=, offload_policy=CPUOffloadPolicy(pin_memory=))`` and the module methods ``unshard(async_op=)``, ``reshard()``, ``set_requires_gradient_sync()``,
``set_reshard_after_forward()``, ``set_reshard_after_backward()``, ``set_is_last_backward()``,
``set_modules_to_forward_prefetch()``, ``set_modules_to_backward_prefetch()`` behave alike;
``module.parameters()`` are DTensors with FSDP2's local shards (``torch.chunk`` pieces along dim 0,
or ``shard_placement_fn``'s dim; :class:`fsdp.group.layouts.ChunkedLayout`), so torch optimizers, ``clip_grad_norm_``
and DCP work.
The rest of FSDP2's surface (``set_all_reduce_hook``, ``set_gradient_divide_factor``,
``set_requires_all_reduce``, ``reset_iter_state``, ``fully_shard.state``, ``dp_mesh_dims``, ...)
is in :mod:`fsdp.unit.surface`, which says which setters act, which have no effect and which raise.

From Megatron-FSDP: ``sharding_strategy`` in ``no_shard | optim | optim_grads |
optim_grads_params`` (ZeRO-0..3, default ZeRO-3); ``MixedPrecisionPolicy(main_params_dtype=
torch.float32, main_grads_dtype=...)``; ``param.main_grad``; ``module.zero_grad_buffer()`` and
``module.finish_grad_sync()``; ``with layout_policy("auto"): fully_shard(...)`` for its flat
row-atomic (or, where that pads too much, ragged) layout, whose gathers need no copies
(:mod:`fsdp.group.layout_choice`).

Beyond both: ``fully_shard(..., buckets=[Bucket("*.experts.*", ...)], bucket_size=...)`` groups
parameters into communication buckets by name, each with its own mesh, placement (``Shard(0)``,
or ``dbuffer.Owned()``: whole tensors on owners balanced over the model, for :class:`Muon`),
strategy and precision.

Memory: :class:`FlatAdamW` (:mod:`fsdp.optim`) steps each group's flat shard with torch's
kernels, so BF16 main grads need no FP32 copy; ``MixedPrecisionPolicy(persistent_param_shard=
False)`` casts the param shard before each gather instead of keeping it.

Checkpoints and meta-device init:

* torch's ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` with
  ``dcp.save`` / ``dcp.load`` work: parameters and optimizer state (given their parameter's rows
  after each optimizer step) are DTensors describing their exact rows, so checkpoints reshard
  across world sizes and strategies. :mod:`fsdp.checkpoint` adds ``save`` / ``load`` (atomic
  publish, CRC32 per file, errors naming the key or file) and a ``set_state_dict`` for full state
  dicts (``full_state_dict=True``, ``broadcast_from_rank0=True``) that checks every key and shape
  on every rank before any tensor moves. torch's own full-state-dict loaders (accelerate's and
  Lightning's way) also load the flat layouts exactly: :mod:`dbuffer.full_load` gives each rank
  its own rows or elements where torch would cut where ``torch.chunk`` does.
* Build under ``torch.device("meta")`` and ``fully_shard``: as in FSDP2 the sharded parameters
  stay on meta until ``module.to_empty(device=...)`` allocates each rank's shards; then
  :func:`init_weights` runs each module's ``reset_parameters()`` (or your function) one unit at a
  time and keeps each rank's rows (the eager build's values), or ``reset_parameters()`` on the
  sharded modules (FSDP2's recipe), or a checkpoint load. DTensors assigned before the first
  forward (``load_state_dict(sd, assign=True)``) become the parameters. A forward on parameters
  still on meta raises FSDP2's error.

Differences worth knowing:

* Every rank must build the module with identical values (same seed), as with FSDP2: each rank
  keeps its own rows, nothing is broadcast; unlike FSDP2, ranks that differ raise
  ``dbuffer.agreement.RankMismatchError`` at ``fully_shard``.
* The main weights are FP32 by default even for a module built in BF16 (Megatron), and the
  compute weights are a persistent copy refreshed once per optimizer step, not cast per gather.
* With ``main_grads_dtype`` different from the main dtype, ``param.grad`` is a cast copy of
  ``param.main_grad``; zero gradients with ``zero_grad()`` (set_to_none) or ``zero_grad_buffer()``.
* The model weights are refreshed after any ``torch.optim`` optimizer step (a global step hook)
  or any in-place change autograd's version counter sees (``load_state_dict``); after another
  kind of update call ``group.mark_stale()`` on the unit's groups.
* Meshes are 1-D, or 2-D ``(replicate, shard)`` for HSDP (tensor/expert-parallel DTensor
  parameters add their own axes: :mod:`fsdp.compose.tensor_parallel`); 0-D parameters only with ``no_shard``;
  a parameter tied across two units is an error (put both users in one unit).
* ``reshard_after_forward`` as an int ``n`` keeps ``1/n`` of the gathered weights after forward
  and gathers within ``n`` ranks in backward, as FSDP2 (ZeRO-3 groups of plain parameters on a
  1-D mesh; others reshard fully); the shards live on the mesh's device (the host under ``CPUOffloadPolicy``), so ``module.to(device)``
  accepts that device only. ``module.to(dtype)`` keeps the dtypes a ``MixedPrecisionPolicy`` set explicitly.
"""

from fsdp.unit.fully_shard import fully_shard
from fsdp.unit.init_weights import init_weights
from fsdp.unit.module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from fsdp.unit.surface import DataParallelMeshDims, share_comm_ctx
from fsdp.group.bucket import Bucket
from fsdp.group.layout_choice import layout_policy
from fsdp.optim.muon import Muon
from fsdp.optim import FlatAdam, FlatAdamW, FlatOptimizer, FlatSGD, flat_optimizer
from fsdp.compose.offload import CPUOffloadPolicy, OffloadPolicy
from fsdp.group.param_group import ParameterGroup
from fsdp.group.policy import MixedPrecisionPolicy, Strategy
from fsdp.compose.tensor_parallel import clip_grad_norm_
from fsdp.optim.step_hooks import optimizer_step_hooks
from fsdp.unit.torch_names import torch_names

# Any torch.optim optimizer works on sharded modules unchanged: see fsdp.optim.step_hooks.
optimizer_step_hooks(True)

__all__ = [
    "Bucket",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FlatAdam",
    "FlatAdamW",
    "FlatOptimizer",
    "FlatSGD",
    "MixedPrecisionPolicy",
    "Muon",
    "OffloadPolicy",
    "ParameterGroup",
    "Strategy",
    "UnshardHandle",
    "clip_grad_norm_",
    "flat_optimizer",
    "fully_shard",
    "init_weights",
    "layout_policy",
    "optimizer_step_hooks",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "torch_names",
]
