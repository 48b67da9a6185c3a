"""A product's floor (`LowerBounds.product_floor`, which orders the search's streams
before their tables are priced) counts every layer in its summed stage times: with
one microbatch there is no bottleneck term, and a product of one layout is that
layout's own table bound, so the floor must meet it (below it only by rounding). A
floor that summed one layer per kind (as it did) fell a third or more below the
tables it stands for on 64 GPUs of three kinds, and the search priced tables of
products none of whose combinations could win."""

from __future__ import annotations

import numpy as np
import pytest

from solver.cost.stage_costs import INF
from solver.planner.layouts import kind_layouts
from solver.planner.search import Planner
from test_planner import random_problem


def test_a_one_layout_product_floor_meets_its_table_with_one_microbatch():
    met = 0
    for seed in range(12):
        met += _met(np.random.default_rng(500 + seed))
    assert met >= 10, met  # layouts whose one microbatch fits (on many problems few do)


def _met(rng: np.random.Generator) -> int:
    """The one-layout products of a random problem whose floor meets their table."""
    problem = random_problem(rng, kinds=int(rng.integers(1, 4)))
    bounds = Planner(problem).bounds
    b = problem.batch_size  # one microbatch: m - 1 = 0 bottlenecks
    met = 0
    for kind in problem.kinds:
        for lay in kind_layouts(problem, kind.name):
            if b % lay.dp or b // lay.dp < problem.min_examples:
                continue
            lower, _ = bounds.product_table([[lay]], 1, b, "1f1b")
            floor = bounds.product_floor([[lay]], 1, b, "1f1b")
            least = float(lower.min()) if len(lower) else INF
            assert floor <= least * (1 + 1e-12), (lay, floor, least)
            if least < INF:
                assert floor == pytest.approx(least, rel=1e-8), (lay, floor, least)  # (the floor keeps 1e-9 below)
                met += 1
    return met
