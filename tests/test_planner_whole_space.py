"""Random problems with the planner's whole space switched on (every schedule and chunk
count, ZeRO, host offload, pipelines side by side, mixed-kind stages, every kind made to
work): every plan it returns carries the estimator's price of its own decisions, fits
each stage's memory and holds every layer once, or the planner says why none fits. The
brute-force tests (test_planner.py) keep to the plain schedules, where they can
enumerate; these hold the rest to the one estimator (the plans returned for these 40
draws include interleaved ones, ZeRO, host offload, recomputation and a mixed-kind
stage; 32 draws fit)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from solver.collectives import LinkCost
from solver.planner import DeviceKind, LayerCost, PlanningError, Problem, plan
from solver.planner.step import priced

GIB = 2**30


def whole_space_problem(rng: np.random.Generator) -> Problem:
    """Up to 10 layers and 3 kinds of up to 16 devices (nodes of 1-8, or an odd count on
    one node) of 0.5-12 GiB, some with host memory for offload; any batch of 1-32."""
    layers = tuple(
        LayerCost(flops=float(f), forward_flops=float(f) / 3, param_bytes=int(rng.integers(1, 60)) * 2**24,
                  saved_bytes=float(rng.integers(1, 40)) * 2**22, input_bytes=float(rng.integers(1, 8)) * 2**20,
                  tp_bytes=float(rng.integers(0, 4)) * 2**20)
        for f in rng.uniform(1e11, 1e12, int(rng.integers(1, 11)))
    )
    kinds = []
    for i in range(int(rng.integers(1, 4))):
        per_node = int(rng.choice([1, 2, 4, 8]))
        count = per_node * int(rng.integers(1, 3))
        if rng.random() < 0.2:
            count = int(rng.integers(1, 7))
            per_node = int(rng.choice([d for d in (1, 2, 3) if count % d == 0]))
        kinds.append(DeviceKind(
            f"k{i}", count, per_node, float(rng.uniform(1e12, 1e14)), int(rng.uniform(0.5, 12) * GIB),
            float(rng.uniform(3e11, 3e12)),
            LinkCost(float(rng.uniform(5e10, 3e11)), 5e-6), LinkCost(float(rng.uniform(5e9, 5e10)), 1e-5),
            layer_overhead_s=float(rng.uniform(0, 1e-4)), host_memory_bytes=float(rng.choice([0, 64 * GIB])),
        ))
    links = tuple((a.name, b.name, LinkCost(float(rng.uniform(1e9, 2e10)), 2e-5)) for a, b in itertools.combinations(kinds, 2))
    return Problem(layers, tuple(kinds), batch_size=int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 32])), links=links,
                   allow_replicas=bool(rng.random() < 0.5), memory_reserve=float(rng.uniform(0, 0.3)),
                   use_all_kinds=bool(rng.random() < 0.2))


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
