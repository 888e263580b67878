"""The user docs cannot rot: every fenced ``python`` block in them runs, and every tool command
they show exists with the flags shown.

Documents: README.md, fsdp/README.md, dbuffer/README.md, tools/README.md (:data:`DOCS`).

How a ``python`` block runs (the convention, also in CONTRIBUTING.md, "Examples in the docs"):

* on every rank of a 2-rank gloo world whose default process group is already initialised (as in
  a script under ``torchrun`` after ``init_process_group``), in a fresh namespace, with a fresh
  temporary directory as the working directory (shared by the ranks: checkpoints land there);
* an HTML comment on the line right before the opening fence sets options, comma-separated:
  ``<!-- doc-test: continue -->`` runs the block in the namespace of the block before it (the
  two are one example told in two parts), ``<!-- doc-test: world=4 -->`` runs the example on 4
  ranks (on its first block), and ``<!-- doc-test: script -->`` marks a whole program that
  initialises and leaves ``torch.distributed`` itself: it runs under ``torchrun`` on 2 ranks and
  must exit 0;
* after an example, the process-wide switches an example may turn (``fsdp.torch_names``, the
  optimizer step hooks, dbuffer's debug mode) are put back, so examples do not leak into each
  other or into other tests sharing the gloo workers;
* every block asserts what its text claims: it holds at least one ``assert`` statement
  (:func:`test_every_example_asserts_what_it_claims`). A ``script`` example is exempt: its claim is
  how the process ends, which the test asserts itself (exit code 0, no "terminate called").

A block fails the test with the rank's traceback, whose file and line are the document's.
Shell blocks are not run; instead every ``python3 tools/<tool>.py`` (or ``torchrun ...
tools/<tool>.py``) command anywhere in the documents must name an existing tool, and each
``--flag`` shown must appear in that tool's ``--help`` (``tools/dev.py demo ...`` passes its
flags to ``tools/demo.py``; ``tools/dev.py test ...`` to pytest, not checked here).
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness import RankError, run_ranks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "fsdp/README.md", "dbuffer/README.md", "tools/README.md")
OPTIONS = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass
class Example:
    """One runnable example: one or more ``python`` blocks of a document, run in one namespace."""

    path: str
    line: int  # first line of the first block's code (1-based)
    world: int = 2
    script: bool = False
    blocks: list[tuple[int, str]] = field(default_factory=list)  # (first code line, code)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def fenced_blocks(text: str) -> list[tuple[str, int, str, list[str]]]:
    """``(language, first code line, code, options)`` of every fenced block of a markdown text."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"unclosed code fence at line {i + 1}")
        option = OPTIONS.match(lines[i - 1]) if i > 0 else None
        options = [o.strip() for o in option.group(1).split(",") if o.strip()] if option else []
        out.append((opening.group(1), i + 2, "\n".join(lines[i + 1 : j]) + "\n", options))
        i = j + 1
    return out


def examples(path: str) -> list[Example]:
    found: list[Example] = []
    for language, line, code, options in fenced_blocks((ROOT / path).read_text()):
        if language != "python":
            assert not options, f"{path}:{line}: doc-test options on a {language or 'plain'} block"
            continue
        unknown = [o for o in options if o not in ("continue", "script") and not re.fullmatch(r"world=\d+", o)]
        assert not unknown, f"{path}:{line}: unknown doc-test options {unknown}"
        if "continue" in options:
            assert found and not found[-1].script, f"{path}:{line}: 'continue' without a block before it"
            found[-1].blocks.append((line, code))
            continue
        world = next((int(o[6:]) for o in options if o.startswith("world=")), 2)
        found.append(Example(path, line, world, "script" in options, [(line, code)]))
    return found


ALL = [e for path in DOCS for e in examples(path)]


