"""tools/step_files.py: one steady ZeRO-3 step's files of fsdp/ and dbuffer/, each with its calls,
and a total that counts exactly the files listed; the step's own phases are among them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_files_lists_the_files_a_step_runs_and_counts_them() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "step_files.py"), "--world", "4", "--functions"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "fake world 4" in out and "avx512f" in out, out[:500]
    files = dict((m.group(2), int(m.group(1))) for m in re.finditer(r"^\s*(\d+)  ((?:fsdp|dbuffer)/\S+\.py)$", out, re.M))
    total = re.search(r"^files: (\d+) \(fsdp (\d+), dbuffer (\d+)\)$", out, re.M)
    assert total, out[-2000:]
    assert int(total.group(1)) == len(files) == int(total.group(2)) + int(total.group(3)), (total.group(0), files)
    assert int(total.group(2)) == sum(f.startswith("fsdp/") for f in files), files
    for path in ("fsdp/unit/state.py", "fsdp/group/unsharder.py", "fsdp/group/grads.py", "dbuffer/collectives.py",
                 "fsdp/optim/step_hooks.py"):  # forward and backward hooks, the collectives, the optimizer hook
        assert files.get(path, 0) > 0, (path, files)
    assert all((ROOT / path).is_file() for path in files), files
    # --functions: the unit's hooks are listed under their file
    state = re.split(r"^\s*\d+  (?:fsdp|dbuffer)/", out.split("fsdp/unit/state.py\n")[1], flags=re.M)[0]
    assert re.search(r"^\s+\d+  _pre_forward$", state, re.M) and re.search(r"^\s+\d+  _pre_backward$", state, re.M), state[:800]
