"""Least runs of consecutive layers, and the searches over them that the planner's
bounds make: which run lengths fit within a candidate time, and where a sum of
rooms first holds every layer, and the balanced pace of device groups. Pure functions
of arrays, shared by the bounds of `bounds.py` and the split's own refusals
(`layer_split`), kept apart so those modules hold only what a bound means; the
one-row forms are `rows.py`'s passes on one row."""

from __future__ import annotations

import numpy as np

from solver.planner.rows import least_runs_rows, most_within

FITS_TOL = 1 + 1e-12  # a run whose time equals a candidate step time fits it despite rounding


def least_runs(values: np.ndarray) -> np.ndarray:
    """[n - 1]: the least sum of any n consecutive entries of `values` (a span matrix)."""
    return least_runs_rows(values[None])[0]


def longest(runs: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Per limit (ascending), the most layers n whose least run `runs[n - 1]` stays within it."""
    return most_within(runs[None], limits, FITS_TOL)[0]


def first_enough(rooms: list[np.ndarray], index: np.ndarray, size: int, layers: int) -> np.ndarray:
    """Per combination (a column of `index`, one row of each kind's `rooms`, which
    are nondecreasing along the grid): the first grid position where their sum
    reaches `layers` (`size` where none does), by a binary search run on all at once:
    the count of positions known to fall short grows by each power of two in turn
    where the position it would reach still falls short (each probe a flat gather
    per kind: a combination's row starts at its index times `size`). No combination
    needs its own bounds or a test of whether it is done, so a pass is a few calls
    (a product's table has a thousand combinations: the calls, not their arithmetic,
    were its cost)."""
    flats = [np.ascontiguousarray(r).reshape(-1) for r in rooms]
    starts = [i * size - 1 for i in index]  # a count c probes position c - 1
    count = np.zeros(index.shape[1], dtype=np.intp)
    step = 1 << (int(size).bit_length() - 1) if size else 0
    while step:
        probe = np.minimum(count + step, size)  # past the grid: its last position (all fall short: `size`)
        total = flats[0].take(starts[0] + probe)
        for flat, start in zip(flats[1:], starts[1:]):
            total = total + flat.take(start + probe)
        count = np.where(total < layers, probe, count)
        step >>= 1
    return count


def balanced_pace(layers: int, rates: np.ndarray) -> float:
    """The least pace of device groups that spend at least `rates[g]` on each layer
    they hold, were layers divisible: sharing `layers` so that every group is as busy
    (layers / sum(1 / r_g)); 0 where some group's rate is 0 (nothing bounds it)."""
    return float(layers / (1.0 / rates).sum()) if (rates > 0).all() else 0.0
