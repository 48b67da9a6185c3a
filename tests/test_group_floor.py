"""The interleaved refusal on one device group's own cost (`_Row.group_paths`, refused
on in `best_split` by `_every_group_loses`) must never refuse a beat some split of the
row beats (brute force over every split on the random small problems of test_planner),
each group's path must lie below every split within its limit, and the refusal must
bite where the shared work's floors do not (a device group that holds a heavy layer).
Likewise before the tables: `LowerBounds.interleaved_floor`'s pace of the last group,
whose last stage holds the model's last layers (a language model's head). And the
refusals on the groups' shared memory: `chunk_memory.chunks_may_fit` (no split fits) and
`_fitting_may_win` (no split that fits is fast enough), against every split."""

from __future__ import annotations

import numpy as np
import pytest

from solver.cost.stage_costs import INF, StageCosts, in_flight
from solver.cost.stage_tables import StageTable
from solver.planner.layer_split import _every_bottleneck_loses, _every_group_loses, _Row, best_split, score
from test_planner import compositions, every_row, interleaved_rows, random_problem
from test_pace_floor import _pace


def _random_rows(seeds, base: int):  # noqa: ANN001
    """`interleaved_rows` of two and three chunks of each seeded random problem, with its stage costs."""
    for seed in seeds:
        rng = np.random.default_rng(base + seed)
        problem = random_problem(rng, kinds=int(rng.integers(1, 4)))
        costs = StageCosts(problem)
        for row in interleaved_rows(problem, costs, (2, 3)):
            yield (costs, *row)


def _group_cost(tables, sends, cuts, chunks: int, rate: float, group: int) -> float:  # noqa: ANN001
    """`group_paths`' additive cost of one split for one group, summed as written."""
    groups = len(tables) // chunks
    bounds = list(zip([0, *cuts], [*cuts, tables[0].time.shape[0] - 1]))
    total = sum(2 * float(s[c]) for s, c in zip(sends, cuts))
    for p, (t, (i, j)) in enumerate(zip(tables, bounds)):
        total += float(t.time[i, j]) / chunks
        if p % groups == group:
            total += rate * float(t.time[i, j]) + float(t.tail[i, j])
    return total


@pytest.mark.parametrize("seeds", [range(0, 12), range(12, 24)])
def test_the_group_refusal_never_refuses_a_beat_some_split_beats(seeds):
    checked = refused = 0
    for costs, m, b, order, layouts, groups, chunks, configs, tables, sends in _random_rows(seeds, 700):
        splits = list(compositions(costs.n, len(configs)))
        steps = np.array([score(tables, sends, m, cuts, "interleaved", chunks) for cuts in splits])
        if not (steps < INF).any():
            continue
        row = _Row(tables, sends)
        rate = m - 1 / chunks
        # each group's path lies below every split whose paces (hence times and sends) stay within its limit
        paces = np.array([_pace(tables, sends, cuts, chunks) for cuts in splits])
        for limit in (INF, float(np.median(paces[paces < INF]))):
            paths = row.group_paths(chunks, rate, limit)
            for g, path in enumerate(paths):
                least = min((_group_cost(tables, sends, cuts, chunks, rate, g)
                             for cuts, pace in zip(splits, paces) if pace <= limit), default=INF)
                assert path <= least * (1 + 1e-12), (order, layouts, m, chunks, limit, g, path, least)
        # the refusal: never at a beat the best split beats, and at beats it loses to, sometimes
        best = float(steps.min())
        sum0, u_floor = row.least_total(), row.least_max(of_tails=True)
        for beat in (best * 1.000001, best * 1.01, best * 1.3, best * 0.999, best * 0.9):
            says = _every_group_loses(row, m, chunks, sum0, u_floor, beat)
            assert not (says and best < beat), (order, layouts, m, chunks, beat, best)
            refused += says
        checked += 1
    assert checked >= 10, checked
    assert refused >= 5, refused  # it refuses some of the beats no split wins


