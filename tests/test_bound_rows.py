"""The bounds' array passes over many layouts (`solver.planner.rows`) give, row by
row, exactly what their one-row counterparts give: the search compares these figures,
so a reordered sum or a count off by one would change which plans it prunes."""

import numpy as np

from solver.cost.ranges import cumsum, span
from solver.planner.rows import (counts_within, layers_fitting, least_for_counts, least_runs_rows, least_steps, most_within,
                                 nondecreasing_rows, run_spans, stage_runs)
from solver.planner.runs import FITS_TOL, first_enough, least_runs, longest

INF = float("inf")


# The figures by their definitions, one row at a time: what each array pass must give.
def nondecreasing(runs):
    return np.array([runs[i:].min() for i in range(len(runs))])


def least_runs_of(values):
    n = values.shape[0] - 1
    return np.array([min(values[i, i + k] for i in range(n + 1 - k)) for k in range(1, n + 1)])


def least_step(runs):
    return 0.0 if len(runs) < 2 else float(max(((runs[1:] - runs[0]) / np.arange(1, len(runs))).min(), 0.0))


def longest_of(runs, limits):
    floor = nondecreasing(runs)
    return np.array([int((floor <= t * FITS_TOL).sum()) for t in limits])


def _rows(rng, count, n):
    rows = rng.random((count, n)) * 3
    rows[0, -3:] = INF  # a row that cannot run the longest runs
    rows[1, 2] = rows[1, 3]  # ties
    return rows


def test_nondecreasing_counts_and_longest_match_each_row():
    rng = np.random.default_rng(0)
    rows = _rows(rng, 6, 12)
    limits = np.unique(np.concatenate([rows.ravel()[np.isfinite(rows.ravel())], [0.0, INF]]))
    assert np.array_equal(nondecreasing_rows(rows), np.array([nondecreasing(r) for r in rows]))
    expected = np.array([longest_of(r, limits) for r in rows])
    assert np.array_equal(expected, [longest(r, limits) for r in rows])  # runs.py's one-row form
    assert np.array_equal(most_within(rows, limits, FITS_TOL), expected)
    floors = nondecreasing_rows(rows)
    assert np.array_equal(counts_within(floors, limits), np.array([np.searchsorted(r, limits, side="right") for r in floors]))
    assert expected[0, -1] == 12 and expected[0, 0] == 0  # INF only within the INF limit; nothing within 0


def test_counts_within_a_long_grid_are_the_searches_of_each_row():
    rng = np.random.default_rng(5)
    rows = nondecreasing_rows(_rows(rng, 9, 30))
    limits = np.sort(np.concatenate([rng.random(3000) * 3, rows[2, :10], [INF]]))  # past `_SHORT`, with ties
    expected = np.array([np.searchsorted(r, limits, side="right") for r in rows])
    assert len(limits) > 512 and np.array_equal(counts_within(rows, limits), expected)
    assert np.array_equal(counts_within(rows, limits[:400]), expected[:, :400])  # the short grid's way
    scale = rng.integers(1, 40, len(rows)).astype(float)  # a kind's stages per layout (`LowerBounds._kind_arrays`)
    for grid in (limits, limits[:400]):
        scaled = counts_within(rows, grid, scale)
        assert scaled.dtype == float and np.array_equal(scaled, scale[:, None] * counts_within(rows, grid))


