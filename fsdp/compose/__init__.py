"""Composition: what plugs into a parameter group without the core knowing it: tensor parallelism,
tensor-subclass parameters, HFSDP, the post-forward slice, CPU offload, FSDP2's comm objects."""
