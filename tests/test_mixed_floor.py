"""The floor that refuses mixed-stage candidates before their tables are built
(solver/planner/mixed_floor.py): it must never exceed what `_resplit` would find, so
the planner's answers are the same with it as without."""

from __future__ import annotations

import math

import numpy as np
import pytest

from solver.collectives import LinkCost
from solver.cost.problem import DeviceKind, LayerCost, Problem
from solver.planner import Planner, PlanningError
from solver.planner import mixed as planner_mixed
from solver.planner import mixed_floor
from solver.planner.mixed_floor import least_floor
from test_planner import random_problem


def _idle(link_bandwidth: float, layers: int = 4) -> Problem:
    """Fast devices that hold the model alone, slower ones left idle: candidates with
    idle devices joined to a stage, and merged stages where the search mixes kinds."""
    costs = tuple(LayerCost(flops=1e12 * (1 + i % 3), forward_flops=1e12 / 3, param_bytes=2**22 * (1 + i % 2),
                            saved_bytes=2**20, input_bytes=2**18) for i in range(layers))
    kind = lambda name, n, flops, mem: DeviceKind(name, n, n, flops, mem, 1e12, LinkCost(1e11, 5e-6), LinkCost(1e10, 1e-5))  # noqa: E731
    kinds = (kind("fast", 4, 8e12, 16 * 2**30), kind("slow", 2, 2e12, 2**31), kind("slower", 2, 1e12, 16 * 2**30))
    links = tuple((a.name, b.name, LinkCost(link_bandwidth, 2e-5)) for i, a in enumerate(kinds) for b in kinds[i + 1:])
    return Problem(costs, kinds, batch_size=32, links=links, allow_replicas=False, schedules=("1f1b", "gpipe"))


def _problems() -> list[Problem]:
    out = [_idle(2e10), _idle(1e5), _idle(2e10, layers=7)]
    for seed in range(16):
        rng = np.random.default_rng(seed)
        out.append(random_problem(rng, kinds=int(rng.integers(2, 4)), allow_replicas=False))
    return out


def _answer(problem: Problem, top_k: int = 5):  # noqa: ANN202
    try:
        result = Planner(problem, top_k=top_k).solve()
    except PlanningError as e:
        return str(e)
    plans = (result.best, *result.alternatives)
    return [(c.describe(), c.step_s, c.mixed) for c in plans], result.upper_bound, result.per_kind


def test_the_floor_is_below_every_split_resplit_finds(monkeypatch):
    """Every candidate `best_mixed` builds: the floor is at most the least of both its
    own split's and `_resplit`'s split's busiest positions."""
    resplit = planner_mixed._resplit
    seen = []

    def checked(problem, choice, costs, memo=None):  # noqa: ANN001, ANN202
        out = resplit(problem, choice, costs, memo)
        floor = least_floor(problem, choice, costs)
        if out is not None:
            assert floor <= min(out[1], out[2]), (choice.describe(), floor, out[1:])
            seen.append(floor)
        return out

    monkeypatch.setattr(planner_mixed, "_resplit", checked)
    monkeypatch.setattr(planner_mixed, "refused", lambda *a, **k: False)  # every candidate reaches `_resplit`
    for problem in _problems():
        _answer(problem)
    assert len(seen) > 20
    assert any(f > 0 for f in seen)


def test_the_tables_floors_are_below_every_split_resplit_finds(monkeypatch):
    """The floor with mixed positions' own least (their tables, memory in), and with
    every position's at its stage's fewest microbatches in flight: at most the least
    of both splits `_resplit` prices, wherever it finds one."""
    resplit = planner_mixed._resplit
    seen = []

    def checked(problem, choice, costs, memo=None):  # noqa: ANN001, ANN202
        out = resplit(problem, choice, costs, memo)
        floor = planner_mixed.tables_floor(problem, choice, costs)
        alone = planner_mixed.tables_floor(problem, choice, costs, alone=True)
        if out is not None:
            assert least_floor(problem, choice, costs) <= floor <= alone <= min(out[1], out[2]), (choice.describe(), floor, alone, out[1:])
            seen.append((floor > least_floor(problem, choice, costs), alone > floor))
        return out

    monkeypatch.setattr(planner_mixed, "_resplit", checked)
    monkeypatch.setattr(planner_mixed, "refused", lambda *a, **k: False)
    monkeypatch.setattr(planner_mixed, "_refused_by_tables", lambda *a, **k: False)
    for problem in _problems():
        _answer(problem)
    assert len(seen) > 20
    assert any(parts for parts, _ in seen) and any(alone for _, alone in seen)  # memory raises both somewhere


def test_the_planner_answers_the_same_without_the_floor(monkeypatch):
    problems = _problems()
    with_floor = [_answer(p) for p in problems]
    monkeypatch.setattr(planner_mixed, "refused", lambda *a, **k: False)
    monkeypatch.setattr(planner_mixed, "_refused_by_tables", lambda *a, **k: False)
    without = [_answer(p) for p in problems]
    assert with_floor == without
    assert any(mixed for answer in with_floor if isinstance(answer, tuple) for _, _, mixed in answer[0])


