"""dbuffer.torch_version: the minimum torch checked at import, and the error of a feature whose
torch API is missing. Driven by fake version strings: no old torch needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dbuffer import torch_version
from dbuffer.torch_version import MINIMUM, TorchVersionError, check, parse, require

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version, expected",
    [("2.11.0", (2, 11)), ("2.11.0+cu130", (2, 11)), ("2.15.0.dev20260101+cpu", (2, 15)), ("2.13.0a0+git1234", (2, 13)), ("3.0", (3, 0)), ("10.2.1", (10, 2))],
)
def test_parse_reads_major_and_minor(version: str, expected: tuple[int, int]) -> None:
    assert parse(version) == expected


@pytest.mark.parametrize("version", ["", "two.eleven", "2", "v2.11.0"])
def test_parse_refuses_what_is_not_a_version(version: str) -> None:
    with pytest.raises(ValueError, match="cannot read a torch version"):
        parse(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.15.0", "3.0.0"])
def test_supported_versions_pass(version: str) -> None:
    check(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0+cu128", "2.9.1", "1.13.1"])
def test_older_versions_raise_import_error_naming_both_versions(version: str) -> None:
    with pytest.raises(ImportError) as info:
        check(version)
    message = str(info.value)
    assert f"torch {MINIMUM[0]}.{MINIMUM[1]} or newer" in message
    assert f"this is torch {version}" in message
    assert "pip install 'torch>=2.11'" in message


def test_an_unreadable_version_raises_import_error() -> None:
    with pytest.raises(ImportError, match="cannot read a torch version from 'nightly'"):
        check("nightly")


def test_the_installed_torch_passes_and_is_the_default() -> None:
    check()  # the suite runs on a supported torch
    assert torch_version._installed() == torch.__version__


def test_require_names_the_feature_the_versions_and_the_hint() -> None:
    with pytest.raises(TorchVersionError) as info:
        require("frobnicate", (2, 14), "Use frob() instead", version="2.11.0+cu130")
    assert str(info.value) == "frobnicate needs torch 2.14 or newer; this is torch 2.11.0+cu130. Use frob() instead"
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("package", ["dbuffer", "fsdp"])
def test_importing_the_package_on_an_old_torch_raises_the_clear_error(package: str) -> None:
    """End to end: a fresh interpreter whose torch claims 2.10.0 cannot import either package,
    and the error it gets is ours (not a missing name deep inside)."""
    code = f"import torch; torch.__version__ = '2.10.0'; import {package}"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: dbuffer and fsdp need torch 2.11 or newer; this is torch 2.10.0. "
        "Upgrade it: pip install 'torch>=2.11'"
    ), run.stderr