def test_the_group_refusal_sees_a_heavy_group_the_work_floors_miss():
    """Two device groups, two chunks each, over eight layers whose last (a language
    model's head) costs 20 of the others: the last stage's group paces every split
    at 20 at least, which the work shared evenly (about 13.5 per group) and the
    slowest single stage's bound do not see."""
    n, chunks, m = 8, 2, 8
    per_layer = np.array([1.0] * (n - 1) + [20.0])
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
    times = np.where(upper, prefix[None, :] - prefix[:, None], INF)
    zeros = np.zeros((n + 1, n + 1))
    tables = [StageTable(times, zeros, zeros.astype(bool), zeros, zeros, zeros, 1) for _ in range(4)]
    sends = [np.zeros(n + 1)] * 3
    splits = list(compositions(n, 4))
    best = min(score(tables, sends, m, cuts, "interleaved", chunks) for cuts in splits)
    beat = best * 0.97  # no split wins
    row = _Row(tables, sends)
    sum0, u_floor = row.least_total(), row.least_max(of_tails=True)
    pace_lo = max(row.least_max(), row.least_work() * chunks / 4, row.pace_floor(chunks))
    assert sum0 / chunks + (m - 1 / chunks) * pace_lo < beat  # best_split's work and pace floors let it through
    assert not _every_bottleneck_loses(row, m, chunks, pace_lo, sum0, u_floor, beat)
    assert _every_group_loses(row, m, chunks, sum0, u_floor, beat)
    assert best_split(tables, sends, m, beat, "interleaved", chunks) is None
    assert best_split(tables, sends, m, best * 1.01, "interleaved", chunks) is not None


def test_the_interleaved_floor_counts_the_head_on_the_last_group():
    """`LowerBounds.interleaved_floor` charges the last device group its last stage's
    least run that ends the model (a language model's head): with a head 30x the
    other layers it rises above what its shared-work terms give, and stays below
    every split's interleaved step (brute force)."""
    from solver.planner.runs import balanced_pace

    raised = checked = 0
    for m, b, order, layouts, groups, costs, bounds in _heavy_head_rows():
        chunks = 2
        configs = groups * chunks
        if len(configs) > costs.n or len(groups) < 2:
            continue
        floor = bounds.interleaved_floor(layouts, m, b, chunks)
        tables = [costs.table(c, b, in_flight("interleaved", m, p, len(configs), chunks), p == len(configs) - 1, m)
                  for p, c in enumerate(configs)]
        sends = [costs.sends(a, c, b) for a, c in zip(configs, configs[1:])]
        best = min(score(tables, sends, m, cuts, "interleaved", chunks) for cuts in compositions(costs.n, len(configs)))
        assert floor <= best * (1 + 1e-12), (order, layouts, m, floor, best)
        paces = [bounds._least_pace(c, b) for c in groups]
        least = np.array([p[0] for p in paces])
        shared = max(chunks * float(least.max()), balanced_pace(costs.n, np.array([p[1] for p in paces])))
        head = paces[-1][2] + (chunks - 1) * float(least[-1])
        assert floor >= (m - 1 / chunks) * head * (1 - 1e-9)
        raised += head > shared * 1.05
        checked += best < INF
    assert checked >= 10 and raised >= 5, (checked, raised)


def _heavy_head_rows():  # noqa: ANN202
    """Rows of random problems of two kinds whose last layer costs 30x its FLOPs."""
    import dataclasses

    from solver.planner.search import Planner

    for seed in range(30):
        rng = np.random.default_rng(300 + seed)
        problem = random_problem(rng, kinds=2)
        if len(problem.layers) < 4:
            continue
        layers = list(problem.layers)
        layers[-1] = dataclasses.replace(layers[-1], flops=layers[-1].flops * 30, forward_flops=layers[-1].forward_flops * 30)
        problem = dataclasses.replace(problem, layers=tuple(layers))
        planner = Planner(problem)
        for row in every_row(problem):
            yield (*row, planner.costs, planner.bounds)


