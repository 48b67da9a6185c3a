"""`bottleneck.least_steps` takes each row's candidate bottlenecks from its own stages'
thresholds (where a stage gains room for one more layer), counts each stage's rooms
at each by position in their sorted order, and stops a row a block at a time once no
later candidate can win: every figure must be the one a plain scan gives, that scan
counting each stage's thresholds within every distinct threshold of the row, with no
block and no early stop, on rows of up to 18 stages, with each kind of row: a set's
(`placed` False), an order's priced by place (`last`), and one with 1F1B's round
trips. Thresholds tie (a stage's floors flat, or equal across stages, some runs longer
than a block), some rows run past one block, and some rows fit nowhere. Within
rounding only: where thresholds tie, counting by position also prices the rooms part
way through the tie, fewer for some stage; that is a sum no less than the scan's in
exact arithmetic, but stages of one layout share a rate, and moving a layer between
them can round the sum an ulp either way. (Counting by value is bit for bit the scan,
and 25-30% slower a call.)"""

import numpy as np
import pytest

from solver.planner.bottleneck import LayoutRows, _middle_floor, _unplaced, least_steps, least_sums, places
from solver.planner.runs import FITS_TOL
from solver.schedules.one_f_one_b import round_trip_pace

INF = float("inf")


def scanned(table, at, n, nr, m, layers, offsets, beat, last=False, trips=None, placed=None):
    """The least (m - 1) t + summed stage times over every distinct threshold of each
    row, a row at a time, with no block and no early stop."""
    out = np.full(len(at), INF)
    q = np.arange(layers)
    for r in range(len(at)):
        ids, cap, capr = at[r : r + 1], n[r : r + 1].astype(np.int64), nr[r : r + 1].astype(np.int64)
        plain = cap >= 1
        middle = 0.0
        if placed is False:
            base, inner = _unplaced(table.by_place, ids, plain, cap, capr)
            middle = 0.0 if inner is None else inner[0]
            rates = np.where(plain, table.rates[ids], table.rates_remat[ids])
        elif last:
            place, figures = places(ids.shape[1]), table.by_place
            base = np.where(plain, figures[0][place, ids], figures[1][place, ids]).sum(axis=1)
            rates = np.where(plain, figures[2][place, ids], figures[3][place, ids])
            if ids.shape[1] > 2:
                middle = _middle_floor(figures, ids[:, 1:-1], cap[:, 1:-1], capr[:, 1:-1]).max(axis=1)[0]
        else:
            base = np.where(plain, table.firsts[ids], table.firsts_remat[ids]).sum(axis=1)
            rates = np.where(plain, table.rates[ids], table.rates_remat[ids])
        thresholds = np.minimum(np.where(q < cap[0][:, None], table.floors[ids[0]], INF),
                                np.where(q < capr[0][:, None], table.floors_remat[ids[0]], INF))
        if last:
            end = ids[0, -1]
            thresholds[-1] = np.maximum(thresholds[-1], np.minimum(np.where(q < cap[0, -1], table.last_floors[end], INF),
                                                                   np.where(q < capr[0, -1], table.last_floors_remat[end], INF)))
        by_rate = np.argsort(rates[0], kind="stable")
        best, fitted = beat - offsets[r], False
        for c in np.unique(thresholds[np.isfinite(thresholds)]):
            rooms = (thresholds <= c).sum(axis=1)
            if rooms.sum() < layers or rooms.min() < 1:
                continue
            fitted = True
            sums = least_sums(rooms[by_rate][None, None, :], layers - len(rooms), base, rates[0][by_rate][None, :])[0, 0]
            t = max(c, middle) / FITS_TOL
            if t == INF:
                continue
            pace = t if trips is None else max(t, round_trip_pace(sums + trips[r], len(rooms), m))
            best = min(best, (m - 1) * pace + sums)
        out[r] = best + offsets[r] if fitted else INF
    return out


def random_table(rng, layouts, layers):
    def floors():
        values = np.cumsum(rng.random((layouts, layers)), axis=1) / 3
        values[rng.random((layouts, layers)) < 0.1] = INF  # (runs no stage holds: a nondecreasing row stays so)
        if rng.random() < 0.3:  # ties, within a stage and across stages, some runs of more than a block
            values = np.floor(values / rng.choice([1, 8]))
        return np.minimum.accumulate(values[:, ::-1], axis=1)[:, ::-1] if rng.random() < 0.5 else np.sort(values, axis=1)

    return LayoutRows(floors(), floors(), floors(), floors(), rng.random(layouts), rng.random(layouts) * 2,
                      rng.random(layouts) / 7, rng.random(layouts) / 5, rng.random((6, 3, layouts)),
                      np.zeros((layouts, layers, 2)), np.zeros((layouts, 2)), np.ones(layouts), np.zeros((layouts, layouts)),
                      [], {})


