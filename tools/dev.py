"""Set up an environment if needed, then run the demo or the test suite.

    python3 tools/dev.py demo [--torch VERSION] [demo args...]
    python3 tools/dev.py test [--torch VERSION] [pytest args...]

Works on a fresh clone with only Python 3.10+:

* Inside an active virtual environment, that environment is used as it is.
* Otherwise a ``.venv`` is made in the repository (with the system's site packages visible, so a
  torch the user already installed is reused rather than downloaded again).
* torch is installed only when none is importable, as ``torch==2.13.0`` (the default of the
  versions this project is tested with); a torch that is already there is never replaced.
* The project itself (editable) and its test extras are installed once, and again only when
  ``pyproject.toml`` (or :data:`CLIENTS`) changes; so are the frameworks whose own training code
  the tests run on fsdp (``tests/clients``), each pinned and ``--no-deps`` (:data:`CLIENTS`: what
  they need at run time is in the test extras; their own heavy extras, CUDA kernels, are not).

``--torch VERSION`` (e.g. ``2.15.0``): run under exactly that torch instead, in its own
``.venv-torch-VERSION`` (made without the system's site packages, so no other torch is seen;
active environments are left alone), installing ``torch==VERSION`` there when it has another
or none. CI runs the suite so on the oldest and newest supported torch (``.ci/run``); pip's
configuration applies as for any install (CI lifts this machine's cap on torch there).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
TORCH_WHEN_MISSING = "torch==2.13.0"
# Installed without their dependencies: megatron-core needs only torch, numpy and packaging (the
# project's and the test extras'), and its declared torch range must not move the torch under test.
CLIENTS = ("megatron-core==0.16.1",)
_VERSION = re.compile(r"\d+\.\d+\.\d+")


def _in_virtualenv() -> bool:
    return sys.prefix != sys.base_prefix


def _python_of(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _torch_version() -> Optional[str]:
    """The installed torch's release (``2.15.0`` for ``2.15.0+cu132``), or None; from its
    metadata, without importing it."""
    try:
        return importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def _ensure_installed(torch_pin: Optional[str]) -> None:
    """torch (``torch_pin`` exactly, else any, else the default), the project and the clients,
    once per ``pyproject.toml`` (and pin, and :data:`CLIENTS`)."""
    stamp = Path(sys.prefix) / ".dbuffer-fsdp-installed"
    wanted = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + (torch_pin or "").encode() + " ".join(CLIENTS).encode()
    ).hexdigest()
    have = _torch_version()
    if stamp.exists() and stamp.read_text() == wanted and (torch_pin is None or have == torch_pin):
        return
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if torch_pin is not None and have != torch_pin:
        _run(pip + [f"torch=={torch_pin}"])
    elif have is None:
        _run(pip + [TORCH_WHEN_MISSING])
    _run(pip + ["-e", f"{ROOT}[test]"])
    _run(pip + ["--no-deps", *CLIENTS])
    stamp.write_text(wanted)


def _split_torch(args: list[str]) -> tuple[Optional[str], list[str]]:
    """``--torch VERSION`` (or ``--torch=VERSION``) right after the command, and the rest."""
    if args[:1] == ["--torch"] and len(args) >= 2:
        version, rest = args[1], args[2:]
    elif args[:1] and args[0].startswith("--torch="):
        version, rest = args[0].split("=", 1)[1], args[1:]
    elif args[:1] == ["--torch"]:
        raise SystemExit("error: --torch needs a version, e.g. --torch 2.15.0")
    else:
        return None, args
    if not _VERSION.fullmatch(version):
        raise SystemExit(f"error: --torch takes a release such as 2.15.0, got {version!r}")
    return version, rest


def _enter(venv: Path, system_site_packages: bool) -> None:
    """Run this script again with ``venv``'s Python (made first if missing), unless it is the
    one running now."""
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    if not _python_of(venv).exists():
        _run([sys.executable, "-m", "venv", *(["--system-site-packages"] if system_site_packages else []), str(venv)])
    os.execv(str(_python_of(venv)), [str(_python_of(venv)), __file__, *sys.argv[1:]])


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test"):
        print(__doc__)
        return 2
    command = sys.argv[1]
    torch_pin, rest = _split_torch(sys.argv[2:])
    if torch_pin is not None:
        _enter(ROOT / f".venv-torch-{torch_pin}", system_site_packages=False)
    elif not _in_virtualenv():
        _enter(VENV, system_site_packages=True)
    _ensure_installed(torch_pin)
    os.chdir(ROOT)
    if command == "demo":
        return subprocess.call([sys.executable, str(ROOT / "tools" / "demo.py"), *rest])
    code = subprocess.call([sys.executable, "-m", "pytest", *rest])
    if code == 5:
        print("error: pytest collected no tests; that is a failure, not a pass", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
