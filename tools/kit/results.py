"""Benchmark results as data: each run saved with the host it ran on, so that tables are made
from files, not typed by hand.

A benchmark keeps one JSON file under ``tools/results/`` (``bench_fsdp.json``) holding the latest
run per mode (``{"tool": ..., "runs": {mode: record}}``; a run of one mode leaves the others as
they were). A record is :func:`record`'s: the date (UTC), the command line, the host
(:func:`host_info`: CPU model, the flags that decide matmul speed, cores, torch), plus whatever
the benchmark measured. Next to it, the benchmark writes the same results as a markdown table
(``bench_fsdp.md``), and ``tools/render_results.py`` makes README.md's table from the JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
from pathlib import Path
from typing import Any, Optional

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
ROOT = RESULTS_DIR.parent.parent
# CPU flags that change how fast a training step's matmuls run: AVX-512 (fp32), native bf16
# dot products (AVX512-BF16), AMX tiles (bf16/int8 matrix units); AVX2 alone means slow bf16.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of this host's first CPU from /proc/cpuinfo; ("", empty) elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model or platform.machine(), flags


def host_info() -> dict[str, Any]:
    """What a reader needs to compare a run with another: CPU, its speed flags, cores, torch."""
    import torch

    model, flags = _cpuinfo()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": model,
        "flags": {f: f in flags for f in SPEED_FLAGS},
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def command_line(argv: list[str], launcher: str = "python3") -> str:
    """``argv`` (``sys.argv``) as a command to rerun from the repository root."""
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(shlex.quote(a) for a in [launcher, str(script), *argv[1:]])


def record(command: str, **measured: Any) -> dict[str, Any]:
    """One run's record: date, command, host, and ``measured`` (the benchmark's own fields)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "command": command, "host": host_info(), **measured}


def load(path: Path, tool: Optional[str] = None) -> dict[str, Any]:
    """The results file at ``path`` (an empty one for ``tool`` when it does not exist yet)."""
    path = Path(path)
    if not path.exists():
        return {"tool": tool or path.stem, "runs": {}}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        raise ValueError(f"{path}: not a results file (expected {{'tool': ..., 'runs': {{mode: record}}}}); "
                         f"move it away and run the benchmark again")
    return data


def save(path: Path, mode: str, rec: dict[str, Any], tool: Optional[str] = None) -> dict[str, Any]:
    """Put ``rec`` as the latest run of ``mode`` into the results file at ``path``; the other
    modes' runs stay. Returns the whole file's contents, as read back."""
    path = Path(path)
    data = load(path, tool)
    data["runs"][mode] = rec
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    path.write_text(text)
    return json.loads(text)  # as a reader of the file sees it (lists, not tuples)


def describe_host(rec: dict[str, Any]) -> str:
    """One line: ``AMD EPYC, 2 cores, avx512f yes, avx512_bf16 yes, amx_bf16 no, torch 2.13.0``."""
    host = rec.get("host", {})
    flags = host.get("flags", {})
    shown = ", ".join(f"{f} {'yes' if flags[f] else 'no'}" for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    return (f"{host.get('cpu', '?')}, {host.get('usable_cores', host.get('cores', '?'))} cores"
            + (f", {shown}" if shown else "") + f", torch {host.get('torch', '?')}")
