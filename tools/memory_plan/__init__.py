"""The memory planner behind ``tools/plan_memory.py`` (which says what it measures and why):

* ``presets.py``: the preset models (Llama-3 8B / 70B, Mixtral 8x7B), shapes only;
* ``planner.py``: :func:`~tools.memory_plan.planner.plan`, sharding a model on a fake world as one
  rank and checking it;
* ``measure.py``: the bytes of every unit's buffers, and the schedule probe (which units hold
  their gathered weights and gradient buffers at once);
* ``closed_form.py``: the same bytes from the parameter shapes, strategy and policy alone;
* ``report.py``: :class:`~tools.memory_plan.report.Bytes` and
  :class:`~tools.memory_plan.report.Plan`, what a plan holds and prints.
"""
