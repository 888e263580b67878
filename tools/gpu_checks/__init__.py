"""The sections of ``tools/gpu_check.py``, each run in its own process by the driver.

* ``rows.py``: a row, its checks and verdict, the table (plain data: no torch);
* ``common.py``: the run's sizes and tolerances, the Llama on text, training, full weights and the
  comparisons, the :class:`~tools.gpu_checks.common.Context` that runs one row;
* ``matrix.py`` (world 1, fsdp vs the plain model and FSDP2 in every configuration),
  ``multirank.py`` (threaded worlds of 2 and 4 on one device), ``profiling.py`` (fsdp:: ranges,
  CUDA streams), ``bench.py`` (``memory`` at a fake world of 8 and ``bench``, both through
  ``tools/bench_gpu.py``).

A section module has ``names(setup)`` (its rows, for ``--list`` and ``--only``) and a ``run(ctx)``
that calls ``ctx.row(name, body)`` for each; a row's exception is its verdict, never the run's.
"""
