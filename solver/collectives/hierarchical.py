"""Hierarchical collectives: inside each node first (fast links), then across nodes
on what is left, each level run by the fastest registered flat algorithm for it.

  all-reduce      reduce-scatter in node (M), all-reduce across nodes (M/d), all-gather in node (M)
  all-gather /
  reduce-scatter  inside nodes on each node's share (M/nodes), then across nodes (M);
                  or across nodes on each device's share (M/d), then inside nodes (M)
  broadcast       across nodes, then inside nodes
  all-to-all      inside nodes, then node-level blocks across nodes, d streams sharing a NIC
(d devices per node). Only a topology of several nodes of several devices has levels.
Where the devices of a node run the across-node level side by side, their d flows
share the node's NICs (`LinkCost.per_flow`): with one NIC, reducing a node's
gradient takes as long as one device sending all of it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from solver.collectives.base import Algorithm, Line, LinkCost, Topology
from solver.collectives.registry import affine_costs, best


def _flat(n: int, link: LinkCost) -> Topology:
    return Topology(1, n, link, link)


def _across(topo: Topology, flows: int) -> Topology:
    """The across-node level, run by `flows` devices of each node at once. The hosts
    drive it: summing in the switches is the in-network algorithm's (`in_network.py`),
    which runs the node-local levels itself."""
    return _flat(topo.nodes, replace(topo.inter.per_flow(flows), reduction=None))


def _all_reduce(topo: Topology, nbytes: float) -> float:
    if not topo.hierarchical:
        return math.inf
    d, inner = topo.devices_per_node, _flat(topo.devices_per_node, topo.intra)
    return (best("reduce_scatter", inner, nbytes)[1] + best("all_reduce", _across(topo, d), nbytes / d)[1]
            + best("all_gather", inner, nbytes)[1])


def _gather_like(kind: str):  # noqa: ANN202
    def seconds(topo: Topology, nbytes: float) -> float:
        if not topo.hierarchical:
            return math.inf
        d, inner, outer = topo.devices_per_node, _flat(topo.devices_per_node, topo.intra), _across(topo, topo.devices_per_node)
        return min(best(kind, inner, nbytes / topo.nodes)[1] + best(kind, outer, nbytes)[1],
                   best(kind, outer, nbytes / d)[1] + best(kind, inner, nbytes)[1])
    return seconds


def _broadcast(topo: Topology, nbytes: float) -> float:
    if not topo.hierarchical:
        return math.inf
    return (best("broadcast", _across(topo, 1), nbytes)[1]
            + best("broadcast", _flat(topo.devices_per_node, topo.intra), nbytes)[1])


def _all_to_all(topo: Topology, nbytes: float) -> float:
    # Each device exchanges its share with the others in its node, then the
    # node-level blocks cross between nodes (d parallel streams share the NIC).
    if not topo.hierarchical:
        return math.inf
    d = topo.devices_per_node
    return (best("all_to_all", _flat(d, topo.intra), nbytes)[1]
            + best("all_to_all", _across(topo, d), nbytes * d)[1] / d)


def _lines(kind: str, topo: Topology) -> tuple[Line, ...]:
    """One line per combination of the levels' algorithms: the least of them is the
    sum of each level's least, which is the time above."""
    if not topo.hierarchical:
        return ()
    d, nodes = topo.devices_per_node, topo.nodes
    inner, outer = _flat(d, topo.intra), _across(topo, d)
    if kind == "all_reduce":
        return tuple((a1 + a2 + a3, s1 + s2 / d + s3) for (a1, s1), (a2, s2), (a3, s3) in itertools.product(
            affine_costs("reduce_scatter", inner), affine_costs("all_reduce", outer), affine_costs("all_gather", inner)))
    if kind in ("all_gather", "reduce_scatter"):
        pairs = list(itertools.product(affine_costs(kind, inner), affine_costs(kind, outer)))
        return (tuple((a1 + a2, s1 / nodes + s2) for (a1, s1), (a2, s2) in pairs)  # inside nodes first
                + tuple((a1 + a2, s1 + s2 / d) for (a1, s1), (a2, s2) in pairs))  # across nodes first
    raise ValueError(f"hierarchical {kind} is priced size by size; use `best`")


ALGORITHM = Algorithm("hierarchical", {
    "all_reduce": _all_reduce,
    "all_gather": _gather_like("all_gather"),
    "reduce_scatter": _gather_like("reduce_scatter"),
    "broadcast": _broadcast,
    "all_to_all": _all_to_all,
}, curved=("broadcast", "all_to_all"), lines=_lines)
