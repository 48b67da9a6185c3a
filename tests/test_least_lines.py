"""`fastest_times` takes the least of the lines some size can make least
(`registry._least_lines`): the same seconds, bit for bit, as the least of every
algorithm's line, while the hierarchical products of picks it drops are most of them."""

import numpy as np

from solver.collectives import LinkCost, Topology, affine_costs, fastest_times
from solver.collectives.registry import _least_lines


def test_the_least_lines_price_every_size_as_all_the_lines_do():
    rng = np.random.default_rng(0)
    sizes = np.concatenate([rng.random(500) * 1e10, [0.0, -5.0, 1.0, 2.0**30], np.arange(1, 200) * 4096.0])
    fewer = 0
    for nodes, per_node in [(1, 8), (4, 8), (16, 8), (32, 4), (2, 1)]:
        topo = Topology(nodes, per_node, LinkCost(3e11, 5e-6), LinkCost(2.5e10, 1e-5))
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            lines = affine_costs(kind, topo)
            every = lines[0][0] + lines[0][1] * sizes
            for a, slope in lines[1:]:
                every = np.minimum(every, a + slope * sizes)
            assert np.array_equal(fastest_times(kind, topo, sizes), np.where(sizes > 0, every, 0.0))
            fewer += len(lines) - len(_least_lines(kind, topo))
    assert fewer > 10  # lines are dropped: the test can fail
