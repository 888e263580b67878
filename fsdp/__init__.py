"""fsdp: fully sharded data parallel training on DBuffers, with torch FSDP2's API and
Megatron-FSDP's sharding strategies and precision policy.

``fully_shard`` makes modules units with sharded DTensor parameters (FSDP2's ``torch.chunk``
pieces, or Megatron's flat buffers under ``layout_policy("auto")``), so FSDP2 code runs by
changing the import, or unchanged under :func:`torch_names`; all communication goes through
:mod:`dbuffer`. Importing installs :func:`optimizer_step_hooks`, refreshing compute weights after
any ``torch.optim`` step. Needs torch 2.11+ (else ``ImportError``), 2.12 for ``dp_mesh_dims``.
Guide: fsdp/README.md; code layout: CONTRIBUTING.md.
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
