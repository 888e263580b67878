"""Rows of the gpu_check table and their verdicts: pure data and formatting, no torch.

A :class:`Row` is one thing checked (``matrix/fp32``, ``multirank/w4 hsdp 2x2``, ...). It holds
:class:`Check` s, each a measured value against a limit; the row PASSes only when it holds at least
one check, every check holds, and nothing raised. A value that is not a finite number (NaN from a
diverged run, None from a comparison that never ran) fails its check, so a broken comparison can
never pass by accident. Rows travel between the section processes and the driver as JSON
(:meth:`Row.to_dict` / :meth:`Row.from_dict`), and :func:`table` prints them as one table.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

PASS, FAIL = "PASS", "FAIL"
ERROR_CHARS = 400  # of an error in the table (the JSON keeps it whole, and the traceback)
_OPS = {
    "<=": lambda v, lim: v <= lim,
    "<": lambda v, lim: v < lim,
    ">=": lambda v, lim: v >= lim,
    ">": lambda v, lim: v > lim,
    "==": lambda v, lim: v == lim,
}
# Checks with these names fill the table's own columns; every other check goes to "other".
PLAIN, FSDP2 = "vs plain", "vs FSDP2"


@dataclass
class Check:
    """``value op limit`` must hold (``op`` one of ``<= < >= > ==``); ``metric`` says what the
    value is (``max|dW|``: the largest elementwise difference of the trained weights)."""

    name: str
    value: Any
    limit: Any
    op: str = "<="
    metric: str = ""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, got {self.op!r}")

    @property
    def ok(self) -> bool:
        v, lim = self.value, self.limit
        if isinstance(v, bool) or isinstance(lim, bool):  # a yes/no fact: only == makes sense
            return self.op == "==" and v is lim
        if not isinstance(v, (int, float)) or not isinstance(lim, (int, float)):
            return False
        if not (math.isfinite(v) and math.isfinite(lim)):
            return False
        return bool(_OPS[self.op](v, lim))

    def text(self, with_name: bool = True) -> str:
        mark = "" if self.ok else " FAILED"
        if isinstance(self.value, bool) and self.op == "==" and isinstance(self.limit, bool):
            said = ("yes" if self.value else "no") + ("" if self.limit else " (expected no)")
            return f"{self.name}: {said}{mark}" if with_name else f"{said}{mark}"
        metric = f"{self.metric} " if self.metric and with_name else ""
        name = f"{self.name}: " if with_name else ""
        return f"{name}{metric}{fmt(self.value)} {self.op} {fmt(self.limit)}{mark}"


@dataclass
class Row:
    """One row of the table: its checks, the losses of the methods it trained (first, last),
    other figures worth printing (times, peaks, streams), and the error if it raised."""

    section: str
    name: str
    checks: list[Check] = field(default_factory=list)
    losses: dict[str, list[float]] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    error: Optional[str] = None
    traceback: Optional[str] = None
    seconds: float = 0.0

    @property
    def full_name(self) -> str:
        return f"{self.section}/{self.name}"

    def check(self, name: str, value: Any, limit: Any, op: str = "<=", metric: str = "") -> Check:
        c = Check(name, value, limit, op, metric)
        self.checks.append(c)
        return c

    def fail_with(self, exc: BaseException) -> None:
        """Record ``exc``: ``Type: message`` on one line in ``error`` (what the table shows), the
        traceback aside (the JSON's)."""
        self.error = " ".join(f"{type(exc).__name__}: {exc}".split())
        earlier = f"{self.traceback}\n" if self.traceback else ""  # e.g. the control's failure, kept
        self.traceback = earlier + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        details = getattr(exc, "details", "")  # e.g. every failed rank's own traceback
        if details:
            self.traceback += f"\n{details}"

    @property
    def verdict(self) -> str:
        return PASS if not self.problems() else FAIL

    def problems(self) -> list[str]:
        """Why the row fails (empty when it passes)."""
        out = [f"raised {self.error}"] if self.error is not None else []
        if not self.checks and self.error is None:
            out.append("no check ran")
        out += [c.text() for c in self.checks if not c.ok]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict
        d["checks"] = [{**asdict(c), "ok": c.ok} for c in self.checks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Row":
        d = {k: v for k, v in d.items() if k != "verdict"}
        d["checks"] = [Check(**{k: v for k, v in c.items() if k != "ok"}) for c in d.get("checks", [])]
        return cls(**d)


def fmt(x: Any) -> str:
    """A figure as the table prints it: floats in 3 significant digits, small ones as 1.2e-07."""
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, float):
        if x == 0.0:
            return "0"
        if not math.isfinite(x):
            return str(x)
        return f"{x:.2e}" if abs(x) < 1e-2 or abs(x) >= 1e5 else f"{x:.4g}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in x.items()) + "}"
    return str(x)


def _losses(row: Row) -> str:
    return " | ".join(f"{name} {first:.4f}>{last:.4f}" for name, (first, last) in row.losses.items())


def _cell(row: Row, name: str) -> str:
    """The max|dW| column against ``name``'s reference: the check, or the figure and the check of
    another metric (rel dW) that holds the row instead."""
    parts = [fmt(row.figures[f"max|dW| {name}"])] if f"max|dW| {name}" in row.figures else []
    for c in row.checks:
        if c.name == name:
            parts.append(c.text(with_name=False) if c.metric == "max|dW|" else f"{c.metric} {c.text(with_name=False)}")
    return "; ".join(parts) or "-"


def _other(row: Row) -> str:
    error = row.error if row.error is None or len(row.error) <= ERROR_CHARS else row.error[:ERROR_CHARS] + "..."
    parts = [f"ERROR {error}"] if error is not None else []
    if not row.checks and row.error is None:
        parts.append("FAILED: no check ran")
    parts += [c.text() for c in row.checks if c.name not in (PLAIN, FSDP2)]
    parts += [f"{k} {fmt(v)}" for k, v in row.figures.items() if k not in (f"max|dW| {PLAIN}", f"max|dW| {FSDP2}")]
    if row.note:
        parts.append(row.note)
    return "; ".join(parts)


COLUMNS = ("row", "verdict", "max|dW| vs plain", "max|dW| vs FSDP2", "loss first>last", "s", "other checks and figures")


def table(rows: list[Row]) -> list[str]:
    """The rows as aligned text lines: a header, a rule, one line per row (the last column,
    free text, is not padded)."""
    cells = [[r.full_name, r.verdict, _cell(r, PLAIN), _cell(r, FSDP2), _losses(r), f"{r.seconds:.1f}", _other(r)]
             for r in rows]
    widths = [max([len(COLUMNS[i])] + [len(c[i]) for c in cells]) for i in range(len(COLUMNS) - 1)]

    def line(values) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)) + "  " + values[-1]

    return [line(COLUMNS), line(["-" * w for w in widths] + ["-" * len(COLUMNS[-1])])] + [line(c) for c in cells]


def summary(rows: list[Row]) -> str:
    failed = [r.full_name for r in rows if r.verdict == FAIL]
    if not rows:
        return "no rows ran (nothing matched --only?)"
    if not failed:
        return f"all {len(rows)} rows PASS"
    return f"{len(failed)} of {len(rows)} rows FAIL: {', '.join(failed)}"
