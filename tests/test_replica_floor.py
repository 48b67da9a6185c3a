"""The floors that refuse replica plans before their shares are searched
(solver/planner/shares.py, `Planner._shares_lose`): each refusal must be proven,
so the planner's replica plans are the same with them as without."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from solver.cost.stage_costs import INF
from solver.planner import replica_search
from solver.planner.search import Planner
from solver.planner.shares import every_split_loses, most_share
from solver.collectives import LinkCost
from solver.planner import DeviceKind, LayerCost, Problem
from test_planner import GIB, random_problem


def _splits(size: int, parts: int):
    for cuts in itertools.combinations(range(1, size), parts - 1):
        bounds = (0, *cuts, size)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(60))
def test_every_split_loses_only_when_every_split_has_a_losing_share(seed):
    rng = np.random.default_rng(seed)
    size, parts = int(rng.integers(1, 24)), int(rng.integers(2, 4))
    most = [int(rng.integers(0, size + 1)) for _ in range(parts)]
    lost = rng.random((parts, size + 1)) < rng.uniform(0.2, 0.95)
    asked = []

    def loses(i: int, share: int) -> bool:
        assert 1 <= share <= most[i], "asked about a share outside the part's bounds"
        asked.append((i, share))
        return bool(lost[i, share])

    budget = int(rng.integers(0, 40))
    proven = every_split_loses(size, most, loses, budget)
    assert len(set(asked)) <= budget
    winning = [s for s in _splits(size, parts) if all(b <= h and not lost[i, b] for i, (b, h) in enumerate(zip(s, most)))]
    if proven:
        assert not winning, winning
    if parts == 2 and budget >= 2 * size:  # two parts: the interval is every split, so it decides exactly
        assert proven == (not winning)


def test_most_share_is_the_largest_accepted():
    for size in range(0, 30):
        for limit in range(-1, 35):
            assert most_share(size, lambda b: b <= limit) == max(0, min(size, limit))


def test_share_floor_is_below_every_single_kind_pipeline():
    """`_share_floor` bounds what `_single_kind` returns, on every share of every
    microbatch of random problems."""
    checked = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        problem = random_problem(rng, kinds=int(rng.integers(2, 4)))
        planner = Planner(problem)
        for m in problem.microbatch_counts():
            for kind in problem.kinds:
                for b in range(1, problem.batch_size // m + 1):
                    floor = planner._share_floor(kind.name, m, b)
                    plan = planner._single_kind(kind.name, m, b)
                    if plan is not None:
                        assert floor <= plan.step_s, (seed, kind.name, m, b, floor, plan.step_s)
                        checked += 1
    assert checked > 100


def _replica_problem(batch: int, slow_flops: float) -> Problem:
    """Two kinds whose pipelines side by side beat one across them (a slow link
    between them); a batch large enough that the shares are balanced, not enumerated."""
    layer = LayerCost(1e12, 1e12 / 3, 2**30, 2**20, 2**20)
    fast = DeviceKind("fast", 2, 2, 3e12, 80 * GIB, 1e12, LinkCost(1e11, 1e-6), LinkCost(1e10, 1e-6))
    slow = DeviceKind("slow", 2, 2, slow_flops, 80 * GIB, 1e12, LinkCost(1e11, 1e-6), LinkCost(1e10, 1e-6))
    return Problem((LayerCost(1e12, 1e12 / 3, 2**20, 2**20, 2**30),) + (layer,) * 3, (slow, fast), batch,
                   (("slow", "fast", LinkCost(1e9, 1e-3)),))


def _described(plans) -> list[tuple[str, float]]:  # noqa: ANN001
    return [(c.describe(), c.step_s) for c in plans]


@pytest.mark.parametrize("batch,slow_flops", [(64, 1e12), (96, 2e12), (256, 1e12), (48, 3e11)])
def test_replica_plans_are_the_same_without_the_floors(monkeypatch, batch, slow_flops):
    """Every beat from above the best replica plan to below it: the floors refuse only
    plans that could not be kept (this fails if a refusal were wrong)."""
    problem = _replica_problem(batch, slow_flops)
    best = Planner(problem)._replica_plans(INF)
    assert best, "the scenario must have replica plans"
    fastest = min(c.step_s for c in best)
    beats = [INF, *(fastest * f for f in (1.5, 1.1, 1.01, 1.0, 0.99, 0.9))]
    with_floors = [_described(Planner(problem)._replica_plans(beat)) for beat in beats]
    monkeypatch.setattr(Planner, "_shares_lose", lambda *a: False)
    monkeypatch.setattr(Planner, "_share_floor", lambda *a: 0.0)  # no whole-microbatch refusal either
    without = [_described(Planner(problem)._replica_plans(beat)) for beat in beats]
    assert with_floors == without
    assert any(with_floors) and not all(with_floors)  # some beats keep plans, some refuse them all


def test_the_floors_refuse_where_they_can(monkeypatch):
    """A beat below every replica plan: the floors alone refuse most, without the
    pipelines' searches `_best_shares` would run."""
    problem = _replica_problem(256, 1e12)
    fastest = min(c.step_s for c in Planner(problem)._replica_plans(INF))
    planner = Planner(problem)
    searched = []
    single = Planner._single_kind
    monkeypatch.setattr(Planner, "_single_kind", lambda self, *a: searched.append(a) or single(self, *a))
    assert planner._replica_plans(fastest * 0.9) == []
    assert replica_search.SHARE_FLOORS > 0
    refused = [m for m in problem.microbatch_counts()
               if planner._shares_lose(("slow", "fast"), m, problem.batch_size // m, planner._cross_sync(("slow", "fast")),
                                       fastest * 0.9)]
    assert refused, "no microbatch count was refused by the floors"
    assert not any(m in refused for _, m, *_ in searched)


