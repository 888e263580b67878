"""Parameter groups, the core: the DBuffers of one bucket of a unit and the parts that move them
(start at :mod:`~fsdp.group.param_group`). Modules' hooks are :mod:`fsdp.unit`'s; optional
features are parts :mod:`fsdp.compose` hands to a group."""
