"""Clusters: groups of devices of one type each, and the links between them.

A `DeviceGroup` is what pipeline stages draw from: devices of a single type (one
compiled program covers one platform and one speed), laid out as nodes x devices
per node, with a link inside nodes and one between them. Groups talk over links
between groups; where two kinds of device cannot talk directly, through the hosts.
"""

from __future__ import annotations

import numbers
import os
import shutil
import tempfile

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import jax

from hetpar.cluster.catalog import Link, catalog, device_type
from hetpar.cluster.cluster_file import read_cluster_file
from hetpar.cluster.groups import DEFAULT_NETWORK, HOST_LINK, DeviceGroup, GroupLink
from hetpar.errors import ClusterError
from solver.collectives import LinkCost

__all__ = ["DEFAULT_NETWORK", "HOST_LINK", "Cluster", "DeviceGroup", "GroupLink", "jax_devices", "local_devices"]

@dataclass(frozen=True)
class Cluster:
    groups: tuple[DeviceGroup, ...]
    links: Mapping[frozenset, GroupLink] = field(default_factory=dict)  # {label_a, label_b} -> link
    name: str = ""

    def __post_init__(self) -> None:
        if not self.groups:
            raise ClusterError("the cluster has no devices; describe at least one group (Cluster.virtual({'A100': 8}) or a cluster file)")

    @staticmethod
    def virtual(counts: Mapping[str, int]) -> "Cluster":
        """Labels this process's devices (CPU virtual devices in tests) as device types,
        in the order given: {"A100": 4, "V100": 4} makes devices 0-3 A100s."""
        if not isinstance(counts, Mapping) or not counts:
            raise ClusterError(
                f"Cluster.virtual takes a non-empty mapping of device type to count, e.g. {{'A100': 4, 'V100': 4}}; "
                f"got {counts!r}"
            )
        available = local_devices()
        for name, count in counts.items():
            if not isinstance(name, str):
                raise ClusterError(f"device types are names such as 'A100' (hetpar devices lists them), got {name!r}")
            device_type(name)  # unknown types fail here, with the list of known ones
            if not isinstance(count, numbers.Integral) or isinstance(count, bool) or count <= 0:
                raise ClusterError(f"device count for {name!r} must be a positive integer, got {count!r}")
        counts = {name: int(count) for name, count in counts.items()}  # numpy integers become ints
        wanted = sum(counts.values())
        if wanted > len(available):
            raise ClusterError(
                f"the cluster asks for {wanted} devices but this process sees {len(available)}; "
                f"on CPU, set jax.config.update('jax_num_cpu_devices', {wanted}) before JAX starts"
            )
        groups, start = [], 0
        host = host_memory_bytes() / wanted  # the devices are this machine's: each its share of its memory
        disk = nvme_bytes() / wanted  # and of the disk the NVMe tier's store goes to
        for name, count in counts.items():
            ids = tuple(range(start, start + count))
            groups.append(DeviceGroup(name, ids, name=name, nodes=1, devices_per_node=count, host_memory_bytes=host * count,
                                      nvme_bytes=disk * count))
            start += count
        return Cluster(tuple(groups), name="virtual")

    @staticmethod
    def local(include_cpu: bool = True) -> "Cluster":
        """The devices this process sees, one group per device kind: on a GPU machine
        the GPUs and (unless `include_cpu` is False) the host's CPU as another kind,
        which the planner uses only where it helps."""
        by_kind: dict[str, list[int]] = {}
        for position, d in enumerate(local_devices(include_cpu)):
            by_kind.setdefault(_type_of(d), []).append(position)
        host = host_memory_bytes() / sum(len(ids) for ids in by_kind.values())
        disk = nvme_bytes() / sum(len(ids) for ids in by_kind.values())
        return Cluster(tuple(DeviceGroup(k, tuple(ids), name=k, host_memory_bytes=host * len(ids), nvme_bytes=disk * len(ids))
                             for k, ids in by_kind.items()),
                       name="local")

    @staticmethod
    def from_file(path: str) -> "Cluster":
        """A cluster described in YAML (see examples/clusters/); validated with errors
        that name the line."""
        groups, links, name = read_cluster_file(path)
        return Cluster(groups, links, name)

    def bind(self) -> "Cluster":
        """Assigns this process's devices to the groups in order (for running a plan
        made offline from a cluster file)."""
        available = local_devices()
        if self.num_devices > len(available):
            raise ClusterError(f"the cluster file describes {self.num_devices} devices but this process sees {len(available)}")
        groups, start = [], 0
        for g in self.groups:
            groups.append(replace(g, device_ids=tuple(range(start, start + g.size))))
            start += g.size
        return replace(self, groups=tuple(groups))

    def numbered(self) -> "Cluster":
        """Gives the groups device positions 0..N-1 in order, without asking JAX for
        devices: how plans are made offline for a cluster described on paper."""
        groups, start = [], 0
        for g in self.groups:
            groups.append(replace(g, device_ids=tuple(range(start, start + g.size))))
            start += g.size
        return replace(self, groups=tuple(groups))

    @property
    def num_devices(self) -> int:
        return sum(g.size for g in self.groups)

    def link_between(self, a: DeviceGroup, b: DeviceGroup) -> Link:
        """The path between two groups; its speed is its slowest hop. Without a direct
        device path (always between two vendors' devices), data goes device -> host
        -> network -> host -> device, as the runtime moves it (HostStagedPath)."""
        if a.label == b.label:
            return a.inter_link if a.nodes > 1 else a.intra_link
        group_link = self.links.get(frozenset((a.label, b.label)), GroupLink(DEFAULT_NETWORK))
        if group_link.direct and a.spec.vendor == b.spec.vendor:  # no device link joins two vendors
            return group_link.link
        hops = [HOST_LINK, group_link.link, HOST_LINK]
        return Link(f"host path over {group_link.link.name}", min(h.bandwidth for h in hops), sum(h.latency for h in hops),
                    group_link.link.overlaps)

    def link_cost_between(self, a: DeviceGroup, b: DeviceGroup) -> LinkCost:
        """`link_between` as the cost model prices it: one flow's link, which the
        flows leaving a node at once share through its NICs (the fewer of the two
        groups' nodes'), and whether sends over it overlap compute."""
        if a.label == b.label:
            return a.inter_cost() if a.nodes > 1 else a.intra_cost()
        link = self.link_between(a, b)
        shares = [s for s in (a.nic_share(link.bandwidth), b.nic_share(link.bandwidth)) if s]
        return LinkCost(link.bandwidth, link.latency, shared=min(shares) if shares else 0.0, overlaps=link.overlaps)

    def describe(self) -> str:
        return " + ".join(f"{g.size}x{g.type_name}" for g in self.groups)


