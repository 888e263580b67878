"""Which torch dbuffer and fsdp run on: the minimum checked once at import, and the error a
feature raises where this torch lacks the API it is built on.

Why a check of our own: on a torch older than :data:`MINIMUM` the first missing name surfaces
as an ``ImportError`` or ``AttributeError`` deep inside the package (a c10d function, an FSDP2
class), which says nothing about the fix. ``import dbuffer`` (and so ``import fsdp``) calls
:func:`check` first and raises one ``ImportError`` naming the torch found and the one needed.

Pure: the version is a string argument (torch's own ``torch.__version__`` by default), so the
tests drive every branch with fake versions. What differs between the supported versions is
handled by feature, not by version number, in :mod:`dbuffer.compat`; the version numbers here
only make the messages exact.
"""

from __future__ import annotations

import re
from typing import NoReturn, Optional

__all__ = ["MINIMUM", "TESTED", "TorchVersionError", "check", "parse", "require"]

MINIMUM = (2, 11)
# The releases CI runs the whole suite on (oldest, default, newest); README.md says the same.
TESTED = ("2.11.0", "2.13.0", "2.15.0")

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)")


class TorchVersionError(RuntimeError):
    """A feature used on a torch that lacks the API it is built on; the message names the
    feature, the torch version it needs and the one found."""


def _installed() -> str:
    import torch

    return str(torch.__version__)


def parse(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.11.0+cu130"`` -> ``(2, 11)``; local
    and pre-release suffixes ignored). Raises ``ValueError`` naming the string if it does not
    start with ``major.minor``."""
    match = _VERSION.match(version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}: expected 'major.minor[...]'")
    return int(match.group(1)), int(match.group(2))


def _name(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check(version: Optional[str] = None) -> None:
    """Raise ``ImportError`` if ``version`` (default: the installed torch's) is older than
    :data:`MINIMUM` or unreadable, naming the version found and the fix; else nothing."""
    found = _installed() if version is None else version
    try:
        older = parse(found) < MINIMUM
    except ValueError as exc:
        raise ImportError(f"dbuffer and fsdp need torch {_name(MINIMUM)} or newer; {exc}") from None
    if older:
        raise ImportError(
            f"dbuffer and fsdp need torch {_name(MINIMUM)} or newer; this is torch {found}. "
            f"Upgrade it: pip install 'torch>={_name(MINIMUM)}'"
        )


def require(feature: str, needed: tuple[int, int], hint: str = "", version: Optional[str] = None) -> NoReturn:
    """Raise :class:`TorchVersionError`: ``feature`` needs torch ``needed`` or newer and this
    torch (``version``, default the installed one) does not have it; ``hint`` (optional) says
    what to do instead. Called by :mod:`dbuffer.compat` where a feature's torch API is missing."""
    found = _installed() if version is None else version
    message = f"{feature} needs torch {_name(needed)} or newer; this is torch {found}"
    raise TorchVersionError(message + (f". {hint}" if hint else ""))
