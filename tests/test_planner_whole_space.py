"""Random problems with the planner's whole space switched on (every schedule and chunk
count, ZeRO, host offload, pipelines side by side, mixed-kind stages, every kind made to
work): every plan it returns carries the estimator's price of its own decisions, fits
each stage's memory and holds every layer once, or the planner says why none fits. The
brute-force tests (test_planner.py) keep to the plain schedules, where they can
enumerate; these hold the rest to the one estimator. The draws are test_planner's, with
that space opened (the plans returned for these 40 include interleaved ones, ZeRO, host
offload, recomputation, pipelines side by side and mixed-kind stages; 31 draws fit)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from solver import schedules
from solver.planner import PlanningError, Problem, plan
from solver.planner.step import priced
from test_planner import GIB, random_problem


def whole_space_problem(rng: np.random.Generator) -> Problem:
    """`random_problem` with every schedule allowed, host memory for offload on some
    kinds, and sometimes every kind made to work."""
    problem = random_problem(rng, allow_replicas=bool(rng.random() < 0.5))
    kinds = tuple(replace(k, host_memory_bytes=float(rng.choice([0, 64 * GIB]))) for k in problem.kinds)
    return replace(problem, kinds=kinds, schedules=schedules.names(), use_all_kinds=bool(rng.random() < 0.2))


@pytest.mark.parametrize("seeds", [range(0, 20), range(20, 40)])
def test_every_plan_returned_is_the_estimators_and_fits(seeds):
    planned = 0
    for seed in seeds:
        problem = whole_space_problem(np.random.default_rng(seed))
        try:
            result = plan(problem, top_k=3)
        except PlanningError as e:
            assert "no plan fits" in str(e) or "no pipeline can run" in str(e), str(e)
            continue
        planned += 1
        for choice in (result.best, *result.alternatives):
            cost = priced(problem, choice)
            assert cost.step_s == pytest.approx(choice.step_s, rel=1e-9), (seed, choice.describe())
            assert all(s.group_memory_bytes <= s.capacity * (1 + 1e-9) for s in cost.stages), (seed, choice.describe())
            for r in range(len(choice.replica_batch)):
                held = sorted((s.layer_start, s.layer_end) for s in choice.stages if s.replica == r and s.part_of < 0)
                assert [a for a, _ in held] == [0, *[b for _, b in held[:-1]]] and held[-1][1] == len(problem.layers)
            assert sum(choice.replica_batch) == problem.batch_size
    assert planned >= 12  # most draws fit: the invariants were checked, not skipped
