"""Double binary tree (NCCL's trees): two pipelined binary trees, each carrying half
the message, so every device sends and receives at full rate at log n latency.

  all-reduce      2 ceil(log2 n) a + 2 M b      (reduce up, broadcast down, M/2 per tree)
  all-gather /
  reduce-scatter  2 ceil(log2 n) a + M b        (gather up, broadcast down)
  broadcast       2 ceil(log2 n) a + M b
"""

from __future__ import annotations

from solver.collectives.base import Algorithm, LinkCost, log2_steps


def allreduce_double_binary_tree(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * log2_steps(n) * link.latency + 2 * nbytes / link.bandwidth


def allgather_double_binary_tree(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * log2_steps(n) * link.latency + nbytes / link.bandwidth


def broadcast_double_binary_tree(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * log2_steps(n) * link.latency + nbytes / link.bandwidth


ALGORITHM = Algorithm.flat("double_binary_tree", {
    "all_reduce": allreduce_double_binary_tree,
    "all_gather": allgather_double_binary_tree,
    "reduce_scatter": allgather_double_binary_tree,
    "broadcast": broadcast_double_binary_tree,
})
