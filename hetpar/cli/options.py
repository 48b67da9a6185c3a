"""Command-line options checked before a command starts (pydantic), so a wrong
count or an unwritable output path is one line naming the flag, not a traceback
minutes into a solve."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hetpar.errors import HetparError
from hetpar.validation import one_line

Count = Annotated[int, Field(ge=1, le=1 << 40)]


class _Options(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _writable(path: str | None, suffix: str | None = None) -> str | None:
    if path is None:
        return None
    if suffix and Path(path).suffix.lower() != suffix:
        raise ValueError(f"must end in {suffix}")
    parent = Path(path).expanduser().parent
    if not parent.is_dir():
        raise ValueError(f"goes into {str(parent)!r}, which is not a directory; create it first or write elsewhere")
    return path


class SolveOptions(_Options):
    output: str
    batch_size: Count | None = None
    microbatches: Count | None = None  # None: the planner chooses
    stages: Count | None = None
    layers: Count | None = None
    replicas: Count | None = None
    zero: Annotated[int, Field(ge=0, le=3)] | None = None  # None: chosen per parameter
    zero_group: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None  # hybrid sharding: ZeRO's devices per group
    batch_argnum: Annotated[int, Field(ge=0, le=1000)] = 1
    time_limit: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None  # seconds
    finalists: Count | None = None  # None: the planner's default
    manual: list[str] = []
    profile: str | None = None

    _output = field_validator("output")(lambda cls, v: _writable(v, ".json"))

    @field_validator("profile")
    @classmethod
    def _readable(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{path!r} is not a file; make one with `hetpar profile -o {path}`")
        return path

    @field_validator("manual")
    @classmethod
    def _parses(cls, specs: list[str]) -> list[str]:
        from solver.planner import PlanningError
        from solver.planner.manual import ManualConfig

        for spec in specs:
            try:
                ManualConfig.parse(spec)
            except PlanningError as e:
                raise ValueError(str(e)) from None
        return specs


class ProfileOptions(_Options):
    output: str
    mesh_size: Count | None = None
    cpu_devices: Count | None = None
    num_layers: Count | None = None
    device_type: str | None = None
    merge: list[str] = []

    @field_validator("merge")
    @classmethod
    def _profiles(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not Path(path).is_file():
                raise ValueError(f"{path!r} is not a file; make one with `hetpar profile -o {path}` on the machine with those devices")
        return paths

    _output = field_validator("output")(lambda cls, v: _writable(v, ".json"))

    @field_validator("device_type")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        from hetpar.cluster.catalog import catalog

        if name is not None and name not in catalog():
            raise ValueError(f"is not a known device type; known: {', '.join(sorted(catalog()))}")
        return name


class SimulateOptions(_Options):
    trace: str | None = None
    plot: str | None = None

    _trace = field_validator("trace")(lambda cls, v: _writable(v, ".json"))
    _plot = field_validator("plot")(lambda cls, v: _writable(v, ".png"))


_SCHEMAS = {"solve": SolveOptions, "profile": ProfileOptions, "simulate": SimulateOptions}
_FLAGS = {"output": "-o/--output", "batch_argnum": "--batch-argnum", "batch_size": "--batch-size",
          "mesh_size": "--mesh-size", "cpu_devices": "--cpu-devices", "device_type": "--device-type",
          "zero": "--zero", "zero_group": "--zero-group"}


def check_options(args: argparse.Namespace) -> None:
    """Raises HetparError naming the first bad flag of the command's options."""
    schema = _SCHEMAS.get(args.command)
    if schema is None:
        return
    try:
        schema(**vars(args))
    except ValidationError as e:
        names = {name: _FLAGS.get(name, "--" + name.replace("_", "-")) for name in schema.model_fields}
        raise HetparError(one_line(e, "see hetpar " + args.command + " --help", names)) from None