def _run_example(blocks: list[tuple[int, str]], path: str, workdir: str) -> None:
    """Body on each rank: the blocks in one namespace, in ``workdir``; switches put back after."""
    import dbuffer.debug
    import fsdp

    here = os.getcwd()
    os.chdir(workdir)
    namespace: dict = {"__name__": "__main__"}
    try:
        for line, code in blocks:
            # Pad so that tracebacks give the document's line numbers.
            exec(compile("\n" * (line - 1) + code, path, "exec"), namespace)
    finally:
        os.chdir(here)
        fsdp.torch_names(False)
        fsdp.optimizer_step_hooks(True)
        dbuffer.debug.set_enabled(False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(example: Example, workdir: str) -> None:
    (line, code), = example.blocks
    script = Path(workdir) / "example.py"
    script.write_text("\n" * (line - 1) + code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(example.world),
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script)],
        capture_output=True, text=True, timeout=180, cwd=workdir, env=env,
    )
    assert run.returncode == 0, f"{example.id} exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
    assert "terminate called" not in run.stderr, run.stderr


@pytest.mark.parametrize("example", ALL, ids=[e.id for e in ALL])
def test_example_runs(example: Example) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        if example.script:
            _run_script(example, workdir)
        else:
            run_ranks(_run_example, example.world, example.blocks, example.path, workdir, backend="gloo", timeout=240)


def asserts(code: str) -> bool:
    """Whether ``code`` holds an ``assert`` statement (in any function or branch of it)."""
    return any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(code)))


@pytest.mark.parametrize("example", ALL, ids=[e.id for e in ALL])
def test_every_example_asserts_what_it_claims(example: Example) -> None:
    """An example that only runs shows that nothing raised, not that it does what its text says."""
    if example.script:  # its claim is its exit, asserted by test_example_runs
        return
    silent = [line for line, code in example.blocks if not asserts(code)]
    assert not silent, (
        f"{example.path}: the python block(s) at line(s) {silent} assert nothing: add an assert of "
        f"what the text claims (a value, a shape, an equality with a reference)"
    )


def test_the_assert_check_sees_asserts_only() -> None:
    assert asserts("x = 1\nassert x == 1\n") and asserts("def f():\n    assert True\n")
    assert not asserts("print('assert')  # assert\n") and not asserts("raise AssertionError\n")


def test_readme_is_short_and_marks_its_benchmark_table() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 15_000, f"README.md has {len(text)} characters; move detail into a guide"
    lines = text.splitlines()
    begin, end = lines.index("<!-- bench-table:begin -->"), lines.index("<!-- bench-table:end -->")
    assert lines.count("<!-- bench-table:begin -->") == lines.count("<!-- bench-table:end -->") == 1
    assert begin < end and any(line.startswith("| ") for line in lines[begin:end]), "no table between the markers"
    assert "python3 tools/dev.py demo" in text and "python3 tools/dev.py test" in text


def _torch_names_on() -> bool:
    import torch.distributed.fsdp

    import fsdp

    return torch.distributed.fsdp.fully_shard is fsdp.fully_shard


def test_a_failing_example_fails_at_its_line_and_switches_are_put_back() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        with pytest.raises(RankError, match=r'File "doc.md", line 4'):
            run_ranks(_run_example, 2, [(3, "x = 1\nassert x == 2\n")], "doc.md", workdir, backend="gloo")
        run_ranks(_run_example, 2, [(1, "import fsdp\nfsdp.torch_names()\n")], "doc.md", workdir, backend="gloo")
    assert run_ranks(_torch_names_on, 2, backend="gloo") == [False, False]


def test_the_guides_have_examples_and_the_parser_sees_options() -> None:
    assert {e.path for e in ALL} >= {"README.md", "fsdp/README.md", "dbuffer/README.md"}
    text = "intro\n<!-- doc-test: continue, world=4 -->\n```python\nx = 1\n```\n```bash\nls\n```\n"
    assert fenced_blocks(text) == [("python", 4, "x = 1\n", ["continue", "world=4"]), ("bash", 7, "ls\n", [])]


