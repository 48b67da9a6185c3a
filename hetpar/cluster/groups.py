"""The parts a cluster is made of: groups of devices of one type, and the links
between groups. Plain data, shared by the Cluster and the cluster-file reader."""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cluster.catalog import DeviceType, Link, device_type

# Device <-> host copies (PCIe 4.0 x16) and a default network between groups.
HOST_LINK = Link("PCIe 4.0 x16 to host", 25e9, 10e-6)
DEFAULT_NETWORK = Link("100 Gb/s Ethernet", 12.5e9, 10e-6)


@dataclass(frozen=True)
class DeviceGroup:
    type_name: str
    device_ids: tuple[int, ...] = ()  # jax device ids; empty for a cluster described only on paper
    name: str = ""
    nodes: int = 1
    devices_per_node: int = 0  # 0: all devices in one node
    intra_node: Link | None = None  # default: the device type's typical link
    inter_node: Link | None = None  # default: DEFAULT_NETWORK

    @property
    def spec(self) -> DeviceType:
        return device_type(self.type_name)

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node if self.devices_per_node else len(self.device_ids)

    @property
    def label(self) -> str:
        return self.name or self.type_name

    @property
    def intra_link(self) -> Link:
        return self.intra_node or self.spec.intra_node_link

    @property
    def inter_link(self) -> Link:
        return self.inter_node or DEFAULT_NETWORK


@dataclass(frozen=True)
class GroupLink:
    link: Link
    direct: bool = False  # device to device (e.g. RDMA); otherwise through both hosts
