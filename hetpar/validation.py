"""Shared by the schemas (plan file, cluster file, parallelize's arguments, CLI
options): a pydantic ValidationError as one line a person can act on.

pydantic (v2) is the schema library: every field gets a type, a range and a message
from one declaration; `strict` refuses 2.0 for a count and "2" for a number instead
of converting them; `allow_inf_nan=False` refuses NaN and infinities; `extra="forbid"`
names unknown fields; and each error carries the path to the bad field, which is
what a user needs to find it. It is pure Python plus one compiled core wheel, and
fast enough for files of thousands of stages.
"""

from __future__ import annotations

from typing import Any, Iterable

from pydantic import ValidationError


def field_path(loc: Iterable[Any]) -> str:
    """('stages', 0, 'forward_s') -> 'stages[0].forward_s'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "tagged-union", "json-or-python")):
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def one_line(error: ValidationError, fix: str, names: dict[str, str] | None = None) -> str:
    """The first problem of `error` as 'FIELD: what is wrong (got VALUE); FIX', and how
    many more there are. `names` renames fields for people (e.g. CLI flags)."""
    problems = error.errors(include_url=False)
    first = problems[0]
    path = field_path(first["loc"])
    path = (names or {}).get(path, path)
    message = str(first["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    got = first.get("input")
    shown = "" if first["type"] in ("missing",) or isinstance(got, dict | list) else f" (got {_short(got)})"
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    text = f"{path}: {message}{shown}{more}; {fix}" if path != "(top level)" else f"{message}{shown}{more}; {fix}"
    return " ".join(text.split())  # one line, whatever the input held


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
