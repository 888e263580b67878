"""tools/dbuffer_demo.py (DBuffer primitives by hand) runs, trains, and matches single-process training."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dbuffer_demo_trains_and_matches_reference() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "dbuffer_demo.py"), "--steps", "40"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", run.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], run.stdout
    gap = float(re.search(r"reference\| after \d+ steps: (\S+)", run.stdout).group(1))
    assert gap < 1e-4, run.stdout