# ----------------------------------------------------------------------------- links

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_resolves() -> None:
    wrong = []
    for path in (*DOCS, "CONTRIBUTING.md"):
        for target in LINK.findall((ROOT / path).read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (ROOT / path).parent / file if file else ROOT / path
            if not linked.exists():
                wrong.append(f"{path}: {target}: no such file")
            elif anchor:
                headings = [line.lstrip("#") for line in linked.read_text().splitlines() if line.startswith("#")]
                if anchor not in {_anchor(h) for h in headings}:
                    wrong.append(f"{path}: {target}: no such heading")
    assert not wrong, "\n".join(wrong)
    assert _anchor("Memory: `out=`, release, reallocate") == "memory-out-release-reallocate"


# ----------------------------------------------------------------------------- tool commands

COMMAND = re.compile(r"(?:python3?|torchrun(?: +--?[\w-]+(?:[ =]\d+)?)*) +(tools/[\w/]+\.py)([^`\n|#;&)]*)")


def tool_commands() -> list[tuple[str, str, list[str]]]:
    """``(where, tool, flags)`` for every tool command in the documents (any block or inline)."""
    out = []
    for path in DOCS:
        for n, line in enumerate((ROOT / path).read_text().splitlines(), 1):
            for match in COMMAND.finditer(line):
                tool, args = match.group(1), match.group(2).split()
                if tool == "tools/dev.py":
                    assert args[:1] in (["demo"], ["test"]), f"{path}:{n}: tools/dev.py takes demo or test, got {args}"
                    if args[1:2] == ["--torch"]:  # dev.py's own flag, then the command's
                        assert re.fullmatch(r"\d+\.\d+\.\d+", args[2]), f"{path}:{n}: --torch takes a release, got {args}"
                        args = args[:1] + args[3:]
                    tool, args = ("tools/demo.py", args[1:]) if args[0] == "demo" else (tool, [])
                flags = [a.split("=")[0] for a in args if a.startswith("--")]
                out.append((f"{path}:{n}", tool, flags))
    return out


def _helps(tools: set[str]) -> dict[str, str]:
    """Each tool's ``--help`` text, the tools started all at once (each imports torch)."""
    runs = {t: subprocess.Popen([sys.executable, str(ROOT / t), "--help"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT) for t in sorted(tools)}
    out = {}
    for tool, run in runs.items():
        stdout, stderr = run.communicate(timeout=180)
        assert run.returncode == 0 and "usage:" in stdout, f"{tool} --help failed:\n{stdout}\n{stderr}"
        out[tool] = stdout
    return out


def test_every_tool_command_shown_exists_with_its_flags() -> None:
    commands = tool_commands()
    assert len(commands) >= 10, commands  # the parser finds the commands at all
    missing = [f"{where}: no {tool}" for where, tool, _ in commands if not (ROOT / tool).is_file()]
    assert not missing, "\n".join(missing)
    helps = _helps({tool for _, tool, flags in commands if flags})
    known = {tool: set(re.findall(r"(?<![\w-])--[\w-]+", text)) for tool, text in helps.items()}
    wrong = [f"{where}: {tool} has no {flag}" for where, tool, flags in commands for flag in flags
             if flag not in known[tool]]
    assert not wrong, "\n".join(wrong)


def test_the_command_check_would_catch_a_wrong_flag() -> None:
    demo = _helps({"tools/demo.py"})["tools/demo.py"]
    assert "--steps" in demo and "--no-such-flag" not in demo
    line = "python3 tools/dev.py demo --steps 3 | `torchrun --nproc-per-node 2 tools/demo.py --resume`"
    found = [(m.group(1), m.group(2).split()) for m in COMMAND.finditer(line)]
    assert found == [("tools/dev.py", ["demo", "--steps", "3"]), ("tools/demo.py", ["--resume"])], found
