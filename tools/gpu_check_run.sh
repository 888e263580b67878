#!/usr/bin/env bash
# The command a session lent a GPU hands the device tool, which runs it in the repository root with
# its own torch and sets $OUT to the folder whose files come back:
#
#     bash tools/gpu_check_run.sh
#
# Everything tools/gpu_check.py prints (the table on stdout, each row's progress and tracebacks on
# stderr) goes to the terminal and to $OUT/gpu_check.log; the results as data to
# $OUT/gpu_check-cuda.json and .txt. Extra arguments go to tools/gpu_check.py (e.g. --only matrix).
# Exit status: tools/gpu_check.py's (1 when a row failed).
set -o pipefail
OUT="${OUT:-tools/results}"
mkdir -p "$OUT"
PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