def test_the_floor_refuses_candidates(monkeypatch):
    """It is not vacuous: some candidates never reach `_resplit`, refused by the floor
    or by the parts' floor after it."""
    calls = {"resplit": 0, "refused": 0, "considered": 0, "parts": 0}
    resplit, refused, by_parts = planner_mixed._resplit, planner_mixed.refused, planner_mixed._refused_by_tables

    def counted_resplit(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["resplit"] += 1
        return resplit(*a, **k)

    def counted_refused(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["considered"] += 1
        out = refused(*a, **k)
        calls["refused"] += out
        return out

    def counted_by_parts(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = by_parts(*a, **k)
        calls["parts"] += out
        return out

    monkeypatch.setattr(planner_mixed, "_resplit", counted_resplit)
    monkeypatch.setattr(planner_mixed, "refused", counted_refused)
    monkeypatch.setattr(planner_mixed, "_refused_by_tables", counted_by_parts)
    for problem in _problems():
        _answer(problem)
    assert calls["refused"] > 0 and calls["parts"] > 0 and calls["resplit"] > 0
    assert calls["resplit"] == calls["considered"] - calls["refused"] - calls["parts"]


def test_the_plans_read_are_the_same_where_variants_are_looked_for_below_them_alone(monkeypatch):
    """`with_mixed_stages` looks for a finalist's variant only below the last plan its
    caller reads (`read`): the plans read are those of a widening that reads them all."""
    from solver.planner import search as planner_search

    widen, best_mixed = planner_mixed.with_mixed_stages, planner_mixed.best_mixed
    below = []

    def counted(problem, choice, costs, memo=None, beat=math.inf):  # noqa: ANN001, ANN202
        below.append(beat < choice.step_s)
        return best_mixed(problem, choice, costs, memo, beat)

    monkeypatch.setattr(planner_mixed, "best_mixed", counted)
    problems = _problems()
    read = [_answer(p, k) for p in problems for k in (1, 2)]
    assert any(below)
    monkeypatch.setattr(planner_search, "with_mixed_stages", lambda problem, found, costs, read=None: widen(problem, found, costs))
    assert read == [_answer(p, k) for p in problems for k in (1, 2)]


@pytest.mark.parametrize("bandwidth", [2e10, 1e5])
def test_a_mixed_stage_is_still_chosen_where_it_wins(bandwidth):
    best = Planner(_idle(bandwidth), top_k=1).solve().best
    assert best.mixed == (bandwidth > 1e9)


def test_floors_that_keep_failing_stop_being_taken(monkeypatch):
    """After `TRIAL` floors of a widening none of which refused, no more are taken (and
    the answer is the same: a floor not taken only leaves a candidate to its tables)."""
    taken = []
    monkeypatch.setattr(mixed_floor, "least_floor", lambda *a, **k: taken.append(1) or -math.inf)
    memo: dict = {}
    for _ in range(3 * mixed_floor.TRIAL):
        assert not mixed_floor.refused(None, None, None, memo, 1.0)
    assert len(taken) == mixed_floor.TRIAL
    monkeypatch.setattr(mixed_floor, "least_floor", lambda *a, **k: taken.append(1) or math.inf)
    memo = {}
    for _ in range(3 * mixed_floor.TRIAL):
        assert mixed_floor.refused(None, None, None, memo, 1.0)
    assert len(taken) == 4 * mixed_floor.TRIAL  # floors that refuse keep being taken


def _scanned_part(costs, cfg, rows, m, held, last, remat):  # noqa: ANN001, ANN202
    """`mixed._part` as it was: a scan over the ZeRO stages keeping strict improvements."""
    shape = (costs.n + 1, costs.n + 1)
    cost, fb, tail, zeros = np.full(shape, math.inf), np.full(shape, math.inf), np.zeros(shape), np.zeros(shape, dtype=int)
    choices = [(zero, remat) for zero in costs.zero_stages(cfg)]
    memory = costs._choice_memory.totals(cfg, rows, held, last, choices)
    for (zero, _), total in zip(choices, memory):
        forward, backward, t, _, _ = costs._placed_times(cfg, rows, zero, remat, last)
        f_b, t = np.broadcast_to(forward + backward, shape), np.broadcast_to(t, shape)
        c = np.where(total <= costs.capacity(cfg.kind), m * f_b + t, math.inf)
        take = c < cost
        cost, fb, tail, zeros = np.where(take, c, cost), np.where(take, f_b, fb), np.where(take, t, tail), np.where(take, zero, zeros)
    return cost, fb, tail, zeros


def _configs(problem: Problem) -> list:  # noqa: ANN202
    from solver.cost.stage_costs import StageConfig
    return [StageConfig(k.name, k.count // tp, tp) for k in problem.kinds for tp in (1, 2) if k.count % tp == 0]


def test_the_floors_figures_are_the_old_sums_bit_for_bit():
    """A lone stage's least step (`_least_step`) is the least of `_table_times`' step
    costs, and a part's stacked figures (`part_steps`) give `_part` the old scan's
    picks, floats equal, whether they fit or not."""
    from solver.cost.stage_costs import StageCosts
    checked = 0
    for problem in _problems()[:8]:
        costs = StageCosts(problem)
        for cfg in _configs(problem):
            for b, m, last in ((cfg.dp, 4, False), (2 * cfg.dp, 2, True), (4 * cfg.dp, 8, True)):
                old = costs._table_times(cfg, b, m, last)[2].min(axis=0)
                assert np.array_equal(mixed_floor._least_step(costs, cfg, b, m, last), old)
                for remat in ("", "full"):
                    for held in (1, 3):
                        new = planner_mixed._part(costs, cfg, b, m, held, last, remat, {})
                        want = _scanned_part(costs, cfg, b, m, held, last, remat)
                        assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(new, want))
                        checked += 1
    assert checked > 100