def random_case(rng):
    layouts, layers = int(rng.integers(1, 6)), int(rng.integers(4, 60))
    stages, rows = int(rng.integers(1, min(18, layers) + 1)), int(rng.integers(1, 8))
    at = rng.integers(0, layouts, (rows, stages))
    n = rng.integers(0, layers // stages + 3, (rows, stages)).astype(float)
    nr = n + rng.integers(0, 3, (rows, stages))
    beat = INF if rng.random() < 0.5 else float(rng.random() * 20)
    kind = rng.integers(3)
    options = dict(last=kind == 1, placed=False if kind == 2 else None,
                   trips=rng.random(rows) * 3 if rng.random() < 0.5 else None)
    return (random_table(rng, layouts, layers), at, n, nr, int(rng.integers(1, 40)), layers, rng.random(rows), beat), options


@pytest.mark.parametrize("seed", range(4))
def test_least_steps_is_the_plain_scan(seed, monkeypatch):
    import solver.planner.bottleneck as bottleneck

    blocks = []  # per call, the blocks it priced
    priced = bottleneck.least_sums
    monkeypatch.setattr(bottleneck, "least_sums", lambda *a: (blocks.__setitem__(-1, blocks[-1] + 1), priced(*a))[1])
    rng = np.random.default_rng(seed)
    kinds = set()
    for _ in range(300):
        case, options = random_case(rng)
        expected = scanned(*case, **options)
        blocks.append(0)
        assert least_steps(*case, **options) == pytest.approx(expected, rel=1e-12), options
        kinds.add((options["last"], options["placed"], options["trips"] is None, bool(np.isfinite(expected).any())))
    assert len(kinds) >= 10, kinds  # every kind of row, some of each fitting
    assert max(blocks) >= 2, blocks  # some rows past their first block


@pytest.mark.parametrize("seed", range(3))
def test_rows_of_several_stage_counts_padded_into_one_pass_keep_their_figures(seed):
    """`least_steps`' `counts`: rows of fewer stages, padded at the front to the most
    (the padding's layouts and fits anything), priced in one pass, are each priced as
    in a pass of their own stage count (within rounding: the padding's zeros join the
    sums), for each kind of row; a set's rows hold two stages or more (`bounds._merged`
    keeps a lone stage apart)."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        layouts, layers = int(rng.integers(1, 6)), int(rng.integers(6, 50))
        table = random_table(rng, layouts, layers)
        kind = rng.integers(3)
        options = dict(last=kind == 1, placed=False if kind == 2 else None)
        m, beat, rounds = int(rng.integers(1, 40)), INF if rng.random() < 0.5 else float(rng.random() * 20), rng.random() < 0.5
        groups = []
        for stages in rng.choice(np.arange(1 if kind != 2 else 2, min(12, layers) + 1), size=3, replace=False):
            rows = int(rng.integers(1, 5))
            at = rng.integers(0, layouts, (rows, stages))
            n = rng.integers(0, layers // stages + 3, (rows, stages)).astype(float)
            nr = n + rng.integers(0, 3, (rows, stages))
            groups.append((at, n, nr, rng.random(rows), rng.random(rows) * 3 if rounds else None))
        alone = np.concatenate([least_steps(table, at, n, nr, m, layers, offsets, beat, trips=trips, **options)
                                for at, n, nr, offsets, trips in groups])
        width = max(g[0].shape[1] for g in groups)

        def padded(values, fill):
            extra = width - values.shape[1]
            return np.concatenate([fill((len(values), extra)), values], axis=1)

        at = np.concatenate([padded(g[0], lambda shape: rng.integers(0, layouts, shape)) for g in groups])
        n = np.concatenate([padded(g[1], lambda shape: rng.integers(0, 5, shape).astype(float)) for g in groups])
        nr = np.concatenate([padded(g[2], lambda shape: rng.integers(0, 5, shape).astype(float)) for g in groups])
        counts = np.concatenate([np.full(len(g[0]), g[0].shape[1]) for g in groups])
        offsets = np.concatenate([g[3] for g in groups])
        trips = np.concatenate([g[4] for g in groups]) if rounds else None
        together = least_steps(table, at, n, nr, m, layers, offsets, beat, trips=trips, counts=counts, **options)
        assert together == pytest.approx(alone, rel=1e-12), (options, counts)
