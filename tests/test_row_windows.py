"""`layer_split._Row` runs its paths on each stage's window of the tables (the ranges
some split can give it); its figures must equal the same paths over the whole tables
(the reference below, the code before the windows), cuts included."""

from __future__ import annotations

import numpy as np

from solver.cost.stage_costs import INF
from solver.cost.stage_tables import StageTable
from solver.planner.layer_split import _Row


def _table(rng: np.random.Generator, n: int) -> StageTable:
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    times = np.where(upper & (rng.random((n + 1, n + 1)) < 0.9), rng.random((n + 1, n + 1)), INF)
    tails = np.where(np.isfinite(times), rng.random((n + 1, n + 1)), 0.0)
    zeros = np.zeros((n + 1, n + 1))
    return StageTable(times, zeros, zeros.astype(bool), zeros, tails, zeros, 1)


def _whole_sum(times, tails, sends, n, t_max, u_max):  # noqa: ANN001, ANN202
    costs = [np.where((t <= t_max) & (u <= u_max), t, INF) for t, u in zip(times, tails)]
    best, back = costs[0][0].copy(), []
    for p in range(1, len(costs)):
        total = (best + 2 * np.where(sends[p - 1] <= t_max, sends[p - 1], INF))[:, None] + costs[p]
        arg = total.argmin(axis=0)
        best = total[arg, np.arange(total.shape[1])]
        back.append(arg)
    if best[n] == INF:
        return INF, ()
    cuts, j = [], n
    for arg in reversed(back):
        j = int(arg[j])
        cuts.append(j)
    return float(best[n]), tuple(reversed(cuts))


def _whole_max(times, tails, sends, n, t_max, of_tails):  # noqa: ANN001, ANN202
    masked = [np.where(t <= t_max, u if of_tails else t, INF) for t, u in zip(times, tails)]
    best = masked[0][0]
    for p in range(1, len(masked)):
        start = best if of_tails else np.maximum(best, sends[p - 1])
        best = np.maximum(np.where(sends[p - 1] <= t_max, start, INF)[:, None], masked[p]).min(axis=0)
    return float(best[n])


def test_windowed_paths_equal_the_whole_tables() -> None:
    rng = np.random.default_rng(7)
    for n, k in [(6, 1), (6, 2), (7, 3), (9, 4), (8, 8), (12, 5)]:
        for _ in range(5):
            tables = [_table(rng, n) for _ in range(k)]
            sends = [rng.random(n + 1) * 0.3 for _ in range(k - 1)]
            row = _Row(tables, sends)
            times, tails = [t.time for t in tables], [t.tail for t in tables]
            limits = np.array([0.5, 0.8, 1.2, 2.5])
            assert row.least_total() == _whole_sum(times, tails, sends, n, INF, INF)[0]
            assert row.least_sum() == _whole_sum(times, tails, sends, n, INF, INF)
            assert row.least_max() == _whole_max(times, tails, sends, n, INF, False)
            assert row.least_max(of_tails=True) == _whole_max(times, tails, sends, n, INF, True)
            assert row.least_work() == _whole_sum(times, tails, [np.zeros(n + 1)] * (k - 1), n, INF, INF)[0]  # (+ 0.0 is exact)
            for t_max in limits:
                for u_max in (0.3, 0.7, INF):
                    assert row.least_sum(t_max, u_max) == _whole_sum(times, tails, sends, n, t_max, u_max)
                assert row.least_max(t_max) == _whole_max(times, tails, sends, n, t_max, False)
                assert row.least_max(t_max, of_tails=True) == _whole_max(times, tails, sends, n, t_max, True)
            sums, lows = row.sums_and_tails(limits)
            assert sums.tolist() == [_whole_sum(times, tails, sends, n, t, INF)[0] for t in limits]
            assert lows.tolist() == [_whole_max(times, tails, sends, n, t, True) for t in limits]


