"""Frameworks' own training code run on fsdp, each against torch FSDP2 in the same test.

* ``test_megatron_core.py``: megatron-core's GPTModel, TorchFullyShardedDataParallel, schedules,
  finalize_model_grads and optimizer (skipped where megatron-core is not installed; CI installs
  it, ``tools/dev.py``);
* ``megatron_standins.py``: what megatron-core does only on CUDA (unrelated to data parallelism),
  stood in for on the CPU, and megatron-core's GPTModel built the way these tests train it.
"""
