"""tools/'s docstrings by the rules of ``tests/test_docstring_refs.py``: every ``:func:``,
``:class:``, ``:meth:``... reference names something that exists (here, as only the tools' tests
import tools/)."""

from __future__ import annotations

from tests.test_docstring_refs import unresolved_in


def test_every_tool_docstring_reference_names_something_that_exists() -> None:
    unresolved = unresolved_in("tools")
    assert not unresolved, "docstring references to nothing (renamed or removed?):\n" + "\n".join(unresolved)
