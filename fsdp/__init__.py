"""fsdp: fully sharded data parallel training on DBuffers, with torch FSDP2's API and
Megatron-FSDP's sharding strategies and precision policy.

``fully_shard`` turns modules into units whose parameters are sharded DTensors (FSDP2's
``torch.chunk`` pieces by default, Megatron's flat buffers under ``layout_policy("auto")``), so
code written for FSDP2 runs by changing the import, and :func:`torch_names` lets frameworks that
call FSDP2 themselves use it. All communication goes through :mod:`dbuffer`; fsdp never calls
c10d. Importing the package installs the ``torch.optim`` step hooks that refresh the compute
weights after any optimizer step (:func:`optimizer_step_hooks`).

User guide: fsdp/README.md. Reference: each public name's docstring. Layout of the code and one
training step file by file: CONTRIBUTING.md.

It needs torch 2.11 or newer (checked first: an older torch raises ``ImportError`` naming the
version, :mod:`dbuffer.torch_version`); ``dp_mesh_dims`` needs 2.12.
"""

from dbuffer.torch_version import check as _check_torch_version

_check_torch_version()  # before the imports below, which would fail less clearly on an old torch

from fsdp.unit.fully_shard import fully_shard
from fsdp.unit.init_weights import init_weights
from fsdp.unit.module import FSDPModule, GradientReductionHandle, UnshardHandle, register_fsdp_forward_method
from fsdp.unit.surface import DataParallelMeshDims, share_comm_ctx
from fsdp.unit.shard_placement import ShardPlacementResult
from fsdp.group.bucket import Bucket
from fsdp.group.layout_choice import layout_policy
from fsdp.optim.muon import Muon
from fsdp.optim import FlatAdam, FlatAdamW, FlatOptimizer, FlatSGD, flat_optimizer
from fsdp.compose.offload import CPUOffloadPolicy, OffloadPolicy, OptimizerStateOffloadPolicy
from fsdp.group.param_group import ParameterGroup
from fsdp.group.policy import FLOAT32_OR_WIDER, MixedPrecisionPolicy, Strategy
from fsdp.compose.tensor_parallel import clip_grad_norm_
from fsdp.optim.step_hooks import optimizer_step_hooks
from fsdp.unit.torch_names import torch_names

# Any torch.optim optimizer works on sharded modules unchanged: see fsdp.optim.step_hooks.
optimizer_step_hooks(True)

__all__ = [
    "FLOAT32_OR_WIDER",
    "Bucket",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FlatAdam",
    "FlatAdamW",
    "FlatOptimizer",
    "FlatSGD",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "Muon",
    "OffloadPolicy",
    "OptimizerStateOffloadPolicy",
    "ParameterGroup",
    "ShardPlacementResult",
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
