"""The parts a cluster is made of: groups of devices of one type, and the links
between groups. Plain data, shared by the Cluster and the cluster-file reader.

A group's figures are its device type's catalog entry with whatever the cluster
file overrides for that group (`DeviceOverrides`: memory, FLOP/s, bandwidths, the
JAX client's memory share), and how its nodes communicate as clusters have it: the
devices of a node share its NICs (`nics_per_node`; `inter_node`'s bandwidth is one
NIC's), and devices without peer-to-peer access stage every copy through the host's
memory, which the node's devices share (`peer_to_peer`, `host_bandwidth`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetpar.cluster.catalog import DeviceType, Link, device_type
from hetpar.cluster.memory import ClientMemory, client_memory
from solver.collectives import LinkCost

# Device <-> host copies (PCIe 4.0 x16) and a default network between groups.
HOST_LINK = Link("PCIe 4.0 x16 to host", 25e9, 10e-6)
# A node's local NVMe disk where the cluster file does not say (`nvme_gib_s`): 3 GiB/s, what a
# PCIe 4.0 x4 NVMe drive sustains reading or writing large files (its peak is about 7 GB/s
# reading, 5 GB/s writing; sustained writes past its cache run slower).
NVME_BANDWIDTH = 3 * 2**30
DEFAULT_NETWORK = Link("100 Gb/s Ethernet", 12.5e9, 10e-6)


@dataclass(frozen=True)
class DeviceOverrides:
    """A cluster file's figures for one group, in place of its device type's catalog
    entry (None: the catalog's)."""

    memory_bytes: int | None = None
    peak_flops: tuple[tuple[str, float], ...] = ()  # catalog dtype key -> FLOP/s, merged over the catalog's
    memory_bandwidth: float | None = None
    efficiency: float | None = None
    process_reserve_bytes: float | None = None
    memory_fraction: float | None = None  # the JAX client's share; None: from the environment

    def applied(self, spec: DeviceType) -> DeviceType:
        changes: dict = {}
        if self.memory_bytes is not None:
            changes["memory_bytes"] = self.memory_bytes
        if self.peak_flops:
            changes["peak_flops"] = {**spec.peak_flops, **dict(self.peak_flops)}
        if self.memory_bandwidth is not None:
            changes["memory_bandwidth"] = self.memory_bandwidth
        if self.efficiency is not None:
            changes["efficiency"] = self.efficiency
        if self.process_reserve_bytes is not None:
            changes["process_reserve_bytes"] = self.process_reserve_bytes
        return replace(spec, **changes) if changes else spec


@dataclass(frozen=True)
class DeviceGroup:
    type_name: str
    device_ids: tuple[int, ...] = ()  # jax device ids; empty for a cluster described only on paper
    name: str = ""
    nodes: int = 1
    devices_per_node: int = 0  # 0: all devices in one node
    intra_node: Link | None = None  # default: the device type's typical link
    inter_node: Link | None = None  # default: DEFAULT_NETWORK; its bandwidth is one NIC's
    overrides: DeviceOverrides = DeviceOverrides()
    nics_per_node: int = 0  # NICs a node's devices share to reach other nodes; 0: one per device
    peer_to_peer: bool = True  # False: device-to-device copies in a node go through host memory
    host_bandwidth: float = HOST_LINK.bandwidth  # bytes/s the host moves for copies staged through it, all devices together
    host_memory_bytes: float = 0.0  # a node's host memory for offloaded state; 0: unknown (nothing is offloaded)
    nvme_bytes: float = 0.0  # a node's local disk for NVMe-tier state; 0: none (nothing goes to disk)
    nvme_bandwidth: float = NVME_BANDWIDTH  # bytes/s the node's disk reads or writes, its devices together

    @property
    def spec(self) -> DeviceType:
        return self.overrides.applied(device_type(self.type_name))

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node if self.devices_per_node else len(self.device_ids)

    @property
    def label(self) -> str:
        return self.name or self.type_name

    @property
    def per_node(self) -> int:
        return self.devices_per_node or self.size

    @property
    def intra_link(self) -> Link:
        return self.intra_node or self.spec.intra_node_link

    @property
    def inter_link(self) -> Link:
        return self.inter_node or DEFAULT_NETWORK

    def client_memory(self) -> ClientMemory:
        """The JAX client's share of each device's memory: the cluster file's
        `memory_fraction`, else the environment's (`hetpar.cluster.memory`)."""
        found = client_memory(self.spec.platform)
        if self.overrides.memory_fraction is None:
            return found
        return ClientMemory(self.overrides.memory_fraction, found.preallocate, f"memory_fraction: {self.overrides.memory_fraction:g} "
                            f"in the cluster file's group {self.label!r}")

    def intra_cost(self) -> LinkCost:
        """A node's device-to-device link as the cost model sees it. Without
        peer-to-peer every copy is staged through host memory (device to host, then
        host to device: it crosses the host twice), whose rate the node's concurrent
        copies share: 8 devices of a ring all-reduce get an eighth of half of it each."""
        link = self.intra_link
        if self.peer_to_peer:
            return LinkCost(link.bandwidth, link.latency, overlaps=link.overlaps, reduction=link.reduction)
        staged = self.host_bandwidth / 2  # no switch between the devices sums what the host stages
        return LinkCost(min(link.bandwidth, staged), link.latency + 2 * HOST_LINK.latency, shared=staged, overlaps=link.overlaps)

    def host_cost(self) -> LinkCost:
        """One device's link to its host's memory as the cost model sees it: its own
        PCIe link (the catalog's `host_link`), all the node's devices' copies sharing
        what the host moves (`host_bandwidth`), as host-staged copies do."""
        link = self.spec.host_link or HOST_LINK
        return LinkCost(link.bandwidth, link.latency, shared=self.host_bandwidth)

    def host_memory_per_device(self) -> float:
        """A device's share of its node's host memory (0: unknown)."""
        return self.host_memory_bytes / self.per_node

    def inter_cost(self) -> LinkCost:
        """The link between this group's nodes: one NIC's bandwidth per flow, and all
        the node's NICs together shared by the flows that leave the node at once."""
        link = self.inter_link
        return LinkCost(link.bandwidth, link.latency, shared=self.nic_share(link.bandwidth), overlaps=link.overlaps,
                        reduction=link.reduction)

    def nic_share(self, bandwidth: float) -> float:
        """What a node's flows share over links of `bandwidth` per NIC (0: a NIC per
        device, nothing shared)."""
        nics = self.nics_per_node
        return 0.0 if not nics or nics >= self.per_node else nics * bandwidth


@dataclass(frozen=True)
class GroupLink:
    link: Link
    direct: bool = False  # device to device (e.g. RDMA); otherwise through both hosts
