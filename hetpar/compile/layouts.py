"""A chosen layout as a sharding on a stage mesh, shared by the stage programs and
the per-data-shard partial sums they hold (partials.py).

Plans write layouts over logical axes: `data` (all the stage's data-parallel
devices), `model`, `model2` and, on a hybrid-sharded stage (`StagePlan.zero_group`),
`zero`: the in-node part of the data axis that ZeRO shards over. A hybrid stage's
mesh splits its data axis in two physical axes, `replica` (across nodes) x `zero`
(within a node), as MaxText's in-node and across-node axes; a layout's `data` is
both of them together, so examples still split over every data-parallel device
while ZeRO's shards repeat on every replica."""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"  # a stage mesh's examples (and ZeRO's shards, unless the stage is hybrid)
MODEL_AXIS = "model"  # its tensor-parallel splits
MODEL2_AXIS = "model2"  # a second tensor-parallel axis (3D tensor parallelism: a 3-axis mesh)
REPLICA_AXIS = "replica"  # hybrid sharding: the data axis across nodes (ZeRO's replicas)
ZERO_AXIS = "zero"  # hybrid sharding: the data axis within a node (ZeRO's shards)


def data_entry(mesh: Mesh) -> str | tuple[str, ...]:
    """The physical axes the logical `data` axis is on this mesh."""
    return (REPLICA_AXIS, ZERO_AXIS) if REPLICA_AXIS in mesh.shape else DATA_AXIS


def data_size(mesh: Mesh) -> int:
    """The data-parallel degree of the mesh: every device the examples split over."""
    if REPLICA_AXIS in mesh.shape:
        return mesh.shape[REPLICA_AXIS] * mesh.shape[ZERO_AXIS]
    return mesh.shape.get(DATA_AXIS, 1)


def physical(mesh: Mesh, axis: Any) -> Any:
    """A layout entry (an axis or None) on the mesh's own axes: `data` becomes
    `replica` x `zero` on a hybrid mesh."""
    return data_entry(mesh) if axis == DATA_AXIS else axis


def _size(mesh: Mesh, entry: Any) -> int | None:
    """How many devices a physical entry spans; None where the mesh lacks one of its axes."""
    names = entry if isinstance(entry, tuple) else (entry,)
    if any(not isinstance(a, str) or a not in mesh.shape for a in names):
        return None
    return math.prod(mesh.shape[a] for a in names)


def spec_sharding(mesh: Mesh, aval: Any, spec: tuple) -> NamedSharding:
    """A chosen sharding, minus the axes a dimension of this shape cannot divide by
    (a microbatch may be smaller than the batch the sharding was chosen for)."""
    fitted = []
    for a, dim in zip(spec, aval.shape):
        entry = physical(mesh, a) if isinstance(a, str) else None  # a layout names one axis per dimension
        size = _size(mesh, entry) if entry is not None else None
        fitted.append(entry if size is not None and dim % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*fitted))
