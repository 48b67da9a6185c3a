"""Recursive doubling and halving: log n rounds, partners at distance 1, 2, 4, ...
Few latencies, so small messages take it.

  all-reduce      ceil(log2 n) a + ceil(log2 n) M b    (recursive doubling, the whole message each round)
  all-gather /
  reduce-scatter  log2 n a + (n-1)/n M b               (recursive doubling / halving)
  all-to-all      ceil(log2 n) a + ceil(log2 n) M/2 b  (Bruck)
Non-powers of two pay two extra full-message steps (fold to a power of two and back).
"""

from __future__ import annotations

from solver.collectives.base import Algorithm, LinkCost, fold, log2_steps


def allreduce_recursive_doubling(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return log2_steps(n) * link.time(nbytes) + fold(n, nbytes, link)


def allgather_recursive(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return log2_steps(n) * link.latency + (n - 1) / n * nbytes / link.bandwidth + fold(n, nbytes / n, link)


def alltoall_bruck(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return log2_steps(n) * (link.latency + nbytes / 2 / link.bandwidth)


ALGORITHM = Algorithm.flat("recursive_halving_doubling", {
    "all_reduce": allreduce_recursive_doubling,
    "all_gather": allgather_recursive,
    "reduce_scatter": allgather_recursive,
    "all_to_all": alltoall_bruck,
})
