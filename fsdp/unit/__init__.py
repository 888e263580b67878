"""The unit: ``fully_shard`` turns a module into one, ``FSDPModule`` is its surface, and
:class:`~fsdp.unit.state.FSDPState` runs its hooks through one training step."""
