"""Collective costs against their closed forms, and the algorithm choice by size."""

import math

import pytest

from solver import collectives as c

A, BW = 5e-6, 100e9  # latency (s), bandwidth (bytes/s)
LINK = c.LinkCost(BW, A)
B = 1 / BW


def flat(n):
    return c.Topology(1, n, LINK, LINK)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("m", [1e3, 1e6, 1e9])
def test_closed_forms(n, m):
    log = math.log2(n)
    assert c.allreduce_ring(n, m, LINK) == pytest.approx(2 * (n - 1) * A + 2 * (n - 1) / n * m * B)
    assert c.allreduce_double_binary_tree(n, m, LINK) == pytest.approx(2 * log * A + 2 * m * B)
    assert c.allreduce_recursive_doubling(n, m, LINK) == pytest.approx(log * (A + m * B))
    assert c.allreduce_rabenseifner(n, m, LINK) == pytest.approx(2 * log * A + 2 * (n - 1) / n * m * B)
    assert c.allgather_ring(n, m, LINK) == pytest.approx((n - 1) * A + (n - 1) / n * m * B)
    assert c.allgather_recursive(n, m, LINK) == pytest.approx(log * A + (n - 1) / n * m * B)
    assert c.broadcast_double_binary_tree(n, m, LINK) == pytest.approx(2 * log * A + m * B)
    assert c.broadcast_scatter_allgather(n, m, LINK) == pytest.approx(2 * log * A + 2 * (n - 1) / n * m * B)
    assert c.alltoall_pairwise(n, m, LINK) == pytest.approx((n - 1) * A + (n - 1) / n * m * B)
    assert c.alltoall_bruck(n, m, LINK) == pytest.approx(log * (A + m / 2 * B))
    assert c.p2p(m, LINK) == pytest.approx(A + m * B)


def test_non_power_of_two_pays_the_fold():
    assert c.allreduce_rabenseifner(6, 1e6, LINK) == pytest.approx(2 * 3 * A + 2 * 5 / 6 * 1e6 * B + 2 * (A + 1e6 * B))


def test_pipelined_chain_broadcast_approaches_bandwidth_bound():
    assert 1e9 * B < c.broadcast_ring(8, 1e9, LINK) < 1.15 * 1e9 * B


def test_allreduce_small_messages_take_recursive_doubling_large_take_bandwidth_optimal():
    assert c.best("all_reduce", flat(8), 8)[0] == "recursive_halving_doubling"
    assert c.best("all_reduce", flat(8), 1e9)[0] == "rabenseifner"


def test_allreduce_tree_to_ring_switch_where_closed_forms_cross():
    n = 12  # not a power of two: the recursive algorithms pay a fold, so tree and ring compete
    # tree: 2*ceil(log2 n)*a + 2*M*b == ring: 2(n-1)*a + 2(n-1)/n*M*b  at  M* below
    m_star = (2 * (n - 1) - 2 * math.ceil(math.log2(n))) * A / (2 * B * (1 - (n - 1) / n))
    assert c.best("all_reduce", flat(n), m_star * 0.8)[0] == "double_binary_tree"
    assert c.best("all_reduce", flat(n), m_star * 1.25)[0] == "ring"


def test_hierarchical_wins_across_slow_node_links():
    slow = c.LinkCost(12.5e9, 10e-6)
    topo = c.Topology(nodes=4, devices_per_node=8, intra=c.LinkCost(300e9, 3e-6), inter=slow)
    name, t = c.best("all_reduce", topo, 1e9)
    assert name == "hierarchical"
    # reduce-scatter inside (M), all-reduce of M/8 across 4 nodes, all-gather inside.
    inner = c.allgather_recursive(8, 1e9, topo.intra)
    assert t == pytest.approx(2 * inner + c.allreduce_rabenseifner(4, 1e9 / 8, slow))


def test_single_device_and_empty_messages_cost_nothing():
    assert c.best("all_reduce", flat(1), 1e9) == ("none", 0.0)
    assert c.best("all_gather", flat(8), 0) == ("none", 0.0)


def test_unknown_collective_is_named():
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        c.costs("gossip", flat(4), 1e3)
