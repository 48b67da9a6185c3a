"""A chosen layout as a sharding on a stage mesh, shared by the stage programs and
the per-data-shard partial sums they hold (partials.py)."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"  # a stage mesh's examples (and ZeRO's shards)
MODEL_AXIS = "model"  # its tensor-parallel splits
MODEL2_AXIS = "model2"  # a second tensor-parallel axis (3D tensor parallelism: a 3-axis mesh)


def spec_sharding(mesh: Mesh, aval: Any, spec: tuple) -> NamedSharding:
    """A chosen sharding, minus the axes a dimension of this shape cannot divide by
    (a microbatch may be smaller than the batch the sharding was chosen for)."""
    fitted = [a if a is not None and a in mesh.shape and dim % mesh.shape[a] == 0 else None for a, dim in zip(spec, aval.shape)]
    return NamedSharding(mesh, PartitionSpec(*fitted))
