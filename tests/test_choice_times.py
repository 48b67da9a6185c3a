"""A stage's times under every ZeRO stage at once (`solver.cost.choice_times`) are each
stage's own, bit for bit: what `StageCosts._times` summed one ZeRO stage and
recomputation at a time before (`own_times` below, that code), and the tables' picks
read from the stacks are the ones read from each choice's times apart."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from solver.cost.ranges import full
from solver.cost.stage_costs import StageCosts
from test_device_table import _measured, _same
from test_planner import random_problem
from test_stage_cost_sharing import _stages


def own_times(costs: StageCosts, cfg, b: int, zero: int, remat: str) -> tuple[np.ndarray, ...]:  # noqa: ANN001
    """One ZeRO stage's and recomputation's times, summed alone (the way before the stacks)."""
    f, bw, _, _, rerun = costs._ranges(cfg, b)
    extra_f, extra_b, step_sync, tail = costs.step_costs(cfg, zero)
    launch, dispatch = costs.launches(cfg, b / cfg.dp), costs.dispatches(cfg)
    forward = np.maximum(f + extra_f + launch, 0.0) + dispatch
    backward = np.maximum(bw + extra_b + launch + (rerun + extra_f if remat else 0.0), 0.0) + dispatch
    return full(forward, f.shape), full(backward, f.shape), full(tail, f.shape), full(step_sync, f.shape)


@pytest.mark.parametrize("measured, training", [(False, True), (True, True), (False, False)])
def test_stacked_times_are_each_choices_own(measured, training):
    compared = 0
    for seed in range(8):
        problem = replace(random_problem(np.random.default_rng(seed)), allow_remat=True, training=training)
        if measured:
            problem = replace(problem, measured_layers=_measured(problem))
        costs = StageCosts(problem)
        for cfg, b in list(_stages(problem))[:10]:
            for zero in (*costs.zero_stages(cfg), 3):  # 3: a stage's own ZeRO stage or one asked apart
                for remat in ("", "full"):
                    got = costs._times(cfg, b, zero, remat)
                    assert got[4] == 0.0
                    for a, want in zip(got[:4], own_times(costs, cfg, b, zero, remat)):
                        assert _same(a, want)
                    compared += 1
    assert compared > 100


def test_picks_from_the_stacks_are_the_picks_apart():
    compared = 0
    for seed in range(8):
        problem = replace(random_problem(np.random.default_rng(seed)), allow_remat=True, offload_tiers=("",))
        costs = StageCosts(problem)
        tables = costs._device_tables
        for cfg, b in list(_stages(problem))[:8]:
            choices = tuple(costs.table_choices(cfg))
            picks = tables._picks_uncached(cfg, b, 2, False, choices)
            apart = np.empty((4, len(choices), len(tables.ranges)))
            for c, (zero, remat) in enumerate(choices):
                for k, values in enumerate(own_times(costs, cfg, b, zero, remat)):
                    apart[k, c] = values.reshape(-1)[tables.ranges]
            assert _same(picks.times.reshape(4, len(choices) + 1, -1)[:, 1:], apart)
            compared += 1
    assert compared > 20
