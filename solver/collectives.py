"""Collective communication cost, alpha-beta model, per algorithm.

A message of `nbytes` over a link costs `latency + nbytes / bandwidth`. Each
algorithm's time is its closed form in that model; `best` picks the fastest, as
NCCL and MPI pick per message size and topology. A `Topology` is nodes x devices per
node with one link inside nodes and one between them; a flat group is one node.

Closed forms (n devices, M bytes of the full message, a = latency, b = 1/bandwidth):
  all-reduce   ring                2(n-1)a + 2(n-1)/n M b
               double binary tree  2 ceil(log2 n) a + 2 M b          (two pipelined trees, M/2 each)
               recursive doubling  ceil(log2 n) a + ceil(log2 n) M b
               Rabenseifner        2 log2 n a + 2(n-1)/n M b         (halving reduce-scatter + doubling all-gather)
               hierarchical        reduce-scatter in node, all-reduce across nodes on M/d, all-gather in node
  all-gather / reduce-scatter (M = the full gathered size)
               ring                (n-1)a + (n-1)/n M b
               recursive           log2 n a + (n-1)/n M b
               double binary tree  2 ceil(log2 n) a + M b            (gather up, broadcast down)
               hierarchical        inside nodes, then across nodes
  broadcast    ring (pipelined chain of k chunks)  (n-2+k)(a + M/k b)
               double binary tree  2 ceil(log2 n) a + M b
               scatter + all-gather (van de Geijn)  2 log2 n a + 2(n-1)/n M b
               hierarchical        across nodes, then inside nodes
  all-to-all   pairwise            (n-1)a + (n-1)/n M b
               Bruck               ceil(log2 n) a + ceil(log2 n) M/2 b
               hierarchical        inside nodes, then across nodes
Non-powers of two pay two extra full-message steps in the recursive algorithms
(fold to a power of two and back), as MPI implementations do.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class LinkCost:
    bandwidth: float  # bytes/s
    latency: float  # s

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Topology:
    nodes: int
    devices_per_node: int
    intra: LinkCost
    inter: LinkCost

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node

    def flat_link(self) -> LinkCost:
        """The link a flat algorithm over all devices is limited by: the slowest one used."""
        return self.inter if self.nodes > 1 else self.intra


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _fold(n: int, nbytes: float, link: LinkCost) -> float:
    """Extra cost for a non-power-of-two group in recursive algorithms."""
    return 0.0 if n & (n - 1) == 0 else 2 * link.time(nbytes)


# ---- all-reduce -----------------------------------------------------------------
def allreduce_ring(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def allreduce_double_binary_tree(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * _log2(n) * link.latency + 2 * nbytes / link.bandwidth


def allreduce_recursive_doubling(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return _log2(n) * link.time(nbytes) + _fold(n, nbytes, link)


def allreduce_rabenseifner(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * _log2(n) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth + _fold(n, nbytes, link)


# ---- all-gather / reduce-scatter (same cost, mirrored) ------------------------------
def allgather_ring(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def allgather_recursive(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return _log2(n) * link.latency + (n - 1) / n * nbytes / link.bandwidth + _fold(n, nbytes / n, link)


def allgather_double_binary_tree(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * _log2(n) * link.latency + nbytes / link.bandwidth


# ---- broadcast ----------------------------------------------------------------------
def broadcast_ring(n: int, nbytes: float, link: LinkCost) -> float:
    """A pipelined chain; the chunk count that minimises the closed form."""
    if n <= 1:
        return 0.0
    if n == 2:
        return link.time(nbytes)
    k = max(1, round(math.sqrt((n - 2) * nbytes / link.bandwidth / link.latency)))
    return (n - 2 + k) * link.time(nbytes / k)


def broadcast_double_binary_tree(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * _log2(n) * link.latency + nbytes / link.bandwidth


def broadcast_scatter_allgather(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return 2 * _log2(n) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


# ---- all-to-all ---------------------------------------------------------------------
def alltoall_pairwise(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def alltoall_bruck(n: int, nbytes: float, link: LinkCost) -> float:
    if n <= 1:
        return 0.0
    return _log2(n) * (link.latency + nbytes / 2 / link.bandwidth)


FLAT: dict[str, dict[str, Callable[[int, float, LinkCost], float]]] = {
    "all_reduce": {
        "ring": allreduce_ring,
        "double_binary_tree": allreduce_double_binary_tree,
        "recursive_halving_doubling": allreduce_recursive_doubling,
        "rabenseifner": allreduce_rabenseifner,
    },
    "all_gather": {
        "ring": allgather_ring,
        "recursive_halving_doubling": allgather_recursive,
        "double_binary_tree": allgather_double_binary_tree,
    },
    "reduce_scatter": {
        "ring": allgather_ring,
        "recursive_halving_doubling": allgather_recursive,
        "double_binary_tree": allgather_double_binary_tree,
    },
    "broadcast": {
        "ring": broadcast_ring,
        "double_binary_tree": broadcast_double_binary_tree,
        "rabenseifner": broadcast_scatter_allgather,
    },
    "all_to_all": {
        "ring": alltoall_pairwise,
        "recursive_halving_doubling": alltoall_bruck,
    },
}


def _best_flat(kind: str, n: int, nbytes: float, link: LinkCost) -> float:
    return min(fn(n, nbytes, link) for fn in FLAT[kind].values())


def hierarchical(kind: str, topo: Topology, nbytes: float) -> float:
    """Inside each node first (fast links), then across nodes on what is left."""
    d, nodes = topo.devices_per_node, topo.nodes
    if kind == "all_reduce":
        return (
            _best_flat("reduce_scatter", d, nbytes, topo.intra)
            + _best_flat("all_reduce", nodes, nbytes / d, topo.inter)
            + _best_flat("all_gather", d, nbytes, topo.intra)
        )
    if kind in ("all_gather", "reduce_scatter"):
        inner = _best_flat(kind, d, nbytes / nodes, topo.intra)
        outer = _best_flat(kind, nodes, nbytes, topo.inter)
        return inner + outer
    if kind == "broadcast":
        return _best_flat("broadcast", nodes, nbytes, topo.inter) + _best_flat("broadcast", d, nbytes, topo.intra)
    if kind == "all_to_all":
        # Each device exchanges its share with the others in its node, then the
        # node-level blocks cross between nodes (d parallel streams share the NIC).
        return _best_flat("all_to_all", d, nbytes, topo.intra) + _best_flat("all_to_all", nodes, nbytes * d, topo.inter) / d
    raise ValueError(f"unknown collective {kind!r}")


def costs(kind: str, topo: Topology, nbytes: float) -> dict[str, float]:
    """Time of every algorithm for collective `kind` of `nbytes` on `topo`."""
    if kind not in FLAT:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(FLAT)}")
    out = {name: fn(topo.size, nbytes, topo.flat_link()) for name, fn in FLAT[kind].items()}
    if topo.nodes > 1 and topo.devices_per_node > 1:
        out["hierarchical"] = hierarchical(kind, topo, nbytes)
    return out


def best(kind: str, topo: Topology, nbytes: float) -> tuple[str, float]:
    """(algorithm, seconds) of the fastest algorithm for this size and topology.
    Remembered: the sharding pass asks the same few sizes millions of times."""
    if topo.size <= 1 or nbytes <= 0:
        return "none", 0.0
    return _best(kind, topo, float(nbytes))


@lru_cache(maxsize=1 << 16)
def _best(kind: str, topo: Topology, nbytes: float) -> tuple[str, float]:
    options = costs(kind, topo, nbytes)
    name = min(options, key=options.get)
    return name, options[name]


@lru_cache(maxsize=None)
def affine_costs(kind: str, topo: Topology) -> tuple[tuple[float, float], ...]:
    """Every algorithm's time for collective `kind` (an all-reduce, all-gather or
    reduce-scatter) as (latency term, seconds per byte), so a search can price
    thousands of message sizes with one numpy expression: the fastest is the least of
    these lines. The flat closed forms are affine in the size; the hierarchical one
    picks an algorithm per level, so it contributes one line per combination of
    those picks."""
    if kind not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"affine_costs covers all_reduce, all_gather and reduce_scatter, not {kind!r}")
    if topo.size <= 1:
        return ()
    unit = 2.0**30

    def line(fn: Callable[[float], float]) -> tuple[float, float]:
        zero = fn(0.0)
        return zero, (fn(unit) - zero) / unit

    link = topo.flat_link()
    lines = [line(lambda m, f=f: f(topo.size, m, link)) for f in FLAT[kind].values()]
    if topo.nodes > 1 and topo.devices_per_node > 1:
        d, nodes = topo.devices_per_node, topo.nodes
        if kind == "all_reduce":
            for rs, ar, ag in itertools.product(FLAT["reduce_scatter"].values(), FLAT["all_reduce"].values(),
                                                FLAT["all_gather"].values()):
                lines.append(line(lambda m, rs=rs, ar=ar, ag=ag: rs(d, m, topo.intra) + ar(nodes, m / d, topo.inter)
                                  + ag(d, m, topo.intra)))
        else:  # as `hierarchical`: inside each node on its share, then across nodes
            for inner, outer in itertools.product(FLAT[kind].values(), FLAT[kind].values()):
                lines.append(line(lambda m, i=inner, o=outer: i(d, m / nodes, topo.intra) + o(nodes, m, topo.inter)))
    return tuple(lines)


def fastest_times(kind: str, topo: Topology, nbytes: Any) -> Any:
    """`best`'s time for every size in `nbytes` (a number or a numpy array) at once:
    the least of `affine_costs`' lines, 0 for nothing to move."""
    nbytes = np.asarray(nbytes, dtype=float)
    lines = affine_costs(kind, topo)
    if not lines:
        return np.zeros_like(nbytes)
    times = np.min([a + slope * nbytes for a, slope in lines], axis=0)
    return np.where(nbytes > 0, times, 0.0)


def p2p(nbytes: float, link: LinkCost) -> float:
    return link.time(nbytes) if nbytes > 0 else 0.0
