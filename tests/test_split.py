"""A whole-batch value cut into microbatches for a stage mesh (`DevicePath.split_to`):
every way the source and the stage's devices can relate, each piece the slice jax
would cut, laid out as the stage's program wants it, on the device path (no trip
through the host) and on the host path small values take on CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from hetpar.compile.programs import stage_mesh
from hetpar.runtime import communicator
from hetpar.runtime.communicator import DevicePath


@pytest.fixture(params=["device path", "host path"])
def path(request, monkeypatch):
    """Both ways a value can be cut: the device path (every value, with the host path's
    size limit at 0) and the host path (every CPU value below the limit)."""
    if request.param == "device path":
        monkeypatch.setattr(communicator, "HOST_SPLIT_MAX_BYTES", 0)
    return request.param


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
def test_split_to_cuts_where_the_stage_wants_it(source, stage, axis, path):
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


def test_split_to_keys(path):
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


def test_small_values_take_the_host_path_and_large_ones_the_device_path(monkeypatch):
    taken = []
    monkeypatch.setattr(communicator, "_split_through_host", lambda *a: taken.append("host"))
    monkeypatch.setattr(communicator, "_splitter", lambda *a: (lambda x: taken.append("device")))
    target = NamedSharding(stage_mesh((4, 5, 6, 7)), PartitionSpec("data"))
    small = _on(tuple(range(8)), PartitionSpec("data"), np.zeros((8, 4), np.float32))
    large = _on(tuple(range(8)), PartitionSpec("data"), np.zeros((8, communicator.HOST_SPLIT_MAX_BYTES), np.float32))
    for x in (small, large):
        DevicePath().split_to(x, ((0, 4), (4, 4)), 0, target)
    assert taken == ["host", "device"]
