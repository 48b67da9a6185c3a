"""The cluster file's numbers: types and ranges, one declaration each (pydantic).

cluster_file.py walks the YAML node tree (so every message can name its line) and
hands each group's and link's scalar values here, as the text YAML holds them.
Numbers must be finite (NaN and .inf bandwidths once crashed the planner) and within
sizes a real cluster has (a 10^12-device group once ran out of memory).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# More devices than any cluster in existence, few enough to plan over.
MAX_DEVICES = 1 << 20


class _Fields(BaseModel):
    # Lax on purpose: YAML gives text ("12.5e9"); pydantic reads the number from it.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LinkFields(_Fields):
    name: str | None = None
    bandwidth: Annotated[float, Field(gt=0, le=1e15)]  # bytes/s
    latency: Annotated[float, Field(ge=0, le=3600)]  # seconds


class GroupCounts(_Fields):
    nodes: Annotated[int, Field(gt=0, le=MAX_DEVICES)]
    devices_per_node: Annotated[int, Field(gt=0, le=MAX_DEVICES)]

    @model_validator(mode="after")
    def _size(self) -> "GroupCounts":
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise ValueError(
                f"the group has {self.nodes} x {self.devices_per_node} devices, more than the {MAX_DEVICES} "
                "hetpar plans over; check nodes and devices_per_node"
            )
        return self


def validated(model: type[BaseModel], values: dict[str, Any]) -> tuple[BaseModel | None, str | None, str | None]:
    """(model, None, None), or (None, the field at fault or None, a one-line message)."""
    try:
        return model(**values), None, None
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first["loc"] else None
        got = first.get("input")
        shown = f", got {str(got)[:40]}" if field and not isinstance(got, dict) else ""
        return None, field, f"{field + ' ' if field else ''}{_plain(first)}{shown}"


def _plain(error: dict) -> str:
    """pydantic's message in the words of the rest of hetpar's messages."""
    ctx, kind = error.get("ctx") or {}, error["type"]
    if kind == "greater_than":
        return "must be positive" if ctx.get("gt") == 0 else f"must be greater than {ctx.get('gt')}"
    if kind == "greater_than_equal":
        return "must not be negative" if ctx.get("ge") == 0 else f"must be at least {ctx.get('ge')}"
    if kind in ("less_than_equal", "less_than"):
        return f"must be at most {ctx.get('le', ctx.get('lt'))}"
    if kind == "finite_number":
        return "must be a finite number (not NaN or infinity)"
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return "must be an integer"
    if kind in ("float_parsing", "float_type"):
        return "must be a number"
    return str(error["msg"]).removeprefix("Value error, ")
