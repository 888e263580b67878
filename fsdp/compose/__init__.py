"""Composition: what plugs into a parameter group without the core knowing it: tensor
parallelism, tensor-subclass parameters, HFSDP, the post-forward slice, CPU offload and FSDP2's
custom comm objects."""
