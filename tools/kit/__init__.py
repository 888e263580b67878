"""What the tools share: launching their ranks and measuring what a step costs.

* ``launch.py``: N ranks on this host (a free port, spawned processes, gloo over loopback), or
  this process as one of torchrun's ranks; every rank leaves through
  ``dbuffer.teardown.shutdown`` (CONTRIBUTING.md, "One way out");
* ``threads.py``: N ranks as threads of this process on torch's threaded process group (real
  data, one device for all: tools/gpu_check.py's worlds of 2 and 4 on one GPU);
* ``comm.py``: ``CommCounter``, the c10d calls a step makes (calls, operations, bytes sent) and
  the collectives it asks for (all-gathers, reduce-scatters, ...);
* ``comm_replay.py``: those calls recorded and replayed alone (bench_fsdp's raw-c10d reference);
* ``memory.py``: ``StorageTracker`` (live and peak bytes of the storages a step holds or
  touches), ``live_storages``, ``release_library_caches``;
* ``timing.py``: timing helpers and the one-thread matmul probe;
* ``results.py``: benchmark results as data (``tools/results/<tool>.json``: the latest run per
  mode, with the date, command and host), from which ``tools/render_results.py`` makes tables.

A tool is a thin driver over these: its own model and methods, its report, its flags.
"""
