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
        return jax.device_put(x, sharding)


class HostPath:
    """Between processes: out through the host, in onto the destination mesh."""

    def export(self, x: Any) -> np.ndarray:
        return np.asarray(jax.device_get(x))

    def to_mesh(self, x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.Array):
            return DevicePath().to_mesh(x, sharding)
        return jax.device_put(np.asarray(x), sharding)
