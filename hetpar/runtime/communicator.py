"""Moving values between stage meshes, one interface for both runtimes.

A device path when both meshes live in this process: `device_put` copies shard by
shard between devices (and not at all when the value is already laid out as the
destination wants). A host path between processes or kinds of device that cannot
talk directly: the value leaves as a host array (through Ray's object store in the
multi-process runtime) and lands on the destination mesh with its sharding.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from hetpar.runtime.remote import is_remote, placeholder


def already_there(x: Any, sharding: Any) -> bool:
    return getattr(x, "sharding", None) is not None and x.sharding.is_equivalent_to(sharding, x.ndim)


def _platform(devices: Any) -> str:
    return next(iter(devices)).platform


class DevicePath:
    """Within one process: device to device, or through the host between kinds of
    device that share no link (a GPU stage and a CPU stage)."""

    def to_mesh(self, x: Any, sharding: Any) -> Any:
        if already_there(x, sharding):
            return x
        if isinstance(x, jax.Array) and _platform(x.devices()) != _platform(sharding.device_set):
            return jax.device_put(np.asarray(jax.device_get(x)), sharding)
        if isinstance(x, jax.Array) and not (x.is_fully_addressable and sharding.is_fully_addressable):
            x = _laid_out_at_source(x, sharding)
        return jax.device_put(x, sharding)


def _laid_out_at_source(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` laid out as `sharding` wants, still on its own devices. Between the device
    sets of different processes JAX moves an array only shard for shard (both sides
    cut alike: the same layout over meshes of one shape), so a value whose layout
    changes on the way (a gradient laid out over `data` on one stage that the other
    keeps replicated) is first re-laid where it is: a reshard among its own devices,
    run by the processes that hold it (the others make a placeholder of the result).
    Meshes of different sizes are refused before a step runs
    (`hetpar.runtime.distributed.check_cross_process`)."""
    source = x.sharding
    if not (isinstance(source, NamedSharding) and isinstance(sharding, NamedSharding)):
        return x
    if source.device_set == sharding.device_set or source.mesh.devices.size != sharding.mesh.devices.size:
        return x
    mesh = Mesh(source.mesh.devices.reshape(sharding.mesh.devices.shape), sharding.mesh.axis_names)
    staged = NamedSharding(mesh, sharding.spec)
    if source.is_equivalent_to(staged, x.ndim):
        return x
    if is_remote(x):
        return placeholder(jax.ShapeDtypeStruct(x.shape, x.dtype), staged)
    return jax.device_put(x, staged)


class HostPath:
    """Between processes: out through the host, in onto the destination mesh."""

    def export(self, x: Any) -> np.ndarray:
        return np.asarray(jax.device_get(x))

    def to_mesh(self, x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.Array):
            return DevicePath().to_mesh(x, sharding)
        return jax.device_put(np.asarray(x), sharding)
