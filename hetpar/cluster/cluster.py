"""Clusters: groups of devices of one type each.

A `DeviceGroup` is what a pipeline stage can run on: devices of a single type, so
that one compiled program (one platform, one speed) covers the whole stage mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax

from hetpar.cluster.catalog import DeviceType, device_type
from hetpar.errors import ClusterError


@dataclass(frozen=True)
class DeviceGroup:
    type_name: str
    device_ids: tuple[int, ...]  # jax device ids

    @property
    def spec(self) -> DeviceType:
        return device_type(self.type_name)

    @property
    def size(self) -> int:
        return len(self.device_ids)


@dataclass(frozen=True)
class Cluster:
    groups: tuple[DeviceGroup, ...]

    @staticmethod
    def virtual(counts: Mapping[str, int]) -> "Cluster":
        """Labels this process's devices (CPU virtual devices in tests) as device types,
        in the order given: {"A100": 4, "V100": 4} makes devices 0-3 A100s."""
        available = jax.devices()
        for name, count in counts.items():
            device_type(name)  # unknown types fail here, with the list of known ones
            if not isinstance(count, int) or count <= 0:
                raise ClusterError(f"device count for {name!r} must be a positive integer, got {count!r}")
        wanted = sum(counts.values())
        if wanted > len(available):
            raise ClusterError(
                f"the cluster asks for {wanted} devices but this process sees {len(available)}; "
                f"on CPU, set jax.config.update('jax_num_cpu_devices', {wanted}) before JAX starts"
            )
        groups, start = [], 0
        for name, count in counts.items():
            groups.append(DeviceGroup(name, tuple(d.id for d in available[start : start + count])))
            start += count
        return Cluster(tuple(groups))

    @staticmethod
    def local() -> "Cluster":
        """The devices this process sees, one group per platform/kind."""
        by_kind: dict[str, list[int]] = {}
        for d in jax.devices():
            by_kind.setdefault(_type_of(d), []).append(d.id)
        return Cluster(tuple(DeviceGroup(k, tuple(ids)) for k, ids in by_kind.items()))

    @property
    def num_devices(self) -> int:
        return sum(g.size for g in self.groups)

    def describe(self) -> str:
        return " + ".join(f"{g.size}x{g.type_name}" for g in self.groups)


def _type_of(device: Any) -> str:
    kind = getattr(device, "device_kind", "") or device.platform
    for name in ("H100", "H200", "A100", "V100"):
        if name in kind:
            return name
    return "cpu" if device.platform == "cpu" else kind


def jax_devices(ids: tuple[int, ...]) -> list[Any]:
    by_id = {d.id: d for d in jax.devices()}
    return [by_id[i] for i in ids]
