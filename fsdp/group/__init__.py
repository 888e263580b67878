"""Parameter groups, the core: the DBuffers of one communication bucket of a unit and the parts
they are moved by (:mod:`~fsdp.group.param_group` is where to start reading). Nothing here knows
about modules' hooks (that is :mod:`fsdp.unit`) or imports an optional feature: those are parts
:mod:`fsdp.compose` hands to a group (tensor parallelism, tensor subclasses, HFSDP, offload,
custom comms, the post-forward slice)."""
