"""In-network all-reduce: the switches sum the data as it crosses them (NVIDIA SHARP
on InfiniBand, NVLink SHARP in an NVSwitch). Each device sends its buffer up the
switch tree once and receives the sum once: M bytes each way over its link, where a
ring sends and receives 2(n-1)/n M, about twice as much. The latency is one trip up
and down the tree, whatever the group's size.

Priced from the link's `SwitchReduction` (a cluster file's `in_network_reduction:`):
  one trip    t = a + 2 L s             (a: the link's latency; L switch levels of s each)
  all-reduce  t + M / B + (M / C) t     (B: the slower of the link and the switches'
                                         rate; C: the largest message one reduction carries)
A message larger than C goes in pieces, each its own trip. Their count is taken as
M / C, not rounded up, so the time stays a straight line in the size (what the
planner's vectorised prices need); that overstates a time by at most one trip.

Where the switches join nodes of several devices (a stage's data-parallel devices
across nodes), each node's devices first reduce-scatter over their own link, each
sends its 1/d of the buffer through the NICs to the switches, and they all-gather
the sum inside the node, as NCCL's CollNet does. The node-local steps are run by the
fastest registered algorithm for them and add up with the switches' step, as the
hierarchical algorithm's levels do, so the two compare like for like. This module
owns every use of the switches: the hierarchical algorithm's across-node level is
the one the hosts drive.
"""

from __future__ import annotations

import itertools
import math

from solver.collectives.base import Algorithm, Line, LinkCost, Topology
from solver.collectives.registry import affine_costs, best

# NCCL reaches InfiniBand switches through its CollNet transport (the NCCL-SHARP
# plugin), off unless enabled, and large messages need SHARP's streaming aggregation,
# off unless enabled too. (NVLink SHARP, NCCL's NVLS, is on by default where present.)
ENVIRONMENT = (("NCCL_COLLNET_ENABLE", "1"), ("SHARP_COLL_ENABLE_SAT", "1"))


def _line(link: LinkCost) -> Line:
    """(seconds at zero bytes, seconds per byte) of one all-reduce through the switches
    of `link`, one flow per device (or node)."""
    r = link.reduction
    assert r is not None
    trip = link.latency + 2 * r.levels * r.latency
    per_byte = 1 / min(link.bandwidth, r.bandwidth) + (trip / r.max_message if r.max_message else 0.0)
    return trip, per_byte


def switch_all_reduce(nbytes: float, link: LinkCost) -> float:
    """Seconds for `nbytes` summed by the switches of `link` (which has a `reduction`)."""
    latency, per_byte = _line(link)
    return latency + per_byte * nbytes


def _fabric(topo: Topology) -> tuple[int, LinkCost] | None:
    """(devices per flow into the switches, the link one flow sees), or None where no
    link of `topo` reduces. A group within one node reduces in the node's switch (one
    flow per device); across nodes, in the network's (a node's devices reduce-scatter
    first, then each is one flow through the NICs they share)."""
    d = topo.devices_per_node
    if topo.nodes == 1:
        link = topo.intra.per_flow(d)
        return (1, link) if link.reduction is not None else None
    if topo.inter.reduction is None:
        return None
    return d, topo.inter.per_flow(d)


def _inner(topo: Topology) -> Topology:
    return Topology(1, topo.devices_per_node, topo.intra, topo.intra)


def _all_reduce(topo: Topology, nbytes: float) -> float:
    found = _fabric(topo)
    if found is None:
        return math.inf
    if topo.size <= 1:
        return 0.0
    d, link = found
    if d == 1:
        return switch_all_reduce(nbytes, link)
    inner = _inner(topo)
    return (best("reduce_scatter", inner, nbytes)[1] + switch_all_reduce(nbytes / d, link)
            + best("all_gather", inner, nbytes)[1])


def _lines(kind: str, topo: Topology) -> tuple[Line, ...]:
    """The switches' line, with one line per pick of the node-local steps' algorithms
    where there are such steps: the least of them is the time above."""
    found = _fabric(topo)
    if found is None or topo.size <= 1:
        return ()
    d, link = found
    latency, per_byte = _line(link)
    if d == 1:
        return ((latency, per_byte),)
    inner = _inner(topo)
    return tuple((a1 + latency + a3, s1 + per_byte / d + s3) for (a1, s1), (a3, s3) in itertools.product(
        affine_costs("reduce_scatter", inner), affine_costs("all_gather", inner)))


ALGORITHM = Algorithm("in_network", {"all_reduce": _all_reduce}, lines=_lines, environment=ENVIRONMENT)
