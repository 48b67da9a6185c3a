"""A set's bound pays the least sends of any of its orders (`LowerBounds._least_sends`):
every order's cuts, within each layout's stages and between neighbouring layouts,
send at least their pair's least activation. The figure must be the least over the
orders' own (brute force over each order's cuts, pair by pair), and the
set's bound must carry it: with one microbatch (no pace term) the bound less its
sends is the same set priced with its tails alone beside its stage times."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from solver.cost.stage_costs import INF
from solver.planner.layouts import kind_layouts
from solver.planner.search import Planner
from test_planner import SEND_HEAVY, random_problem


def _sets(problem, b: int):  # noqa: ANN001, ANN202
    """Sets of one layout of each kind whose data-parallel degree divides `b`."""
    per_kind = [[lay for lay in kind_layouts(problem, k.name) if not b % lay.dp] for k in problem.kinds]
    return list(itertools.product(*per_kind))


def test_a_sets_sends_are_its_orders_least():
    assert sum(_check(seed) for seed in range(24)) >= 30  # (few sets fit a small random problem)


def _check(seed: int) -> int:
    """Sets of a random problem whose least sends match their orders' (how many)."""
    problem = random_problem(np.random.default_rng(40 + seed), kinds=int(np.random.default_rng(seed).integers(2, 4)),
                             sends_scale=SEND_HEAVY)
    bounds = Planner(problem).bounds
    m = problem.microbatch_counts()[0]
    b = problem.batch_size // m
    sets = _sets(problem, b)[:20]
    if not sets:
        return 0
    table = bounds._layout_rows([lay for s in sets for lay in s], b)
    for layouts in sets:
        figure = bounds._least_sends(table, [layouts], sum(lay.stages for lay in layouts))[0]
        least = min(_sends(order, table) for order in itertools.permutations(layouts))
        assert figure == pytest.approx(least, rel=1e-8)
        assert figure <= least
    return len(sets)


def _sends(order, table) -> float:  # noqa: ANN001
    """One order's cuts, each its pair's least send both ways, summed stage by stage."""
    stages = [table.index[lay] for lay in order for _ in range(lay.stages)]
    return sum(2 * float(table.sends[x, y]) for x, y in zip(stages, stages[1:]))


def test_a_sets_bound_carries_its_sends():
    """With one microbatch there is no pace term, so the set's bound is its summed stage
    times and offsets: priced again without the sends (its tails alone as offsets), it
    falls by exactly the sends."""
    carried = 0
    for seed in range(8):
        problem = replace(random_problem(np.random.default_rng(60 + seed), kinds=2, sends_scale=SEND_HEAVY),
                          microbatches=(1,))
        bounds, b = Planner(problem).bounds, problem.batch_size
        sets = _sets(problem, b)
        figures = bounds.set_bounds(sets, 1, b, "1f1b")
        table = bounds._layout_rows([lay for s in sets for lay in s], b)
        for layouts, figure in zip(sets, figures):
            sends = bounds._least_sends(table, [layouts], sum(lay.stages for lay in layouts))[0]
            at = np.array([np.repeat([table.index[lay] for lay in layouts], [lay.stages for lay in layouts])])
            tails = np.maximum([bounds._least_tail(tuple(sorted(layouts)))], bounds._ends_tails(table, at, False))
            alone = bounds._bounds(table.fits[at, 0], 1, b, tails, INF, False, table, at, np.zeros(1), placed=False)[0]
            if figure < INF and sends > 0:
                assert figure == pytest.approx(alone + sends, rel=1e-9), (figure, alone, sends)
                carried += 1
    assert carried >= 5, carried
