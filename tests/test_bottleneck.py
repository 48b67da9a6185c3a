"""`bottleneck.least_steps` counts its rooms in integers and prices the stages' most
layers beside its first block of candidate times: every figure must be the one the
float pass it replaced gives, bit for bit (the search compares them to prune), on
rows of up to 18 stages (past 8, numpy's sums along the stages add pairwise, so a
layout of the products other than contiguous along the stages would reorder them)."""

import numpy as np
import pytest

from solver.planner.bottleneck import Group, LastRooms, least_steps, places
from solver.planner.runs import FITS_TOL

INF = float("inf")
_BLOCK = 16


def least_steps_floats(group, at, n, nr, m, layers, offsets, beat, lasts=None):
    """The float pass as it was: every room a float, the floor priced apart (with
    `lasts`, each stage's figures by its place, a stage at a time)."""
    plain = n >= 1
    firsts = np.where(plain, group.firsts[at], group.firsts_remat[at])
    rates = np.where(plain, group.rates[at], group.rates_remat[at])
    middle = np.zeros(len(at))  # the least time at which every middle stage holds a layer
    if lasts is not None:
        figures = group.by_place
        for column, place in enumerate(places(at.shape[1])):
            lay, whole = at[:, column], plain[:, column]
            firsts[:, column] = np.where(whole, figures[0, place][lay], figures[1, place][lay])
            rates[:, column] = np.where(whole, figures[2, place][lay], figures[3, place][lay])
        last = at[:, -1]
        last_rooms = np.maximum(np.minimum(lasts.rooms[last], n[:, -1:]), np.minimum(lasts.rooms_remat[last], nr[:, -1:]))
        if at.shape[1] > 2:
            inner = np.minimum(np.where(n >= 1, figures[0, 1][at], INF), np.where(nr >= 1, figures[1, 1][at], INF))
            middle = inner[:, 1:-1].max(axis=1)
    base = firsts.sum(axis=1)[:, None]
    by_rate = np.argsort(rates, axis=1, kind="stable")
    each = np.arange(len(at))[:, None]
    at, n, nr, sorted_rates = at[each, by_rate], n[each, by_rate], nr[each, by_rate], rates[each, by_rate][:, None, :]
    rooms = np.maximum(np.minimum(group.plain_rooms[at], n[:, :, None]), np.minimum(group.remat_rooms[at], nr[:, :, None]))
    if lasts is not None:
        end = np.argmax(by_rate == by_rate.shape[1] - 1, axis=1)
        rooms[each[:, 0], end] = np.minimum(rooms[each[:, 0], end], last_rooms)
    budget = layers - n.shape[1]

    def least_sums(rooms, rows=slice(None)):
        extra = rooms - 1
        before = np.cumsum(extra, axis=2) - extra
        take = np.clip(budget - before, 0, extra)
        sums = base[rows] + (take * sorted_rates[rows]).sum(axis=2)
        return np.where((extra.min(axis=2) < 0) | (extra.sum(axis=2) < budget), INF, sums)

    steps = group.steps
    enough = rooms.sum(axis=1) >= layers
    some = enough.any(axis=1)
    floor_sums = least_sums(np.maximum(n, nr)[:, None, :])[:, 0]
    best = beat - offsets
    going = some.copy()
    for start in range(int(np.argmax(enough.any(axis=0))) if some.any() else len(steps), len(steps), _BLOCK):
        ts = steps[start : start + _BLOCK]
        block = np.ascontiguousarray(rooms[going, :, start : start + _BLOCK].transpose(0, 2, 1))
        values = np.where(ts * FITS_TOL >= middle[going, None], (m - 1) * ts + least_sums(block, going), INF)
        best[going] = np.minimum(best[going], values.min(axis=1))
        going[going] = (m - 1) * ts[-1] + floor_sums[going] < best[going]
        if not going.any():
            break
    return np.where(some, best + offsets, INF)


def nondecreasing_counts(rng, count, size, most):
    return np.sort(rng.integers(0, most + 1, (count, size)), axis=1)


def random_case(rng):
    layouts, size, layers = int(rng.integers(1, 6)), int(rng.integers(1, 80)), int(rng.integers(4, 60))
    stages, rows = int(rng.integers(1, min(18, layers) + 1)), int(rng.integers(1, 8))
    group = Group(np.sort(rng.random(size)) * 3, 0.0, rng.random(layouts), rng.random(layouts) * 2, rng.random(layouts) / 7,
                  rng.random(layouts) / 5, nondecreasing_counts(rng, layouts, size, layers),
                  nondecreasing_counts(rng, layouts, size, layers), rng.random((6, 3, layouts)), {}, {}, None)
    at = rng.integers(0, layouts, (rows, stages))
    n = rng.integers(0, layers // stages + 3, (rows, stages)).astype(float)
    nr = n + rng.integers(0, 3, (rows, stages))
    lasts = None
    if rng.random() < 0.5:
        lasts = LastRooms(*(nondecreasing_counts(rng, layouts, size, layers) for _ in range(2)))
    beat = INF if rng.random() < 0.5 else float(rng.random() * 20)
    return group, at, n, nr, int(rng.integers(1, 40)), layers, rng.random(rows), beat, lasts


@pytest.mark.parametrize("seed", range(4))
def test_least_steps_is_the_float_pass_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        case = random_case(rng)
        old = least_steps_floats(*case)
        assert least_steps(*case).tobytes() == old.tobytes()