def _whole_groups(times, tails, sends, n, v, rate, limit):  # noqa: ANN001, ANN202
    groups = len(times) // v
    best = np.zeros((groups, n + 1))
    for p, (t, u) in enumerate(zip(times, tails)):
        masked = np.where(t <= limit, t, INF)
        light = masked / v
        heavy = light + rate * masked + u
        g = p % groups
        if p == 0:
            best[:] = light[0]
            best[g] = heavy[0]
            continue
        start = best + 2 * np.where(sends[p - 1] <= limit, sends[p - 1], INF)
        own = (start[g][:, None] + heavy).min(axis=0)
        best = (start[:, :, None] + light[None]).min(axis=1)
        best[g] = own
    return best[:, n]


def _whole_memory(times, memories, sends, n, v, limit):  # noqa: ANN001, ANN202
    groups = len(times) // v
    best = np.zeros((groups, n + 1))
    for p, (t, held) in enumerate(zip(times, memories)):
        runs = t <= limit
        free, own = np.where(runs, 0.0, INF), np.where(runs, held, INF)
        g = p % groups
        if p == 0:
            best[:] = free[0]
            best[g] = own[0]
            continue
        start = best + np.where(sends[p - 1] <= limit, 0.0, INF)
        mine = (start[g][:, None] + own).min(axis=0)
        best = (start[:, :, None] + free[None]).min(axis=1)
        best[g] = mine
    return best[:, n]


def test_windowed_group_paths_equal_the_whole_tables() -> None:
    rng = np.random.default_rng(11)
    for n, k, v in [(6, 2, 2), (9, 4, 2), (12, 6, 3), (8, 8, 2), (16, 8, 4)]:
        for _ in range(5):
            tables = [_table(rng, n) for _ in range(k)]
            sends = [rng.random(n + 1) * 0.3 for _ in range(k - 1)]
            memories = [np.where(np.isfinite(t.time), rng.random((n + 1, n + 1)), 0.0) for t in tables]
            row = _Row(tables, sends)
            times, tails = [t.time for t in tables], [t.tail for t in tables]
            for limit in (0.6, 1.0, 3.0):
                got = row.group_paths(v, 7.5, limit)
                assert got.tolist() == _whole_groups(times, tails, sends, n, v, 7.5, limit).tolist()
                got = row.group_memory(memories, v, limit)
                assert got.tolist() == _whole_memory(times, memories, sends, n, v, limit).tolist()


def _growing_table(rng: np.random.Generator, n: int) -> StageTable:
    """A stage whose ranges take longer the more layers they hold (a fixed cost and a
    per-layer one, as real stages), so a bound admits only short ranges: the narrow
    bands `_Row.sums_and_tails` runs its middle stages on."""
    positions = np.arange(n + 1)
    length = positions[None, :] - positions[:, None]
    times = np.where(length > 0, rng.random() * 0.2 + (0.5 + rng.random() * 0.5) * length + rng.random((n + 1, n + 1)) * 0.1, INF)
    tails = np.where(np.isfinite(times), rng.random((n + 1, n + 1)), 0.0)
    zeros = np.zeros((n + 1, n + 1))
    return StageTable(times, zeros, zeros.astype(bool), zeros, tails, zeros, 1)


def test_banded_sums_and_tails_equal_the_whole_tables() -> None:
    rng, narrow = np.random.default_rng(13), 0
    for n, k in [(9, 3), (12, 4), (20, 6), (34, 8), (16, 16)]:
        for _ in range(5):
            tables = [_growing_table(rng, n) for _ in range(k)]
            sends = [rng.random(n + 1) * 0.3 for _ in range(k - 1)]
            row = _Row(tables, sends)
            times, tails = [t.time for t in tables], [t.tail for t in tables]
            limits = np.sort(row.least_max() * rng.uniform(0.8, 1.6, 6))  # (around the least bottleneck, as the sweep's)
            sums, lows = row.sums_and_tails(limits)
            assert sums.tolist() == [_whole_sum(times, tails, sends, n, t, INF)[0] for t in limits]
            assert lows.tolist() == [_whole_max(times, tails, sends, n, t, True) for t in limits]
            narrow += row._reach(float(limits[-1])) < row.width
    assert narrow > 10  # (most rows here run on bands narrower than their windows)