def test_least_for_counts_is_the_envelope_of_the_layouts():
    rng = np.random.default_rng(1)
    least = nondecreasing_rows(_rows(rng, 4, 10))
    counts = np.array([1.0, 2.0, 3.0, 5.0])
    r = np.arange(1, 11)
    expected = np.min([row[(r + s - 1) // s - 1] for s, row in zip(counts.astype(int), least)], axis=0)
    assert np.array_equal(least_for_counts(counts, least, 10), expected)


def test_stage_runs_match_the_one_stage_sums_bit_for_bit():
    rng = np.random.default_rng(2)
    n = 9
    forward, backward = rng.random((3, n)) * 1e-3, rng.random((3, n)) * 2e-3
    fused = [forward[0] + backward[0] - 1e-4, None, (forward[2] + backward[2]) * 1.5]
    runs = stage_runs(forward, backward, fused)
    both_rows, rerun_rows = run_spans(forward, backward, fused)
    for i in range(3):
        f, bw = span(cumsum(forward[i])), span(cumsum(backward[i]))
        both = f + bw if fused[i] is None else np.minimum(f + bw, span(cumsum(fused[i])))
        rerun = f + (bw + f)
        assert np.array_equal(both_rows[i], both) and np.array_equal(rerun_rows[i], rerun)
        r = runs[i]
        assert np.array_equal(r.time, least_runs_of(both)) and np.array_equal(r.remat, least_runs_of(rerun))
        assert r.step == least_step(least_runs_of(both)) and r.step_remat == least_step(least_runs_of(rerun))
        ends = np.arange(n - 1, -1, -1)
        assert np.array_equal(r.last, both[ends, n]) and np.array_equal(r.last_remat, rerun[ends, n])
        assert np.array_equal(r.floor, nondecreasing(r.time)) and np.array_equal(r.floor_remat, nondecreasing(r.remat))
        assert r.final.step == least_step(r.last) and r.final.step_remat == least_step(r.last_remat)
        assert np.array_equal(r.last_floor, nondecreasing(r.last)) and np.array_equal(r.last_floor_remat, nondecreasing(r.last_remat))
    assert np.array_equal(least_runs_rows(np.stack([both_rows[1]])), least_runs_of(both_rows[1])[None])
    assert np.array_equal(least_runs(both_rows[1]), least_runs_of(both_rows[1]))  # runs.py's one-row form
    assert least_steps(np.zeros((2, 1))) == [0.0, 0.0]


def test_least_runs_rows_read_in_place_are_each_rows_diagonals():
    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 17):
        values = rng.random((4, n + 1, n + 1))
        expected = np.array([least_runs_of(v) for v in values])
        assert np.array_equal(least_runs_rows(values), expected)
        assert np.array_equal(least_runs_rows(values[::2]), expected[::2])  # a strided view, made contiguous first
        assert np.array_equal(least_runs_rows(np.swapaxes(values, 1, 2).copy().swapaxes(1, 2)), expected)


def test_layers_fitting_matches_the_one_stage_count():
    rng = np.random.default_rng(3)
    n = 8
    state = rng.random((3, n)) * 1e9
    saved, inputs, recomputed = rng.random(n) * 1e8, rng.random(n) * 1e7, rng.random(n) * 5e7
    shard, capacity, held = np.array([1.0, 4.0, 0.5]), [int(3e9), int(2e9), int(1e9)], np.arange(1, 40)

    def most(room, per_layer):
        return int(min(max(room, 0.0) // max(float(per_layer.min()), 1.0), n))

    expected = [[(most(c, state[i] + (saved * shard[i]) * h),
                  most(c - float((inputs * shard[i]).min()) * int(h), state[i] + recomputed * shard[i])) for h in held]
                for i, c in enumerate(capacity)]
    fits = layers_fitting(capacity, state, saved, inputs, recomputed, shard, held, True, True)
    assert [[tuple(f) for f in row] for row in fits.tolist()] == expected
    assert not layers_fitting(capacity, state, saved, inputs, recomputed, shard, held, False, False).any()
    counts = {a for row in expected for a, _ in row} | {r for row in expected for _, r in row}
    assert len(counts & set(range(1, n))) > 2  # the capacities bind at several counts: the test can fail


def test_first_enough_is_the_first_grid_position_each_combination_holds_every_layer():
    rng = np.random.default_rng(4)
    size, layers = 50, 18
    rooms = [np.sort(rng.integers(0, 9, (4, size)), axis=1), np.sort(rng.integers(0, 12, (3, size)), axis=1)]
    rooms[0][0] = np.minimum(rooms[0][0], 4)  # with any of the others' rows, never 18
    index = np.indices([4, 3]).reshape(2, -1)
    totals = rooms[0][index[0]] + rooms[1][index[1]]
    expected = np.where((totals >= layers).any(axis=1), (totals >= layers).argmax(axis=1), size)
    assert np.array_equal(first_enough(rooms, index, size, layers), expected)
    assert 0 < (expected < size).sum() < len(expected)  # some combinations hold every layer, some never do


def test_first_enough_matches_a_scan_at_every_grid_size():
    rng = np.random.default_rng(6)
    for size in (1, 2, 3, 7, 8, 9, 63, 64, 65, 300):
        rooms = [np.sort(rng.integers(0, 7, (5, size)), axis=1) for _ in range(3)]
        index = np.indices([5, 5, 5]).reshape(3, -1)
        totals = sum(r[i] for r, i in zip(rooms, index))
        layers = int(np.median(totals[:, -1]))
        expected = np.where((totals >= layers).any(axis=1), (totals >= layers).argmax(axis=1), size)
        assert np.array_equal(first_enough(rooms, index, size, layers), expected)
        assert np.array_equal(first_enough(rooms, index, size, 0), np.zeros(index.shape[1]))  # the first position holds 0
    assert first_enough([np.zeros((2, 0))], np.array([[0, 1]]), 0, 3).tolist() == [0, 0]  # an empty grid
