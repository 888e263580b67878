"""Make the benchmark tables from the results files: README.md's and ``tools/results/*.md``.

    python3 tools/render_results.py            # rewrite them from tools/results/*.json
    python3 tools/render_results.py --check    # change nothing; exit 1 naming each one out of date

A benchmark saves its latest run per mode to ``tools/results/<tool>.json``
(:mod:`tools.kit.results`); this tool renders each such file it knows (``RENDERERS``) to
``tools/results/<tool>.md`` and puts bench_fsdp's table into README.md between the lines
``<!-- bench-table:begin -->`` and ``<!-- bench-table:end -->`` (everything between them is
replaced; nothing else in README.md is touched). Without ``tools/results/bench_fsdp.json`` README's
table is left alone. ``--check`` is for CI and review: a table typed by hand, or results
committed without their table, fail it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.kit import results  # noqa: E402
from tools.step_bench import markdown  # noqa: E402

RENDERERS: dict[str, Callable[[dict], str]] = {"bench_fsdp": markdown.render}
README_TOOL = "bench_fsdp"  # whose table README.md shows
BEGIN, END = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"


def replace_block(text: str, table: str, where: str = "README.md") -> str:
    """``text`` with everything between the marker lines replaced by ``table``."""
    lines = text.splitlines(keepends=True)
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError(f"{where}: needs exactly one line {BEGIN!r} and, after it, one line {END!r} around the "
                         f"benchmark table (found {len(begins)} and {len(ends)}); put them around the table")
    body = table if table.endswith("\n") else table + "\n"
    return "".join(lines[: begins[0] + 1]) + body + "".join(lines[ends[0]:])


def rendered(results_dir: Path, readme: Path) -> list[tuple[Path, str]]:
    """(path, the text it should have) for every file this tool makes."""
    out = []
    for tool, render in RENDERERS.items():
        source = results_dir / f"{tool}.json"
        if not source.exists():
            continue
        table = render(results.load(source, tool))
        out.append((results_dir / f"{tool}.md", table))
        if tool == README_TOOL:
            out.append((readme, replace_block(readme.read_text(), table, str(readme))))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    ap.add_argument("--results-dir", type=Path, default=results.RESULTS_DIR)
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = ap.parse_args(argv)
    try:
        targets = rendered(args.results_dir, args.readme)
    except ValueError as exc:
        print(f"render_results: {exc}", file=sys.stderr)
        return 2
    if not targets:
        print(f"render_results: no results in {args.results_dir} (run the benchmarks first); nothing to do")
        return 0
    stale = [path for path, text in targets if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path} (python3 tools/render_results.py rewrites it)")
        return 1 if stale else 0
    for path, text in targets:
        if path in stale:
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
