"""Parameter groups: the DBuffers of one communication bucket of a unit, their layout, and how
weights are gathered and gradients reduced. Nothing here knows about modules' hooks (that is
:mod:`fsdp.unit`) or about optional features (those plug in from :mod:`fsdp.compose`)."""
