"""One Llama training step benchmarked several ways: the core of ``tools/bench_fsdp.py`` (which
parses the flags and launches the ranks) and of ``tools/mem_timeline.py`` (which builds the same
methods to say where their memory peaks).

* ``methods.py``: the configuration, the models (the Llama, with a head-only root, with float8
  all-gather weights), the methods (ours on both layouts, FSDP2, the floor, ours' variants, the
  raw-c10d replay), their batches;
* ``run.py``: the measured run on an initialised process group, its ratios and targets, and the
  profile of one method;
* ``counts.py``: ``--counts``, the collectives of one step per model, ours against FSDP2;
* ``report.py``: the table and the plot;
* ``markdown.py``: the results file as the markdown table README.md shows.
"""
