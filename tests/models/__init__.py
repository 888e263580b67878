"""Models and model descriptions shared by the library tests and the tools.

* ``llama.py``: a small Llama-style decoder in plain ``torch.nn`` (the demo's and benchmarks'
  model; tests/fsdp/test_compile.py and test_activation_checkpoint.py train it);
* ``float8_weight.py``: a float8 all-gather weight subclass speaking FSDP2's all-gather protocol
  (tests/fsdp/test_extensions.py, tools/bench_fp8_gather.py);
* ``shapes.py``: parameter shapes of published models (Llama-3, Mixtral) in registration order,
  without building them (tests/dbuffer/test_layout.py, tools/padding_report.py, ...);
* ``threads.py``: ranks as threads of one process on torch's threaded process group (the tests'
  harness and ``tools/gpu_check.py``'s multi-rank rows, on one GPU or the CPU);
* ``device_standins.py``: CPU stand-ins for what a GPU does differently (copies, syncs).

Dependencies point one way: tools import from here, nothing here (nor any library test) imports
from ``tools``. The tiny parity-test models stay in ``tests/fsdp/models.py`` and ``moe.py``.
"""
