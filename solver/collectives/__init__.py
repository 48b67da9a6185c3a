"""Collective communication cost, alpha-beta model, per algorithm, registered once.

A message of `nbytes` over a link costs `latency + nbytes / bandwidth`. Each
algorithm (one module here: ring, double binary tree, recursive halving/doubling,
Rabenseifner, hierarchical, in-network) gives its closed form per collective in that model;
`best` picks the fastest registered one, as NCCL and MPI pick per message size and
topology. Adding an algorithm is a module defining an `Algorithm` and one
`register` call (below, or `registered(...)` for a while): every pricer then sees it.
"""

from solver.collectives import (double_binary_tree, hierarchical, in_network, rabenseifner, recursive_halving_doubling,
                                ring)
from solver.collectives.base import COLLECTIVES, Algorithm, LinkCost, SwitchReduction, Topology
from solver.collectives.double_binary_tree import (allgather_double_binary_tree, allreduce_double_binary_tree,
                                                   broadcast_double_binary_tree)
from solver.collectives.rabenseifner import allreduce_rabenseifner, broadcast_scatter_allgather
from solver.collectives.recursive_halving_doubling import allgather_recursive, allreduce_recursive_doubling, alltoall_bruck
from solver.collectives.registry import (affine_costs, best, costs, fastest_times, get, names, register, registered,
                                         unregister)
from solver.collectives.ring import allgather_ring, allreduce_ring, alltoall_pairwise, broadcast_ring

# Registration order breaks ties between equally fast algorithms.
register(ring.ALGORITHM)
register(double_binary_tree.ALGORITHM)
register(recursive_halving_doubling.ALGORITHM)
register(rabenseifner.ALGORITHM)
register(hierarchical.ALGORITHM)
register(in_network.ALGORITHM)


def p2p(nbytes: float, link: LinkCost) -> float:
    """One message over one link."""
    return link.time(nbytes) if nbytes > 0 else 0.0


__all__ = [
    "COLLECTIVES", "Algorithm", "LinkCost", "SwitchReduction", "Topology", "affine_costs", "best", "costs", "fastest_times", "get", "names",
    "p2p", "register", "registered", "unregister",
    "allgather_double_binary_tree", "allgather_recursive", "allgather_ring", "allreduce_double_binary_tree",
    "allreduce_rabenseifner", "allreduce_recursive_doubling", "allreduce_ring", "alltoall_bruck", "alltoall_pairwise",
    "broadcast_double_binary_tree", "broadcast_ring", "broadcast_scatter_allgather",
]
