"""The 1F1B floor of rows of stages over candidate bottleneck times, in one array
pass: the part of `bounds.py`'s bounds that every row shares, whatever its order or
set (a set's, an order's, several sets' of as many stages at once).

For a bottleneck t, each stage holds at most the layers whose least run fits within
t (and its memory); each holds one layer at least, at its least one-layer time, and
every further layer costs at least its least increment, so the least summed stage
time hands the layers beyond one each to the least increments first. The floor is
the least (m - 1) t plus that sum over the candidate times, plus the row's offset.
Under 1F1B the pace is also at least the first stage's round trip over the stages
(`round_trip_pace`): that sum plus the row's least sends both ways, shared by the
microbatches the first stage keeps in flight.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from solver.cost.stage_costs import INF
from solver.planner.runs import FITS_TOL
from solver.schedules.one_f_one_b import round_trip_pace

_BLOCK = 16  # candidate step times priced at once


class LastRooms(NamedTuple):
    """A group's layouts as a pipeline's last stage (`LowerBounds._group`'s `placed`): its
    rooms per candidate step time of the group, [layout, t] (layouts in the group's
    `index` order; a row of orders picks its last stage's by its layout)."""

    rooms: np.ndarray
    rooms_remat: np.ndarray


class Group(NamedTuple):
    """What a set of layouts' bounds share, whatever their order."""

    steps: np.ndarray  # every time a stage of these layouts can take for a run of layers
    tail: float  # the least slowest tail
    # Per layout (a row each, in `index`'s order): one stage's least one-layer time and
    # increment per further layer, plain and recomputing, and its rooms per step (plain, remat).
    firsts: np.ndarray
    firsts_remat: np.ndarray
    rates: np.ndarray
    rates_remat: np.ndarray
    plain_rooms: np.ndarray
    remat_rooms: np.ndarray
    # [figure, place, layout]: `rows.EndRuns`' six figures (one-layer time, increment per further
    # layer, base beside the increments anywhere; each plain and recomputing) over the runs a
    # stage's place in a pipeline allows (`places`: first, middle, last)
    by_place: np.ndarray
    index: dict[tuple, int]  # a layout (`layouts.KindLayout`) -> its row
    rows: dict[tuple, np.ndarray]  # per row of these layouts, each stage's position in the arrays above
    lasts: LastRooms | None  # its layouts' rooms as a pipeline's last stage (`LowerBounds._group`'s `placed`)


def least_steps(group: Group, at: np.ndarray, n: np.ndarray, nr: np.ndarray, m: int, layers: int, offsets: np.ndarray,
                beat: float, lasts: LastRooms | None = None, trips: np.ndarray | None = None,
                placed: bool | None = None) -> np.ndarray:
    """Per row (`at`: each stage's layout in the group's arrays; `n`, `nr`: the most
    layers each stage holds without and with recomputation, whole numbers): the least
    (m - 1) t + summed stage times over the group's candidate times t, plus the row's
    offset, stopped at `beat` (a figure that reaches it is as good as exact for
    pruning); `lasts`: given where the order is known, each stage is priced by the runs
    its place allows (`Group.by_place`), the last's rooms are its own, and no candidate
    time below a middle stage's one-layer time counts (`_middle_floor`); `placed` False:
    the order is not known (a set's rows), but at most two stages are not middle ones
    (`_unplaced`); `trips`: per row, what
    a round trip adds to the summed stage times (its least sends both ways), where
    1F1B's round trips pace it (`round_trip_pace`) and the pace is t or the round
    trip's, whichever is slower.
    The rooms are counted in integers (the group's are; mixing in float counts cast
    every array pass), exact, so every figure is the one counted in floats."""
    n, nr = n.astype(np.int64), nr.astype(np.int64)
    plain = n >= 1  # a stage that cannot hold one layer without recomputing recomputes
    firsts = np.where(plain, group.firsts[at], group.firsts_remat[at])
    rates = np.where(plain, group.rates[at], group.rates_remat[at])
    # Per row, the least candidate time at which its middle stages all hold a layer (`_middle_floor`).
    middle = None
    if placed is False:
        base, middle = _unplaced(group.by_place, at, plain, n, nr)
    elif lasts is not None:  # each stage's runs are those its place allows (a subset: the figures only grow)
        place, figures = places(at.shape[1]), group.by_place
        firsts = np.where(plain, figures[0][place, at], figures[1][place, at])
        rates = np.where(plain, figures[2][place, at], figures[3][place, at])
        last = at[:, -1]
        last_rooms = np.maximum(np.minimum(lasts.rooms[last], n[:, -1:]), np.minimum(lasts.rooms_remat[last], nr[:, -1:]))
        if at.shape[1] > 2:
            middle = _middle_floor(figures, at[:, 1:-1], n[:, 1:-1], nr[:, 1:-1]).max(axis=1)
    if placed is not False:
        base = firsts.sum(axis=1)
    # The stages sorted by their increment per layer, once: the least sums hand the
    # layers beyond one per stage to the least increments first.
    by_rate = np.argsort(rates, axis=1, kind="stable")
    each = np.arange(len(at))[:, None]
    at, n, nr, sorted_rates = at[each, by_rate], n[each, by_rate], nr[each, by_rate], rates[each, by_rate]
    # Per row, stage and candidate bottleneck time t: the most layers the stage may
    # hold, nondecreasing along t (as the group's rooms are); in place, in the gathers' copies.
    rooms, remat = group.plain_rooms[at], group.remat_rooms[at]
    np.minimum(rooms, n[:, :, None], out=rooms)
    np.maximum(rooms, np.minimum(remat, nr[:, :, None], out=remat), out=rooms)
    if lasts is not None:
        end = np.argmax(by_rate == by_rate.shape[1] - 1, axis=1)  # where the last stage sorted to
        rooms[each[:, 0], end] = np.minimum(rooms[each[:, 0], end], last_rooms)
    # Where a row's layers fit: every stage has room for one and all for every layer
    # (nondecreasing along t, as the rooms are).
    enough = rooms.sum(axis=1) >= layers
    fit = enough & (rooms.min(axis=1) >= 1)
    if middle is not None:
        fit &= group.steps * FITS_TOL >= middle[:, None]
    some = enough[:, -1]
    budget = layers - n.shape[1]  # layers beyond one per stage
    steps = group.steps
    best = beat - offsets
    # From the least time at which some row's layers all have room, a block of times
    # at a time: a time's bound is (m - 1) t plus its least sum (inf where the row's
    # layers do not fit), and once (m - 1) t plus a row's least sum of all (`floor`:
    # each stage at its most layers, priced beside the first block) reaches its best so
    # far, no later time can win it.
    going = some.copy()
    first = int(np.argmax(enough.any(axis=0))) if some.any() else len(steps)
    floor = None
    for start in range(first, len(steps), _BLOCK):
        ts = steps[start : start + _BLOCK]
        rows = slice(None) if going.all() else going  # (all, as a slice: no row gathered)
        block = rooms[rows, :, start : start + _BLOCK].transpose(0, 2, 1)
        if floor is None:  # the first block prices the most layers of each stage as one more time
            block = np.concatenate([block, np.maximum(n[rows], nr[rows])[:, None, :]], axis=1)
        sums = least_sums(block, budget, base[rows], sorted_rates[rows])
        if floor is None:
            floor = np.full(len(at), INF)
            floor[rows], sums = sums[:, -1], sums[:, :-1]
        pace = ts if trips is None else np.maximum(ts, round_trip_pace(sums + trips[rows, None], n.shape[1], m))
        values = (m - 1) * pace + np.where(fit[rows, start : start + _BLOCK], sums, INF)
        best[rows] = np.minimum(best[rows], values.min(axis=1))
        going[rows] = (m - 1) * ts[-1] + floor[rows] < best[rows]
        if not going.any():
            break
    return np.where(some, best + offsets, INF)


def third_slowest(times: list[np.ndarray], counts: list[np.ndarray]) -> np.ndarray:
    """Per combination of one layout per kind (`times`: per kind, its stages' least
    one-layer time as middle stages; `counts`: its stages), the third largest over all
    its stages (0 for fewer than three): no split's bottleneck is below it, since every
    stage but the first and the last is a middle one, its one-layer time at most the
    bottleneck (kept below it despite rounding)."""
    times, counts = np.stack(times), np.stack(counts)
    order = np.argsort(-times, axis=0, kind="stable")
    slowest = np.take_along_axis(times, order, axis=0)
    held = np.cumsum(np.take_along_axis(counts, order, axis=0), axis=0)
    third = np.argmax(held >= 3, axis=0)
    value = np.take_along_axis(slowest, third[None, :], axis=0)[0]
    return np.where(held[-1] >= 3, value * (1 - 1e-9), 0.0)


def middle_one(one: np.ndarray, one_remat: np.ndarray, n: np.ndarray, nr: np.ndarray) -> np.ndarray:
    """A stage's least one-layer time as a middle stage (`one`, `one_remat`: plain and
    recomputing), plain where its memory holds a layer so (`n` >= 1), else recomputing
    (`nr` >= 1), inf where neither: no split in whose middle the stage is has a
    bottleneck below it."""
    return np.minimum(np.where(n >= 1, one, INF), np.where(nr >= 1, one_remat, INF))


def _middle_floor(figures: np.ndarray, at: np.ndarray, n: np.ndarray, nr: np.ndarray) -> np.ndarray:
    """`middle_one` of each stage (`Group.by_place`'s middle place): a candidate time
    (`LowerBounds._group`), so at most the largest candidate t <= M, where a split of
    bottleneck M is counted."""
    return middle_one(figures[0, 1][at], figures[1, 1][at], n, nr)


def _unplaced(figures: np.ndarray, at: np.ndarray, plain: np.ndarray, n: np.ndarray,
              nr: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Where a row's order is not known: one of its stages is first, one last, the
    others middle ones, whichever they are (`figures`: `Group.by_place`). Per row: its
    stages' summed bases beside their increments anywhere (`rows.EndRuns.base`), each
    at its middle place's but the two that an end place saves the most, at their end's;
    and no candidate time below the third largest of its stages' `_middle_floor`
    counts (None for fewer than three stages, all ends)."""
    def base(place: int) -> np.ndarray:
        return np.where(plain, figures[4, place][at], figures[5, place][at])

    end = np.minimum(base(0), base(2))
    if at.shape[1] < 3:
        return end.sum(axis=1), None
    middle = base(1)
    chosen = np.zeros(at.shape, dtype=bool)
    np.put_along_axis(chosen, np.argsort(middle - end, axis=1, kind="stable")[:, -2:], True, axis=1)
    return np.where(chosen, end, middle).sum(axis=1), np.sort(_middle_floor(figures, at, n, nr), axis=1)[:, -3]


def places(stages: int) -> np.ndarray:
    """Each stage's place in a pipeline of `stages` (`Group.by_place`'s second axis): first, the
    middle ones, last; one stage alone holds the whole model, its runs the last's."""
    return np.array([2] if stages == 1 else [0] + [1] * (stages - 2) + [2])


def least_sums(rooms: np.ndarray, budget: int, base: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """Per row and candidate time (`rooms`: rows x times x stages, the most layers
    each stage may hold there, whole numbers, stages by `rates`): the least summed
    stage time when each stage holds one layer (`base`) and the `budget` layers beyond
    go to the least increments first (where they fit: the caller masks the rest). The
    counts are exact in integers; only the products are summed in floats, along the
    stages (contiguous), in their order."""
    # In C order, and so every array after it (`rooms` may be a transposed view): past 8
    # stages numpy adds a sum pairwise only along a contiguous axis, else in turn.
    extra = np.subtract(rooms, 1, order="C")
    before = np.cumsum(extra, axis=2) - extra
    take = np.minimum(np.maximum(budget - before, 0), extra)
    return base[:, None] + (take * rates[:, None, :]).sum(axis=2)