@pytest.mark.parametrize("seeds", [range(0, 15), range(15, 30)])
def test_a_row_refused_for_memory_has_no_split_that_fits(seeds):
    """`chunk_memory.chunks_may_fit` (the first chunk's ranges from the first layer, the
    last's to the last) refuses only rows where no split's chunks share their device
    groups' memory (`chunks_fit`, brute force over every split that runs), and does
    refuse some rows of these random problems."""
    from solver.planner.chunk_memory import chunks_fit, chunks_may_fit

    checked = refused = jointly = 0
    for costs, m, b, order, layouts, groups, chunks, configs, tables, sends in _random_rows(seeds, 500):
        fitting = [cuts for cuts in compositions(costs.n, len(configs))
                   if score(tables, sends, m, cuts, "interleaved", chunks) < INF
                   and chunks_fit(tables, cuts, len(groups))]
        may = chunks_may_fit(tables, len(groups))
        assert may or not fitting, (order, layouts, m, chunks, fitting[:3])
        checked += 1
        refused += not may
        jointly += not may and _each_chunk_alone_fits(tables, len(groups))
    assert checked >= 20 and refused >= 1 and jointly >= 1, (checked, refused, jointly)


def _each_chunk_alone_fits(tables, groups: int) -> bool:  # noqa: ANN001
    """Whether each group's chunks, each at the least bytes of any range at its place
    (the first from the first layer, the last to the last), fit its memory: what
    `chunks_may_fit` checked before it counted the layers the groups hold together."""
    used = [0.0] * groups
    for p, t in enumerate(tables):
        held = t.memory[0] if p == 0 else t.memory[:, -1] if p == len(tables) - 1 else t.memory
        runs = np.isfinite(t.forward[0] if p == 0 else t.forward[:, -1] if p == len(tables) - 1 else t.forward)
        if not runs.any():
            return False
        used[p % groups] += float(held[runs].min())
    return all(u <= tables[g].capacity for g, u in enumerate(used))


@pytest.mark.parametrize("seeds", [range(0, 15), range(15, 30)])
def test_the_fitting_refusal_never_refuses_a_beat_a_fitting_split_beats(seeds):
    """`_Row.group_memory` lies below every split's groups' summed memory among the
    splits within its limit, and `_fitting_may_win` (best_split's `shared` refusal)
    says no only where no split that fits its groups' memory beats the beat."""
    from solver.planner.layer_split import _fitting_may_win
    from solver.planner.chunk_memory import chunks_fit

    checked = refused = 0
    for costs, m, b, order, layouts, groups, chunks, configs, tables, sends in _random_rows(seeds, 500):
        splits = [cuts for cuts in compositions(costs.n, len(configs))
                  if score(tables, sends, m, cuts, "interleaved", chunks) < INF]
        if not splits:
            continue
        row = _Row(tables, sends)
        memories = [t.memory for t in tables]
        paces = [_pace(tables, sends, cuts, chunks) for cuts in splits]
        for limit in (INF, float(np.median(paces))):
            least = row.group_memory(memories, chunks, limit)
            for g in range(len(groups)):
                held = [sum(float(t.memory[i, j]) for p, (t, (i, j)) in enumerate(zip(tables, zip([0, *cuts], [*cuts, costs.n])))
                            if p % len(groups) == g) for cuts, pace in zip(splits, paces) if pace <= limit]
                assert least[g] <= min(held, default=INF), (order, layouts, m, chunks, limit, g)
        fitting = [score(tables, sends, m, cuts, "interleaved", chunks) for cuts in splits
                   if chunks_fit(tables, cuts, len(groups))]
        best = min(fitting, default=INF)
        every = min(score(tables, sends, m, cuts, "interleaved", chunks) for cuts in splits)
        sum0, u_floor = row.least_total(), row.least_max(of_tails=True)
        for beat in (best * 1.000001, best * 1.01, best * 0.99, every * 1.01, every * 1.3):
            if beat == INF:
                continue
            may = _fitting_may_win(row, tables, m, chunks, sum0, u_floor, beat)
            assert may or not best < beat, (order, layouts, m, chunks, beat, best)
            refused += not may
        checked += 1
    assert checked >= 20 and refused >= 1, (checked, refused)
