"""Rabenseifner: a collective split into a scatter part and a gather part, each
recursive, so both the latency (log n) and the bandwidth ((n-1)/n) terms are near
their least. Large messages on power-of-two groups take it.

  all-reduce  2 log2 n a + 2(n-1)/n M b   (halving reduce-scatter, then doubling all-gather)
  broadcast   2 log2 n a + 2(n-1)/n M b   (scatter, then all-gather: van de Geijn)
Non-powers of two pay the fold on the all-reduce.
"""

from __future__ import annotations

from solver.collectives.base import Algorithm, LinkCost, fold, log2_steps


def allreduce_rabenseifner(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * log2_steps(n) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth + fold(n, nbytes, link)


def broadcast_scatter_allgather(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * log2_steps(n) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


ALGORITHM = Algorithm.flat("rabenseifner", {
    "all_reduce": allreduce_rabenseifner,
    "broadcast": broadcast_scatter_allgather,
})