@pytest.mark.parametrize("batch,slow_flops", [(64, 1e12), (96, 2e12), (256, 1e12), (48, 3e11)])
@pytest.mark.parametrize("skew", [1.0, 4.0])
def test_balancing_below_the_beat_keeps_what_balancing_in_full_finds(monkeypatch, batch, slow_flops, skew):
    """`_balanced` searches each share's pipeline only below the beat, so it knows a
    losing share as slower, not by how much: every beat from above the best replica plan
    to below it keeps the plans (those under it) that balancing with every pipeline
    timed in full finds. `skew` starts the fast kind on a quarter of its share (its
    bound taken 4 times too slow), so the descent walks many steps off a share over the
    beat (this fails if it stopped where the slowest share first loses)."""
    problem = _replica_problem(batch, slow_flops)
    balanced, bound = Planner._balanced, Planner._layouts_bound

    def skewed(self, kind, m, b):  # noqa: ANN001, ANN202
        return bound(self, kind, m, b) * (skew if kind == "fast" else 1)

    monkeypatch.setattr(Planner, "_layouts_bound", skewed)
    monkeypatch.setattr(Planner, "_balanced", lambda self, kinds, m, per_mb, grid, _: balanced(self, kinds, m, per_mb, grid, INF))
    in_full = Planner(problem)._replica_plans(INF)
    monkeypatch.setattr(Planner, "_balanced", balanced)
    grids = [len(range(step, per_mb, step)) for per_mb in (problem.batch_size // c.num_microbatches for c in in_full)
             for step in [max(1, math.ceil(per_mb / problem.replica_units))]]
    assert max(grids) > 16, "no shares were balanced (small grids are enumerated)"
    fastest = min(c.step_s for c in in_full)
    for beat in (INF, *(fastest * f for f in (1.5, 1.1, 1.01, 1.0, 0.99))):
        assert _described(Planner(problem)._replica_plans(beat)) == _described(c for c in in_full if c.step_s < beat), beat
