"""tools/dev.py's ``--torch VERSION`` (its own venv, that torch installed there) and what CI runs:
the README's command, then the oldest and newest supported torch, as README and CONTRIBUTING say."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dbuffer.torch_version import MINIMUM, TESTED
from tools import dev

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["-x", "tests/dbuffer"], (None, ["-x", "tests/dbuffer"])),
        (["--torch", "2.15.0", "-x"], ("2.15.0", ["-x"])),
        (["--torch=2.11.0"], ("2.11.0", [])),
        (["-k", "--torch"], (None, ["-k", "--torch"])),  # only right after the command
    ],
)
def test_split_torch(args: list[str], expected) -> None:
    assert dev._split_torch(args) == expected


@pytest.mark.parametrize("args, message", [(["--torch"], "needs a version"), (["--torch", "2.15"], "such as 2.15.0"), (["--torch=latest"], "'latest'")])
def test_split_torch_refuses_a_missing_or_partial_version(args: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        dev._split_torch(args)


def _installs(monkeypatch, tmp_path: Path, pin, have, stamp: bool) -> list[list[str]]:
    """The pip commands ``_ensure_installed(pin)`` runs in a fake environment holding torch
    ``have`` (None: none), stamped as up to date or not."""
    ran: list[list[str]] = []
    tmp_path.mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(dev, "_torch_version", lambda: have)
    monkeypatch.setattr(dev, "_run", lambda cmd: ran.append(cmd[cmd.index("-q") + 1 :]))
    if stamp:
        dev._ensure_installed(pin)  # writes the stamp
        ran.clear()
    dev._ensure_installed(pin)
    return ran


PROJECT = ["-e", f"{ROOT}[test]"]
CLIENTS = ["--no-deps", "megatron-core==0.16.1"]  # tests/clients: the frameworks' own code, pinned


def test_a_pinned_torch_is_installed_when_another_or_none_is_there(monkeypatch, tmp_path) -> None:
    project = [PROJECT, CLIENTS]
    assert _installs(monkeypatch, tmp_path / "a", "2.15.0", None, False) == [["torch==2.15.0"], *project]
    assert _installs(monkeypatch, tmp_path / "b", "2.15.0", "2.13.0", False) == [["torch==2.15.0"], *project]
    assert _installs(monkeypatch, tmp_path / "c", "2.15.0", "2.15.0", False) == project
    assert _installs(monkeypatch, tmp_path / "d", "2.15.0", "2.15.0", True) == []  # stamped: nothing
    assert _installs(monkeypatch, tmp_path / "e", "2.15.0", "2.13.0", True) == [["torch==2.15.0"], *project]


def test_without_a_pin_a_torch_already_there_is_kept(monkeypatch, tmp_path) -> None:
    project = [PROJECT, CLIENTS]
    assert _installs(monkeypatch, tmp_path / "a", None, "2.11.0", False) == project
    assert _installs(monkeypatch, tmp_path / "b", None, None, False) == [[dev.TORCH_WHEN_MISSING], *project]
    assert _installs(monkeypatch, tmp_path / "c", None, "2.11.0", True) == []


def test_the_clients_are_installed_without_dependencies_and_their_needs_are_test_extras() -> None:
    """megatron-core's declared torch range must not move the torch under test; what it needs at
    run time (numpy, packaging) comes with the project and its test extras."""
    assert dev.CLIENTS == ("megatron-core==0.16.1",)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"numpy>=' in pyproject and '"packaging>=24.2"' in pyproject


def test_ci_runs_the_readme_command_the_randomized_hypothesis_tests_then_the_oldest_and_newest_torch() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if "tools/dev.py" in line and not line.startswith("#")]
    assert commands[0] == "python3 tools/dev.py test || status=1"
    assert re.search(r"for version in (\S+) (\S+); do", ci).groups() == (TESTED[0], TESTED[-1])
    assert "HYPOTHESIS_PROFILE=randomized python3 tools/dev.py test -m hypothesis || status=1" in commands[1]
    assert 'PIP_CONFIG_FILE=/dev/null python3 tools/dev.py test --torch "$version" --ignore=tests/tools' in commands[2]
    assert dev.TORCH_WHEN_MISSING == f"torch=={TESTED[1]}"  # the default is the middle one
    assert TESTED[0].startswith(f"{MINIMUM[0]}.{MINIMUM[1]}.")


def test_the_docs_name_the_tested_versions_and_the_minimum() -> None:
    readme, contributing = (ROOT / "README.md").read_text(), (ROOT / "CONTRIBUTING.md").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={MINIMUM[0]}.{MINIMUM[1]}"' in pyproject
    for text in (readme, contributing):
        assert all(version in text for version in TESTED), [v for v in TESTED if v not in text]
    assert f"PyTorch {MINIMUM[0]}.{MINIMUM[1]} to" in readme
