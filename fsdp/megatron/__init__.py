"""fsdp.megatron: Megatron-FSDP's experimental API (``megatron_fsdp.experimental``, as in
Megatron-LM main and megatron-fsdp 0.6.1) on fsdp and dbuffer, so a Megatron-FSDP user switches
by changing the import.

``fully_shard(module, mesh, Placements(dp_axes, parameter, gradient, optimizer),
mixed_precision_policy)`` builds an fsdp unit whose ZeRO stage is its placements;
``fully_shard_context`` / ``microbatch`` build units together and mark a step's last
micro-batch; ``fully_shard_optimizer`` syncs the compute weights after each step; ``DBuffer`` is
Megatron-FSDP's buffer on :class:`dbuffer.DBuffer`. Where Megatron-FSDP's conventions differ
from FSDP2's, this package follows Megatron-FSDP's (each module's docstring says where). A layer
on fsdp's public machinery: nothing in fsdp or dbuffer imports it.

User guide: fsdp/README.md, "Megatron-FSDP's API: fsdp.megatron".
"""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp.megatron.buffer import DBuffer
from fsdp.megatron.context import FsdpContext, fully_shard_context, microbatch
from fsdp.megatron.fully_shard import fully_shard
from fsdp.megatron.layout import GlobalLayout
from fsdp.megatron.module import FsdpModule
from fsdp.megatron.optimizer import fully_shard_optimizer
from fsdp.megatron.parameter_group import (
    FsdpParameter,
    FsdpParameterGroup,
    get_containing_parameter_group,
    sync_model_weights_from_main_weights,
)
from fsdp.megatron.placement import Flat, Partial, Placements
from fsdp.megatron.policy import MixedPrecisionPolicy

__all__ = [
    "DBuffer",
    "Flat",
    "FsdpContext",
    "FsdpModule",
    "FsdpParameter",
    "FsdpParameterGroup",
    "GlobalLayout",
    "MixedPrecisionPolicy",
    "Partial",
    "Placement",
    "Placements",
    "Replicate",
    "Shard",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "get_containing_parameter_group",
    "microbatch",
    "sync_model_weights_from_main_weights",
]