def host_memory_bytes() -> float:
    """This machine's physical memory (0 where the system does not say): what the
    devices of a virtual or local cluster, all in this process, share as host memory."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def nvme_bytes() -> float:
    """Free space where the NVMe tier's store goes by default (the system's temporary
    directory; 0 where the system does not say): what the devices of a virtual or local
    cluster share as their disk."""
    try:
        return float(shutil.disk_usage(tempfile.gettempdir()).free)
    except OSError:
        return 0.0


def _type_of(device: Any) -> str:
    """The catalog kind a JAX device is: the longest catalog name within its
    `device_kind` ("NVIDIA A100-SXM4-80GB" is an A100, not an A10)."""
    kind = getattr(device, "device_kind", "") or device.platform
    if device.platform != "cpu":
        compact = kind.replace(" ", "")
        for name in sorted((n for n, d in catalog().items() if d.platform != "cpu"), key=lambda n: (-len(n), n)):
            # "V100-16GB" is a "Tesla V100-SXM2-16GB": the model and the memory size, wherever they stand
            if all(part in compact for part in name.split("-")) if name.endswith("GB") else name in compact:
                return name
    return "cpu" if device.platform == "cpu" else kind


def local_devices(include_cpu: bool = True) -> list[Any]:
    """Every device this process can place a stage on, in hetpar's order: the
    default backend's devices, then the host CPU's when that backend is an
    accelerator. A device's id in a Cluster is its position here, because JAX numbers
    each platform's devices from zero."""
    devices = list(jax.devices())
    if include_cpu and devices[0].platform != "cpu":
        try:
            devices += jax.devices("cpu")
        except RuntimeError:  # a JAX built without its CPU backend
            pass
    return devices


def jax_devices(ids: tuple[int, ...]) -> list[Any]:
    devices = local_devices()
    return [devices[i] for i in ids]
