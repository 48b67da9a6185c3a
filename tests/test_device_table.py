"""The on-device stage tables (`solver.cost.device_table`) read their picks from rows laid
out once per stage, microbatch count and place, after a "nothing fits" row, and add each
choice's memory from parts stacked once (`choice_memory.range_totals`): every figure must
be what the direct way gives, bit for bit (the way the tables were built before: each
choice's memory by `ChoiceMemory.totals`, a mask, a minimum, the first choice equal to
it, and blanks where nothing fits)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from solver.cost.choice_memory import choice_arrays
from solver.cost.device_table import first_least
from solver.cost.measured import LayerPoint, MeasuredLayer
from solver.cost.stage_costs import StageCosts
from solver.cost.stage_tables import StageTable
from test_planner import random_problem
from test_stage_cost_sharing import _stages

INF = float("inf")


def direct_table(costs: StageCosts, cfg, b: int, held: int, last: bool, m: int) -> StageTable:  # noqa: ANN001
    """The table as it was built before: every choice's memory and step cost at the
    ranges, the first of the fastest that fit, the picks laid into blank tables."""
    shape, ranges = costs._choice_memory.shape, costs._choice_memory.ranges
    capacity, choices = costs.capacity(cfg.kind), costs.table_choices(cfg)
    placed = last and bool(costs.measured(cfg, b / cfg.dp))
    times = np.stack([np.stack([np.broadcast_to(v, shape).reshape(-1)[ranges]
                                for v in costs._placed_times(cfg, b, zero, remat, placed)[:4]])
                      for zero, remat in choices], axis=1)  # (4, choices, ranges)
    step = m * (times[0] + times[1]) + times[2]
    totals = costs._choice_memory.totals(cfg, b, held, last, choices, ranges=True)
    cost = np.where(totals <= capacity, step, INF)
    least = cost.min(axis=0)
    pick = (cost == least).argmax(axis=0)
    ok = least < INF
    index = np.arange(len(ranges))
    size = shape[0] * shape[1]
    four = np.repeat(np.array([INF, INF, 0.0, 0.0])[:, None], size, axis=1)
    four[:, ranges] = np.where(ok, times[:, pick, index], np.array([INF, INF, 0.0, 0.0])[:, None])
    zeros, remats = choice_arrays(tuple(choices))
    memory, zero, remat = np.zeros(size), np.zeros(size, dtype=int), np.zeros(size, dtype=bool)
    memory[ranges] = np.where(ok, totals[pick, index], 0.0)
    zero[ranges] = np.where(ok, zeros[pick], 0)
    remat[ranges] = remats[pick] & ok
    forward, backward, tail, sync = four.reshape(4, *shape)
    return StageTable(forward, backward, remat.reshape(shape), memory.reshape(shape), tail, sync, capacity,
                      zero.reshape(shape), np.zeros(shape, dtype=int))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit: the same shape, type and bytes (-0.0 is not 0.0 here)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _measured(problem) -> tuple[MeasuredLayer, ...]:  # noqa: ANN001
    """Layer 0 measured on the first kind at every model axis, its forward and backward
    one program cheaper on a last stage: that stage's times then differ from the others'."""
    points = (LayerPoint(1, 0.010, 0.030, 0.045, 0.002, fused_s=0.035), LayerPoint(8, 0.04, 0.12, 0.18, 0.002, fused_s=0.15))
    return tuple(MeasuredLayer(problem.kinds[0].name, 0, tp, 1, points) for tp in (1, 2, 4, 8))


@pytest.mark.parametrize("checkpoints, measured", [(False, False), (True, False), (False, True)])
def test_device_tables_are_the_direct_ones_bit_for_bit(checkpoints, measured):
    compared = unfit = placed = 0
    for seed in range(8):
        problem = replace(random_problem(np.random.default_rng(seed)), allow_remat=True, offload_tiers=("",),
                          layer_checkpoints=checkpoints)
        if measured:
            problem = replace(problem, measured_layers=_measured(problem))
        costs = StageCosts(problem)
        for cfg, b in list(_stages(problem))[:8]:
            m = max(1, problem.batch_size // b)
            for held in (1, 2, 3, 7):
                for last in (False, True):
                    got = costs.table(cfg, b, held, last, m)
                    want = direct_table(costs, cfg, b, held, last, m)
                    for name in ("forward", "backward", "remat", "memory", "tail", "sync", "zero", "offload"):
                        assert _same(getattr(got, name), getattr(want, name)), (seed, cfg, b, held, last, name)
                    assert got.capacity == want.capacity
                    compared += 1
                    unfit += int(np.isinf(want.forward[np.triu_indices(costs.n + 1, 1)]).sum())
                    placed += last and bool(costs.measured(cfg, b / cfg.dp))
    assert compared > 200 and unfit > 0  # some ranges fit nowhere: the blank row was read
    assert placed > 10 if measured else not placed  # a last stage's own times compared


def test_first_least_is_the_first_equal_to_the_minimum():
    """`argmin` where no cost is NaN, `min` then `==` where one may be: the same row as
    the direct way's, ties to the first, row 0 (nothing fits) where all are INF or a NaN is."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        cost = rng.choice([0.0, -0.0, 1.0, 2.0, INF], size=(6, 40))
        cost[0] = INF
        direct = np.where((cost == cost.min(axis=0)).any(axis=0) & (cost.min(axis=0) < INF),
                          (cost == cost.min(axis=0)).argmax(axis=0), 0)
        assert np.array_equal(first_least(cost, nan=False), direct)
        assert np.array_equal(first_least(cost, nan=True), direct)
        cost[rng.integers(1, 6, 5), rng.integers(0, 40, 5)] = np.nan
        least = cost.min(axis=0)
        direct = np.where(least < INF, (cost == least).argmax(axis=0), 0)
        assert np.array_equal(first_least(cost, nan=True), direct)
