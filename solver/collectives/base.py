"""What a collective algorithm is, as plain data: links, topologies, and an
`Algorithm` that prices the collectives it implements.

A message of `nbytes` over a link costs `latency + nbytes / bandwidth` (the
alpha-beta model). A `Topology` is nodes x devices per node with one link inside
nodes and one between them; a flat group is one node. An algorithm is one module
in this package defining an `Algorithm` and one `register` call: every pricer
(the planner's stage tables, ZeRO, the sharding ILP, hand-made plans, the
predictor) asks the registry, never an algorithm by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

# The collectives an algorithm may implement. Sizes are the full message: the
# all-reduced buffer, the gathered (or the scattered-from) whole, the broadcast value,
# one device's whole send buffer for an all-to-all.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@dataclass(frozen=True)
class SwitchReduction:
    """A fabric whose switches sum the data crossing them (NVIDIA SHARP on InfiniBand,
    NVLink SHARP in an NVSwitch): each device sends its buffer up a tree of switches
    once and receives the sum once, so the time grows with the tree's depth, not with
    the number of devices. The figures a cluster file declares for a link
    (`in_network_reduction:`); `solver.collectives.in_network` prices them."""

    levels: int  # switch levels a reduction climbs (and descends) at most
    bandwidth: float  # bytes/s the switches reduce of one flow: a port's aggregation rate
    latency: float  # s per switch level, each way
    max_message: float = 0.0  # bytes one reduction carries; a larger message goes in pieces. 0: no limit


@dataclass(frozen=True)
class LinkCost:
    """A link in the alpha-beta model. `bandwidth` is what one flow gets alone;
    `shared`, where set, is what all the flows crossing it at once share: a node's
    NICs (a node's devices reduce through them together) or its host memory, where
    devices without peer-to-peer access stage every copy. `overlaps`: whether
    point-to-point sends over it run beside compute (an asynchronous transport) or
    hold the sender until they are done (a blocking one). `reduction`: what its
    switches can sum in flight, where they can (None: they only forward)."""

    bandwidth: float  # bytes/s, one flow
    latency: float  # s
    shared: float = 0.0  # bytes/s all concurrent flows share; 0: each flow has `bandwidth`
    overlaps: bool = True
    reduction: SwitchReduction | None = None

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def per_flow(self, flows: int) -> "LinkCost":
        """The link one of `flows` flows crossing at once sees (no longer shared: the
        division is made). Flows sharing a NIC share its switch port too: the
        switches reduce each at the same fraction of their rate."""
        bandwidth = min(self.bandwidth, self.shared / max(flows, 1)) if self.shared else self.bandwidth
        reduction = self.reduction
        if reduction is not None and bandwidth < self.bandwidth:
            reduction = replace(reduction, bandwidth=reduction.bandwidth * bandwidth / self.bandwidth)
        return LinkCost(bandwidth, self.latency, 0.0, self.overlaps, reduction)

    def shared_by(self, groups: int) -> "LinkCost":
        """The link as each of `groups` collectives running side by side on the same
        nodes sees it (the tensor-parallel ranks of a node each reducing their own
        data-parallel gradients): their flows share it too."""
        if self.shared and groups > 1:
            return LinkCost(self.bandwidth, self.latency, self.shared / groups, self.overlaps, self.reduction)
        return self


@dataclass(frozen=True)
class Topology:
    nodes: int
    devices_per_node: int
    intra: LinkCost
    inter: LinkCost

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node

    def flat_link(self, crossing: int | None = None) -> LinkCost:
        """The link a flat algorithm over all devices is limited by: the slowest one
        used, as one flow sees it. Every device of a node sends at once, so a shared
        link inside the node is divided among them; `crossing`: how many of a node's
        devices send across nodes at once (None: all of them), which divide a shared
        NIC."""
        d = self.devices_per_node
        inside = self.intra.per_flow(d)
        if self.nodes == 1:
            return inside
        across = self.inter.per_flow(d if crossing is None else min(crossing, d))
        return min(inside, across, key=lambda link: link.bandwidth) if d > 1 else across

    @property
    def hierarchical(self) -> bool:
        """Several nodes of several devices: two levels of links to exploit."""
        return self.nodes > 1 and self.devices_per_node > 1


Seconds = Callable[[Topology, float], float]  # (topology, full message bytes) -> seconds; inf: cannot run here
FlatSeconds = Callable[[int, float, LinkCost], float]  # (devices, bytes, the link they share) -> seconds
Line = tuple[float, float]  # (latency term in seconds, seconds per byte)


@dataclass(frozen=True)
class Algorithm:
    """One collective algorithm: its time for each collective it implements.

    `times[collective](topology, nbytes)` is the seconds it takes (math.inf where it
    cannot run on that topology). Searches price thousands of sizes at once as the
    least of straight lines in the size (`solver.collectives.fastest_times`): a
    collective whose time is affine in the size (all but those in `curved`) gives its
    line from two sizes; an algorithm that picks among sub-algorithms per size
    (hierarchical) gives `lines(collective, topology)`, the lines its time is the
    least of; a curved collective is priced size by size."""

    name: str
    times: Mapping[str, Seconds]
    curved: tuple[str, ...] = ()  # collectives whose time is not a straight line in the size
    lines: Callable[[str, Topology], tuple[Line, ...]] | None = field(default=None, compare=False)
    # What the collective library needs set to run it (NCCL's environment variables): a
    # launch sets them in its processes where the plan uses the algorithm.
    environment: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        unknown = [c for c in self.times if c not in COLLECTIVES]
        if not self.name or unknown or not self.times:
            raise ValueError(f"an algorithm needs a name and times for some of {', '.join(COLLECTIVES)}; "
                             f"{self.name!r} has {', '.join(self.times) or 'none'}")

    @classmethod
    def flat(cls, name: str, times: Mapping[str, FlatSeconds], curved: tuple[str, ...] = (),
             crossing: int | None = None) -> "Algorithm":
        """An algorithm that treats the group as one flat set of devices, each collective
        a function of (devices, bytes, link): on several nodes it runs over the slowest
        link, the one between nodes. `crossing`: how many of a node's devices send
        across nodes at once (a ring: one; None: all, as recursive halving's first
        steps do), which share the node's NICs."""
        return cls(name, {kind: _over_flat_link(fn, crossing) for kind, fn in times.items()}, curved)

    def time(self, collective: str, topology: Topology, nbytes: float) -> float:
        return self.times[collective](topology, nbytes)


def _over_flat_link(fn: FlatSeconds, crossing: int | None) -> Seconds:
    return lambda topo, nbytes: fn(topo.size, nbytes, topo.flat_link(crossing))


def log2_steps(n: int) -> int:
    """Rounds of a recursive (doubling, halving or tree) algorithm over n devices."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def fold(n: int, nbytes: float, link: LinkCost) -> float:
    """Extra cost for a non-power-of-two group in recursive algorithms: fold to a
    power of two and back, as MPI implementations do."""
    return 0.0 if n & (n - 1) == 0 else 2 * link.time(nbytes)
