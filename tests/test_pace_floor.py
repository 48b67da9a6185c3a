"""The floors under an interleaved pipeline that rows are refused on (`_Row.pace_floor`
in `best_split`, `LowerBounds.interleaved_floor` before the stage tables) must lie below
every split of the row (brute force on the random small problems of test_planner), and
the first must bite where the least shared work spread evenly does not (a slow kind's
device group holding a layer per stage)."""

from __future__ import annotations

import numpy as np
import pytest

from solver.cost.stage_costs import INF, StageCosts
from solver.planner.layer_split import _Row, score
from solver.planner.search import Planner
from test_planner import compositions, interleaved_rows, random_problem


def _pace(tables, sends, cuts, chunks: int) -> float:  # noqa: ANN001
    """The interleaved form's pace of one split (solver.schedules.interleaved): the
    busiest device group's stages' times summed, or its sends."""
    groups = len(tables) // chunks
    bounds = list(zip([0, *cuts], [*cuts, tables[0].time.shape[0] - 1]))
    work, sent = [0.0] * groups, [0.0] * groups
    for p, (t, (i, j)) in enumerate(zip(tables, bounds)):
        work[p % groups] += float(t.time[i, j])
        if p + 1 < len(tables):
            sent[p % groups] += float(sends[p][j])
    return max(work + sent)


@pytest.mark.parametrize("seeds", [range(0, 12), range(12, 24)])
def test_the_pace_floor_is_below_every_split(seeds):
    checked = sum(_check(seed) for seed in seeds)
    assert checked >= 10, checked  # enough rows where some split fits (on many problems none does)


def _check(seed: int) -> int:
    """Rows of one random problem checked against brute force (those where a split fits)."""
    rng = np.random.default_rng(900 + seed)
    problem = random_problem(rng, kinds=int(rng.integers(2, 4)))
    costs = StageCosts(problem)
    checked = 0
    for m, b, order, layouts, groups, chunks, configs, tables, sends in interleaved_rows(problem, costs, (1, 2, 3)):
        floor = _Row(tables, sends).pace_floor(chunks)
        paces = [_pace(tables, sends, cuts, chunks) for cuts in compositions(costs.n, len(configs))]
        least = min((p for p in paces if p < INF), default=INF)
        assert floor <= least * (1 + 1e-12), (order, layouts, m, chunks, floor, least)
        checked += least < INF
    return checked


def test_the_pace_floor_sees_a_slow_group_that_even_work_misses():
    """Two device groups of two stages each, one fast, one 10x slower per layer, over
    four equal layers: every stage holds one layer, so the slow group's pace is two
    slow layers, though the work spread evenly over both groups is far less."""
    from solver.cost.stage_tables import StageTable

    n, fast, slow = 4, 1.0, 10.0
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    length = np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None]

    def table(per_layer: float) -> StageTable:
        t = np.where(upper, per_layer * length, INF)
        zeros = np.zeros((n + 1, n + 1))
        return StageTable(t, zeros, zeros.astype(bool), zeros, zeros, zeros, 1)

    tables = [table(fast), table(slow), table(fast), table(slow)]  # group 0 fast, group 1 slow
    sends = [np.zeros(n + 1)] * 3
    row = _Row(tables, sends)
    floor = row.pace_floor(2)
    assert floor == pytest.approx(2 * slow)  # each slow stage holds one layer at least
    assert row.least_work() * 2 / 4 < floor / 1.5  # the even spread: 11
    least = min(_pace(tables, sends, cuts, 2) for cuts in compositions(n, 4))
    assert floor <= least


@pytest.mark.parametrize("seeds", [range(0, 12), range(12, 24)])
def test_the_interleaved_floor_is_below_every_interleaved_split(seeds):
    """`LowerBounds.interleaved_floor`, which the search refuses interleaved rows on
    before their stage tables are built, never exceeds the interleaved step of a split
    of the row (brute force)."""
    checked = 0
    for seed in seeds:
        rng = np.random.default_rng(900 + seed)
        problem = random_problem(rng, kinds=int(rng.integers(1, 4)))
        planner = Planner(problem)
        costs, bounds = planner.costs, planner.bounds
        for m, b, order, layouts, groups, chunks, configs, tables, sends in interleaved_rows(problem, costs, (2, 3)):
            floor = bounds.interleaved_floor(layouts, m, b, chunks)
            best = min(score(tables, sends, m, cuts, "interleaved", chunks)
                       for cuts in compositions(costs.n, len(configs)))
            assert floor <= best * (1 + 1e-12), (order, layouts, m, chunks, floor, best)
            checked += best < INF
    assert checked >= 10, checked
