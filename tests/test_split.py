"""A whole-batch value cut into microbatches for a stage mesh (`DevicePath.split_to`):
every way the source and the stage's devices can relate, each piece the slice jax
would cut, laid out as the stage's program wants it, without a trip through the host."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from hetpar.compile.programs import stage_mesh
from hetpar.runtime.communicator import DevicePath


def _on(ids: tuple[int, ...], spec: PartitionSpec, x: np.ndarray) -> jax.Array:
    return jax.device_put(x, NamedSharding(stage_mesh(ids), spec))


@pytest.mark.parametrize("source, stage", [
    ((0, 1, 2, 3), (0, 1, 2, 3)),  # the stage's own devices: one program
    ((4, 5, 6, 7), (0, 1, 2, 3)),  # as many other devices: cut there, one copy per shard
    (tuple(range(8)), (4, 5, 6, 7)),  # the benchmark's case: 8 devices for a stage of 4
    ((0, 1, 2), (4, 5, 6, 7)),  # counts that do not divide
    ((2,), (4, 5)),  # one device
])
@pytest.mark.parametrize("axis", [0, 1])
def test_split_to_cuts_where_the_stage_wants_it(source, stage, axis):
    x = np.arange(24 * 6, dtype=np.float32).reshape(24, 6) if axis == 0 else np.arange(6 * 24, dtype=np.float32).reshape(6, 24)
    spec = PartitionSpec("data") if axis == 0 else PartitionSpec(None, "data")
    src = _on(source, spec if 24 % len(source) == 0 else PartitionSpec(), x)
    target = NamedSharding(stage_mesh(stage), spec)
    pieces = ((0, 8), (8, 8), (16, 8))
    out = DevicePath().split_to(src, pieces, axis, target)
    assert out is not None and len(out) == 3
    for (start, size), piece in zip(pieces, out):
        np.testing.assert_array_equal(np.asarray(piece), np.take(x, range(start, start + size), axis=axis))
        assert piece.sharding.is_equivalent_to(target, 2)


def test_split_to_keys():
    keys = jax.random.split(jax.random.key(0), 8)
    src = _on(tuple(range(8)), PartitionSpec("data"), keys)
    target = NamedSharding(stage_mesh((0, 1, 2, 3)), PartitionSpec("data"))
    out = DevicePath().split_to(src, ((0, 4), (4, 4)), 0, target)
    want = jax.random.key_data(keys)
    for i, piece in enumerate(out):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(piece)), want[4 * i: 4 * i + 4])


def test_split_to_leaves_host_values_to_the_caller():
    target = NamedSharding(stage_mesh((0, 1)), PartitionSpec("data"))
    assert DevicePath().split_to(np.zeros((4, 2)), ((0, 2), (2, 2)), 0, target) is None
