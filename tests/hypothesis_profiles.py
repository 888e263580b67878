"""Hypothesis profiles, chosen by ``HYPOTHESIS_PROFILE`` (loaded when :mod:`tests.conftest` imports this).

* ``default``: derandomized (every run tries the same examples, so a failure reproduces on any
  machine) and each test's own small budget; the suite's everyday run.
* ``randomized``: a fresh random seed per run (``HYPOTHESIS_SEED`` fixes it; pytest's header prints
  the one used, and a failure prints how to reproduce it) and :data:`SCALE` times every budget:
  more and different cases, for CI (``.ci/run``) and for hunting bugs. Rerun a CI failure with
  ``HYPOTHESIS_PROFILE=randomized HYPOTHESIS_SEED=<seed> python3 tools/dev.py test <test>``.

A test gives its budget as ``@settings(max_examples=examples(12))``: an explicit
``max_examples`` outranks any profile, so the scaling has to happen here.
"""

from __future__ import annotations

import os
import secrets
from typing import Optional

from hypothesis import HealthCheck, settings

__all__ = ["PROFILE", "SCALE", "SEED", "examples"]

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", derandomize=True, **_COMMON)
settings.register_profile("randomized", derandomize=False, database=None, print_blob=True, max_examples=1000, **_COMMON)

PROFILE: str = os.environ.get("HYPOTHESIS_PROFILE", "default")
settings.load_profile(PROFILE)  # an unknown name raises hypothesis' InvalidArgument, naming it

SCALE: int = 3 if PROFILE == "randomized" else 1


def _seed() -> Optional[int]:
    if PROFILE != "randomized":
        return None
    given = os.environ.get("HYPOTHESIS_SEED", "").strip()
    if not given:
        return secrets.randbits(32)
    try:
        return int(given)
    except ValueError:
        raise ValueError(f"HYPOTHESIS_SEED must be an integer, got {given!r}") from None


SEED: Optional[int] = _seed()  # the randomized profile's seed for this run (None: derandomized)


def examples(n: int) -> int:
    """A test's budget of ``n`` examples under the profile in use (``n`` by default)."""
    return n * SCALE
