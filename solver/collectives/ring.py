"""Ring algorithms: each device talks only to its neighbours, so every link carries
the same share and the bandwidth term is optimal, at n - 1 latencies per pass.

  all-reduce      2(n-1)a + 2(n-1)/n M b       (reduce-scatter then all-gather round the ring)
  all-gather /
  reduce-scatter  (n-1)a + (n-1)/n M b
  broadcast       (n-2+k)(a + M/k b)           (a pipelined chain of k chunks, k the best)
  all-to-all      (n-1)a + (n-1)/n M b         (pairwise exchange)
(n devices, M bytes of the full message, a = latency, b = 1/bandwidth)
"""

from __future__ import annotations

import math

from solver.collectives.base import Algorithm, LinkCost


def allreduce_ring(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def allgather_ring(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def broadcast_ring(n: int, nbytes: float, link: LinkCost) -> float:
    """A pipelined chain; the chunk count that minimises the closed form."""
    if n <= 1:
        return 0.0
    if n == 2:
        return link.time(nbytes)
    k = max(1, round(math.sqrt((n - 2) * nbytes / link.bandwidth / link.latency)))
    return (n - 2 + k) * link.time(nbytes / k)


def alltoall_pairwise(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


# The chain broadcast's best chunk count grows with the size: not a straight line.
ALGORITHM = Algorithm.flat("ring", {
    "all_reduce": allreduce_ring,
    "all_gather": allgather_ring,
    "reduce_scatter": allgather_ring,
    "broadcast": broadcast_ring,
    "all_to_all": alltoall_pairwise,
}, curved=("broadcast",), crossing=1)  # laid out node by node: one flow leaves each node
