"""Set up an environment if needed, then run the demo or the test suite.

    python3 tools/dev.py demo [demo args...]
    python3 tools/dev.py test [pytest args...]

Works on a fresh clone with only Python 3.10+:

* Inside an active virtual environment, that environment is used as it is.
* Otherwise a ``.venv`` is made in the repository (with the system's site packages visible, so a
  torch the user already installed is reused rather than downloaded again).
* torch is installed only when none is importable, as ``torch==2.13.0`` (the version this project
  is tested with); a torch that is already there is never replaced.
* The project itself (editable) and its test extras are installed once, and again only when
  ``pyproject.toml`` changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
TORCH_WHEN_MISSING = "torch==2.13.0"


def _in_virtualenv() -> bool:
    return sys.prefix != sys.base_prefix


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _ensure_installed() -> None:
    stamp = Path(sys.prefix) / ".dbuffer-fsdp-installed"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
        return
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    try:
        import torch  # noqa: F401
    except ImportError:
        _run(pip + [TORCH_WHEN_MISSING])
    _run(pip + ["-e", f"{ROOT}[test]"])
    stamp.write_text(wanted)


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test"):
        print(__doc__)
        return 2
    if not _in_virtualenv():
        if not _venv_python().exists():
            _run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)])
        os.execv(str(_venv_python()), [str(_venv_python()), __file__, *sys.argv[1:]])
    _ensure_installed()
    os.chdir(ROOT)
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "demo":
        return subprocess.call([sys.executable, str(ROOT / "tools" / "demo.py"), *rest])
    code = subprocess.call([sys.executable, "-m", "pytest", *rest])
    if code == 5:
        print("error: pytest collected no tests; that is a failure, not a pass", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
