"""One command that checks every CUDA path of fsdp when a GPU is lent, and prints one table.

    python3 tools/gpu_check.py                         # one GPU: everything, about 4 minutes
    python3 tools/gpu_check.py --cpu                   # the same code on gloo, tiny sizes (CI)
    python3 tools/gpu_check.py --only matrix/bf16,multirank/w4   # a subset: fnmatch patterns or substrings
    python3 tools/gpu_check.py --list                  # the rows, without running anything

A session lent a GPU hands the device tool this line (``tools/gpu_check_run.sh`` is the same); the
machine runs it in the repository root with its own torch and nothing installed, which is why this
file puts the repository root on ``sys.path`` itself:

    PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --out $OUT 2>&1 | tee $OUT/gpu_check.log

Why one command: GPU time comes rarely and in minutes, so everything that needs a GPU is prepared
to run in one call and report at once, and the same code runs on the CPU in the suite
(``tests/tools/test_gpu_check.py``) so that it does not rot between GPU sessions.

What runs, section by section, each in its own process (a crash, an NCCL abort or a hang then
ends one section, not the run; the rows it had finished stay, the row it was in is reported with
how the process ended, and the rest of the section as not run):

1. ``matrix`` (:mod:`tools.gpu_checks.matrix`): world 1, NCCL on cuda:0 (gloo with ``--cpu``),
   with a group of one calling c10d as world N does: fsdp against the plain model and torch FSDP2
   in fp32, bf16, both layouts, every strategy, no reshard, gradient accumulation, activation
   checkpointing, compiled blocks, CPU offload pinned and pageable, BF16 main grads with
   FlatAdamW, a DCP save/resume, float8 all-gather weights, Muon on Owned buckets.
2. ``multirank`` (:mod:`tools.gpu_checks.multirank`): worlds of 2 and 4 as threads on one device
   (torch's threaded group), fsdp against FSDP2 in the same harness and the plain model: fp32,
   bf16, float8, reshard_after_forward=2, HSDP 2x2.
3. ``profile`` (:mod:`tools.gpu_checks.profiling`): the ``fsdp::`` ranges of two training steps,
   and on CUDA the streams the collectives', copy and compute kernels ran on.
4. ``memory`` (:mod:`tools.gpu_checks.bench`): peak memory per rank on a fake world of 8, ours and
   row against FSDP2 (``tools/bench_gpu.py``'s measurement), and the host time per unit per step
   of ours, FSDP2 and ours + FlatAdamW on the same fake world (``tools/bench_host.py``'s).
5. ``bench``: ``tools/bench_gpu.py``'s world-1 step time and peak of ours, row, FSDP2, floor.

Time: at most ``--timeout`` seconds in all (240 on CUDA), each section at most its own limit
(:data:`SECTIONS`); a section past it is killed and its unfinished rows fail, saying so.

Output: a header (device, torch, CUDA and NCCL versions, or the CPU and its flags; the sizes),
the table (per row: verdict, max|dW| against the plain model and against FSDP2 with their
tolerances, first and last losses, seconds, the other checks and figures; a row that raised shows
its exception, type and message), a summary line, and the same as data in ``--out`` (default
``tools/results/``): ``gpu_check-cuda.json`` or ``gpu_check-cpu.json`` (``tools/kit/results.py``'s
format: date, command, host, every row with its checks and tracebacks) and the printed text as
``gpu_check-<mode>.txt``. Exit code 1 when any row failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools.gpu_checks import bench, common, matrix, multirank, profiling  # noqa: E402
from tools.gpu_checks.rows import FAIL, Row, summary, table  # noqa: E402
from tools.kit import results  # noqa: E402

# name -> (row names of a setup, the section's body, seconds it may take on cuda / cpu). In the order
# they run: correctness first, timings last, so that a slow run loses the least important rows.
SECTIONS = {
    "matrix": (matrix.names, matrix.run, {"cuda": 120, "cpu": 600}),
    "multirank": (multirank.names, multirank.run, {"cuda": 60, "cpu": 600}),
    "profile": (profiling.names, profiling.run, {"cuda": 40, "cpu": 300}),
    "memory": (lambda s: bench.names(s, "memory"), bench.run_memory, {"cuda": 80, "cpu": 300}),
    "bench": (lambda s: bench.names(s, "bench"), bench.run_bench, {"cuda": 75, "cpu": 300}),
}
DETERMINISTIC = ("matrix", "multirank")  # on CUDA: deterministic kernels, cuBLAS's workspace setting
TOTAL_SECONDS = {"cuda": 240, "cpu": 1500}  # the whole run; each section gets what is left, at most its own


def header(setup: common.Setup) -> list[str]:
    """Where this ran: the device and library versions, then the sizes."""
    info = results.host_info()
    lines = []
    if setup.cuda:
        props = torch.cuda.get_device_properties(0)
        nccl = _nccl_version()
        lines.append(f"device: {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
                     f"{torch.cuda.device_count()} visible); torch {torch.__version__}, CUDA {torch.version.cuda}, "
                     f"NCCL {nccl}; host {info['cpu']}, {info['usable_cores']} cores")
    else:
        flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in info["flags"].items())
        lines.append(f"device: CPU {info['cpu']}, {info['usable_cores']} usable cores ({flags}); "
                     f"torch {torch.__version__}; gloo")
    lines.append(f"python {info['python']}; commit {_commit()}")
    cublas = common.cuda_env()["CUBLAS_WORKSPACE_CONFIG"]
    lines.append(f"matrix, multirank, profile: {setup.describe()}; "
                 + (f"matrix and multirank with deterministic algorithms (warn only), CUBLAS_WORKSPACE_CONFIG={cublas}"
                    if setup.cuda else "gloo, deterministic on the CPU"))
    lines.append(f"memory, bench: {bench.describe(setup)}")
    return lines


def _nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - a header figure, never a reason to stop
        return f"? ({type(exc).__name__})"
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "") if out.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _section_process(name: str, setup: common.Setup, only: str, timeout: float) -> list[Row]:
    """Run one section in a fresh process; its rows, plus a FAIL row for each selected row it did
    not finish (saying how the process ended)."""
    wanted = [n for n in SECTIONS[name][0](setup) if common.selected(f"{name}/{n}", _patterns(only))]
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.jsonl")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--rows-file", rows_file, "--only", only]
        if not setup.cuda:
            cmd.append("--cpu")
        env = common.cuda_env() if setup.cuda and name in DETERMINISTIC else dict(os.environ)
        try:
            out = sys.stderr.fileno()  # the child's progress goes where ours does; stdout stays the table's
        except (AttributeError, OSError, ValueError):
            out = None
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=max(1.0, timeout))
            ended = None if code == 0 else _how(code)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the section's own process group
            proc.wait()
            ended = f"the section process was killed after {timeout:.0f} s (a hang or too slow)"
        except BaseException:  # Ctrl-C: its own session does not get the signal, so end it here
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        entries = []
        if os.path.exists(rows_file):
            with open(rows_file) as f:
                entries = [json.loads(line) for line in f if line.strip()]
    return _collect(name, wanted, entries, ended)


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"the section process died with {signal.Signals(-code).name}"
        except ValueError:
            return f"the section process died with signal {-code}"
    return f"the section process exited with code {code}"


def _collect(section: str, wanted: list[str], entries: list[dict], ended: Optional[str]) -> list[Row]:
    """The rows of a section's file; FAIL rows for the one it was in when it ended and for those
    it never reached; a FAIL row for the process itself if it ended badly after its last row."""
    rows = [Row.from_dict(e["row"]) for e in entries if "row" in e]
    done = {r.full_name for r in rows}
    started = [e["started"] for e in entries if "started" in e]
    section_error = next((e["section_error"] for e in entries if "section_error" in e), None)
    why = ended or "the section ended without it"
    if section_error:
        why = f"the section raised {section_error['error']}"
    for n in wanted:
        full = f"{section}/{n}"
        if full in done:
            continue
        row = Row(section, n, error=(f"{why} during this row" if full in started else f"not run: {why}"))
        if section_error:
            row.traceback = section_error.get("traceback")
        rows.append(row)
    if ended and len(done) == len(wanted):  # e.g. an abort while tearing NCCL down
        rows.append(Row(section, "(process)", error=ended))
    return rows


def _patterns(only: str) -> list[str]:
    return [p for p in only.split(",") if p]


def run_section(name: str, setup: common.Setup, only: str, rows_file: str) -> None:
    """The child: run section ``name``'s rows into ``rows_file``, then leave through dbuffer's teardown."""
    import traceback

    from dbuffer.teardown import shutdown

    ctx = common.Context(setup, name, only, rows_file)
    try:
        SECTIONS[name][1](ctx)
    except Exception as exc:  # noqa: BLE001 - outside any row (setup): the driver reports it on the rows
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        with open(rows_file, "a") as f:
            f.write(json.dumps({"section_error": {"error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                                                  "traceback": tb}}) + "\n")
    shutdown(0, barrier=False)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo, tiny sizes) instead of cuda:0")
    parser.add_argument("--only", default="", help="comma-separated fnmatch patterns or substrings of row names "
                        "(section/row, as --list prints them)")
    parser.add_argument("--out", default=str(results.RESULTS_DIR),
                        help="folder for gpu_check-<cuda|cpu>.json and .txt (default: tools/results)")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds for the whole run (default {TOTAL_SECONDS['cuda']} on CUDA, {TOTAL_SECONDS['cpu']} on CPU)")
    parser.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)  # the driver's children
    parser.add_argument("--rows-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = common.Setup("cpu" if args.cpu else "cuda")
    if args.list:  # the rows of a run on this device kind (no device needed)
        for name, (names, _, _) in SECTIONS.items():
            print("\n".join(f"{name}/{n}" for n in names(setup)))
        return 0
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: use --cpu for the CPU run")
    if args.section:
        run_section(args.section, setup, args.only, args.rows_file)
    lines = header(setup)
    print("\n".join(lines), flush=True)
    start = time.perf_counter()
    total = args.timeout or TOTAL_SECONDS[setup.device]
    rows: list[Row] = []
    for name, (names, _, budget) in SECTIONS.items():
        if not any(common.selected(f"{name}/{n}", _patterns(args.only)) for n in names(setup)):
            continue
        left = total - (time.perf_counter() - start)
        if left <= 0:
            wanted = [n for n in names(setup) if common.selected(f"{name}/{n}", _patterns(args.only))]
            rows += _collect(name, wanted, [], f"--timeout {total:g} s was used up before this section")
            continue
        rows += _section_process(name, setup, args.only, min(budget[setup.device], left))
    seconds = time.perf_counter() - start
    text = table(rows) + [summary(rows) + f"; {seconds:.0f} s"]
    print("\n".join(text), flush=True)
    _save(Path(args.out), setup, lines, text, rows, seconds)
    return 1 if not rows or any(r.verdict == FAIL for r in rows) else 0


def _save(out: Path, setup: common.Setup, head: list[str], text: list[str], rows: list[Row], seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rec = results.record(results.command_line(sys.argv), device=setup.device, header=head,
                         rows=[r.to_dict() for r in rows], passed=all(r.verdict != FAIL for r in rows),
                         seconds=round(seconds, 1))
    results.save(out / f"gpu_check-{setup.device}.json", setup.device, rec, tool="gpu_check")
    (out / f"gpu_check-{setup.device}.txt").write_text("\n".join(head + text) + "\n")
    print(f"saved {out / f'gpu_check-{setup.device}.json'} and .txt", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
