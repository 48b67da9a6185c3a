"""The planner simulates only the finalists that could win.

`pipeline_sim.step_floor` bounds a pipeline's simulated step from its stage figures
alone; the final ranking (`step.rank` with `exact_to`) skips simulating the plans whose
floor is above what the caller reads. Both are only as good as the floor is true: it is
checked below the simulation on random pipelines of every schedule, and a lazy ranking
against the full one.
"""

from __future__ import annotations

import numpy as np
import pytest

from solver.pipeline_sim import step_floor, step_time
from solver.planner.search import FINALISTS, Planner
from solver.planner.step import rank
from solver.schedules import StageTimes
from test_planner import random_problem


def _stages(rng: np.random.Generator, n: int) -> list[StageTimes]:
    return [StageTimes(*(float(x) for x in rng.uniform(0, 1, 2)), float(rng.choice([0.0, rng.uniform(0, 0.5)])),
                       *(float(x) for x in rng.uniform(0, 2, 2)))
            for _ in range(n)]


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 3)])
def test_the_floor_is_below_the_simulated_step(schedule, chunks):
    rng = np.random.default_rng(7)
    tight = 0
    for _ in range(300):
        groups = int(rng.integers(1, 6))
        m = int(rng.integers(1, 12))
        if chunks > 1:
            groups, m = max(groups, 2), max(m, 1) * max(groups, 2)
        stages = _stages(rng, groups * chunks)
        if rng.random() < 0.3:  # one slow stage: the bound's bottleneck term decides
            stages[int(rng.integers(len(stages)))] = StageTimes(5.0, 9.0, 0.1, 0.2, 0.3)
        floor, step = step_floor(stages, m, schedule, chunks), step_time(stages, m, schedule, chunks)
        assert 0 < floor <= step * (1 + 1e-12)
        tight += floor >= step * 0.9
    assert tight > 30  # close to the step often enough to spare simulations


@pytest.mark.parametrize("seed", range(10))
def test_a_lazy_ranking_reads_as_the_full_one(seed):
    """What the caller reads of the ranking (its first k) is the full ranking's, with
    fewer plans simulated."""
    problem = random_problem(np.random.default_rng(seed))
    planner = Planner(problem, finalists=FINALISTS)
    found = planner._search(tuple(k.name for k in problem.kinds), FINALISTS)
    full = rank(problem, found, planner.costs)
    for k in (1, 3):
        lazy = rank(problem, found, planner.costs, lambda ranked: ranked[k - 1].step_s if len(ranked) >= k else float("inf"))
        assert [(c.describe(), c.step_s) for c in lazy[:k]] == [(c.describe(), c.step_s) for c in full[:k]]
        assert len(lazy) <= len(full)
