"""`hetpar.parallelize`'s arguments, checked when parallelize is called: a wrong
count or a wrong kind of cluster is named there, not deep inside JAX on the first
step.

Counts are whole numbers in range; numpy integers are accepted (an `np.int64` from
a config is a count), while 2.0, "2", True and None where a count is needed are
refused rather than converted. `cluster` may be a Cluster or the path of a cluster
file (read here).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from hetpar.errors import HetparError, PlanError
from hetpar.validation import one_line


def _whole(value: Any) -> Any:
    """numpy (and other Integral) integers as int; anything else as it is, for the
    strict check to refuse."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


Count = Annotated[int, BeforeValidator(_whole), Field(ge=1, le=1 << 40)]
Index = Annotated[int, BeforeValidator(_whole), Field(ge=0, le=1 << 20)]
MeshShape = tuple[Count, Count] | tuple[Count, Count, Count]  # (data, model[, model2])


class _Counts(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    num_microbatches: Count = 1
    num_stages: Count | None = None
    num_layers: Count | None = None
    num_replicas: Count | None = None
    batch_argnum: Index = 1
    schedule: str | None = None  # a registered name: checked with the other options (hetpar/options.py)
    runtime: Literal["local", "distributed", "ray"] | None = None
    mesh_shape: MeshShape | tuple[MeshShape, ...] | None = None


@dataclass(frozen=True)
class Arguments:
    """parallelize's arguments after checking: plain ints and tuples, a Cluster."""

    cluster: Any
    num_microbatches: int
    num_stages: int | None
    num_layers: int | None
    num_replicas: int | None
    batch_argnum: int
    schedule: str | None
    runtime: str | None
    mesh_shape: tuple | None


def check_step(fn: Any) -> Callable:
    """The train step must be callable (also in the decorator form)."""
    if not callable(fn):
        raise HetparError(f"parallelize needs the train step as a function, got {type(fn).__name__} {fn!r:.60}")
    return fn


def check_arguments(fn: Callable | None, cluster: Any, plan: Any, **counts: Any) -> Arguments:
    """Refuses bad arguments with a HetparError naming the argument and the fix;
    returns them normalized."""
    from hetpar.cluster.cluster import Cluster
    from hetpar.plan import Plan

    if fn is not None:
        check_step(fn)
    if isinstance(cluster, str | Path):
        cluster = Cluster.from_file(cluster)
    elif cluster is not None and not isinstance(cluster, Cluster):
        raise HetparError(
            f"cluster must be a hetpar.Cluster or a cluster file path, got {type(cluster).__name__}; "
            f"use hetpar.Cluster.virtual({{'A100': 8}}), hetpar.Cluster.from_file('cluster.yaml') or hetpar.Cluster.local()"
        )
    if plan is not None and not isinstance(plan, Plan | str | Path):
        raise HetparError(f"plan must be a hetpar.Plan or a plan file path (from hetpar solve), got {type(plan).__name__}")
    mesh = counts.get("mesh_shape")
    if isinstance(mesh, list):  # lists are as good as tuples here
        counts["mesh_shape"] = tuple(tuple(m) if isinstance(m, list) else m for m in mesh)
    try:
        c = _Counts(**counts)
    except ValidationError as e:
        raise PlanError(f"parallelize argument {one_line(e, 'pass a value in range of the right type')}") from None
    return Arguments(cluster, c.num_microbatches, c.num_stages, c.num_layers, c.num_replicas, c.batch_argnum,
                     c.schedule, c.runtime, c.mesh_shape)
