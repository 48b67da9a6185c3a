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
from solver.planner.rows import StageRuns
from solver.planner.runs import FITS_TOL
from solver.schedules.one_f_one_b import round_trip_pace

_BLOCK = 16  # candidate step times priced at once


class LayoutRows(NamedTuple):
    """Per layout (a row each, in `index`'s order) at one microbatch size, what every
    set's and order's bound reads of it, whatever the other layouts beside it: a bound
    gathers its rows' stages from these (`at`), so sets and orders of any layouts share
    one table and none builds arrays of its own."""

    # [layout, q - 1]: the least time at which one stage has room for q layers (`rows.StageRuns.floor`),
    # plain and recomputing, and the same as a pipeline's last stage (its runs end the model)
    floors: np.ndarray
    floors_remat: np.ndarray
    last_floors: np.ndarray
    last_floors_remat: np.ndarray
    # one stage's least one-layer time and increment per further layer, plain and recomputing
    firsts: np.ndarray
    firsts_remat: np.ndarray
    rates: np.ndarray
    rates_remat: np.ndarray
    # [figure, place, layout]: `rows.EndRuns`' six figures (one-layer time, increment per further
    # layer, base beside the increments anywhere; each plain and recomputing) over the runs a
    # stage's place in a pipeline allows (`places`: first, middle, last)
    by_place: np.ndarray
    # What the bounds read beside (`bounds.LowerBounds._layout_rows`): per layout, the most layers
    # one stage holds at each count of microbatches in flight ([layout, count - 1, plain or
    # recomputing]), the least tail of a run holding the model's first layer and of one holding
    # its last, its stages; per pair, the least send between their stages
    fits: np.ndarray
    ends: np.ndarray
    stages: np.ndarray
    sends: np.ndarray
    layouts: list  # the layouts (`layouts.KindLayout`), in their rows' order
    index: dict[tuple, int]  # a layout -> its row


def with_layouts(table: LayoutRows | None, layouts: tuple, runs: list[StageRuns], fits: np.ndarray,
                 ends: np.ndarray, sends: np.ndarray) -> LayoutRows:
    """`table` (None: none yet) with `layouts` appended, each with its least runs
    (`runs`), its fits at every count of microbatches in flight (`fits`: [layout,
    count - 1, 2]) and its end tails (`ends`); `sends`: every pair's least send, the
    table's layouts then these."""
    added = (
        np.array([r.floor for r in runs]), np.array([r.floor_remat for r in runs]),
        np.array([r.last_floor for r in runs]), np.array([r.last_floor_remat for r in runs]),
        *np.array([(r.time[0], r.remat[0], r.step, r.step_remat) for r in runs]).T,
        np.array([[tuple(place) for place in (r.first, r.inner, r.final)] for r in runs], dtype=float).transpose(2, 1, 0),
        fits.astype(float), ends, np.array([lay.stages for lay in layouts]),
    )
    old = 0 if table is None else len(table.layouts)
    if table is None:
        arrays, members, index = [np.ascontiguousarray(a) for a in added], list(layouts), {}
    else:  # (by_place, the ninth, is [figure, place, layout])
        arrays = [np.concatenate([was, new], axis=2 if i == 8 else 0) for i, (was, new) in enumerate(zip(table[:12], added))]
        members, index = table.layouts + list(layouts), table.index
    index.update(zip(layouts, range(old, old + len(layouts))))
    return LayoutRows(*arrays, sends, members, index)


def order_rows(sets: list[tuple], perms: np.ndarray, count: int, table: LayoutRows) -> np.ndarray:
    """Per order of each set (`count` stages each; set by set, each set's orders by
    `perms`): each stage's layout in `table`, a layout's row repeated over its stages."""
    slots = np.array([[table.index[lay] for lay in row] for row in sets])[:, perms].reshape(-1, perms.shape[1])
    return np.repeat(slots.ravel(), table.stages[slots].ravel()).reshape(len(slots), count)


def row_sends(rows: np.ndarray, table: LayoutRows) -> np.ndarray:
    """Per row of stages (their layouts in `table`): its cuts' least sends both ways,
    summed left to right, as a running sum adds them."""
    if rows.shape[1] < 2:
        return np.zeros(len(rows))
    return 2 * np.cumsum(table.sends[rows[:, :-1], rows[:, 1:]], axis=1)[:, -1]


def least_steps(table: LayoutRows, at: np.ndarray, n: np.ndarray, nr: np.ndarray, m: int, layers: int, offsets: np.ndarray,
                beat: float, last: bool = False, trips: np.ndarray | None = None, placed: bool | None = None,
                counts: np.ndarray | None = None) -> np.ndarray:
    """Per row (`at`: each stage's layout in `table`; `n`, `nr`: the most layers each
    stage holds without and with recomputation, whole numbers): the least (m - 1) t +
    summed stage times over candidate bottlenecks t, plus the row's offset, stopped at
    `beat` (a figure that reaches it is as good as exact for pruning); `last`: the
    order is known, each stage is priced by the runs its place allows
    (`LayoutRows.by_place`), the last stage's rooms are also its last runs', and no
    bottleneck below a middle stage's one-layer time counts (`_middle_floor`);
    `placed` False: the order is not known (a set's rows), but at most two stages are
    not middle ones (`_unplaced`); `trips`: per row, what a round trip adds to the
    summed stage times (its least sends both ways), where 1F1B's round trips pace it
    (`round_trip_pace`) and the pace is t or the round trip's, whichever is slower;
    `counts`: per row, how many of its stages are its own, the last ones (rows of
    fewer stages padded at the front, so that one pass bounds rows of several stage
    counts: a pass costs a few hundred microseconds whatever its rows, and a stream's
    sets have three or four stage counts): a padding stage has room for one layer from
    the start and never another, at no time, so it holds none of the layers beyond one
    per stage of the row's own, which are all the row's summed times count.

    Each stage gains a room for one more layer at each of its thresholds (the least
    time at which it has room for q layers, nondecreasing in q), so a row's rooms
    change only there: its candidates are its own stages' thresholds, sorted, from
    the first at which its layers fit (its `layers`-th, and every stage's first), a
    block at a time, the rooms at each counted by position (at the last of a run of
    equal thresholds, all of them). A split of bottleneck M has all its stages'
    thresholds up to their layers within M (times `FITS_TOL`, for rounding), so at the
    largest of them every stage has room for its layers and the pace is at most M.
    No grid of times shared by a group of layouts is built (a group's grid was the
    sorted times of all its layouts, hundreds, most never read), so rows of any
    layouts are bounded in one pass."""
    rows_count, stages = at.shape
    pad = None if counts is None else np.arange(stages) < (stages - counts)[:, None]  # [row, stage]: padding
    n, nr = n.astype(np.int64), nr.astype(np.int64)
    if pad is not None:  # (one room each: its least sums' extra layers none)
        n, nr = np.where(pad, 1, n), np.where(pad, 1, nr)
    plain = n >= 1  # a stage that cannot hold one layer without recomputing recomputes
    middle = None  # per row, the least pace at which its middle stages all hold a layer (`_middle_floor`)
    if placed is False:
        firsts = None
        base, middle = _unplaced(table.by_place, at, plain, n, nr, pad)
        rates = np.where(plain, table.rates[at], table.rates_remat[at])
    elif last:  # each stage's runs are those its place allows (a subset: the figures only grow)
        place, figures = places(stages, counts), table.by_place
        firsts = np.where(plain, figures[0][place, at], figures[1][place, at])
        rates = np.where(plain, figures[2][place, at], figures[3][place, at])
        if stages > 2:  # (a padding stage is at no place)
            inner = place == 1 if pad is None else (place == 1) & ~pad
            middle = np.where(inner, _middle_floor(figures, at, n, nr), 0.0).max(axis=1)
    else:
        firsts = np.where(plain, table.firsts[at], table.firsts_remat[at])
        rates = np.where(plain, table.rates[at], table.rates_remat[at])
    if pad is not None:
        rates = np.where(pad, 0.0, rates)
        firsts = None if firsts is None else np.where(pad, 0.0, firsts)
    if firsts is not None:
        base = firsts.sum(axis=1)
    # Each stage's thresholds: the q-th where it may hold q layers plain (q <= n) or recomputing (q <= nr).
    q = np.arange(layers)
    thresholds = np.minimum(np.where(q < n[:, :, None], table.floors[at], INF),
                            np.where(q < nr[:, :, None], table.floors_remat[at], INF))
    if last:  # the last stage's rooms are also its last runs' (a threshold is the later of the two)
        end = at[:, -1]
        np.maximum(thresholds[:, -1], np.minimum(np.where(q < n[:, -1:], table.last_floors[end], INF),
                                                 np.where(q < nr[:, -1:], table.last_floors_remat[end], INF)),
                   out=thresholds[:, -1])
    if pad is not None:
        thresholds[pad] = np.where(q == 0, -1.0, INF)  # room for one layer before any time, never for two
    flat = thresholds.reshape(rows_count, stages * layers)
    order = np.argsort(flat, axis=1, kind="stable")  # (gathered from where a block reads them, not all sorted)
    # The stages sorted by their increment per layer: the least sums hand the layers
    # beyond one per stage to the least increments first; each candidate's stage by that rank.
    by_rate = np.argsort(rates, axis=1, kind="stable")
    each = np.arange(rows_count)[:, None]
    rank = np.empty_like(by_rate)
    rank[each, by_rate] = np.arange(stages)
    n, nr, sorted_rates = n[each, by_rate], nr[each, by_rate], rates[each, by_rate]
    # Where a row's layers first fit: `layers` thresholds passed and each stage's first.
    position = np.empty_like(order)
    position[each, order] = np.arange(stages * layers)
    own = np.broadcast_to(stages if counts is None else counts, rows_count)  # each row's stages of its own
    first = np.maximum(position[:, ::layers].max(axis=1), layers - 1 + stages - own)  # (the padding's thresholds first)
    # [row, stage by rate, q]: where each threshold sorted to
    position = position.reshape(rows_count, stages, layers)[each, by_rate]
    some = np.isfinite(flat[each[:, 0], order[each[:, 0], np.minimum(first, stages * layers - 1)]])
    budget = layers - own  # layers beyond one per stage
    best = beat - offsets
    going = some.copy()
    floor = None
    start = np.where(some, first, 0)
    while going.any():
        rows = np.nonzero(going)[0]
        at_k = start[rows, None] + np.arange(_BLOCK)  # [row, candidate]
        valid = at_k < stages * layers
        at_k = np.minimum(at_k, stages * layers - 1)
        sorted_at = order[rows[:, None], at_k]  # each candidate's threshold, flat in its row
        ts = flat[rows[:, None], sorted_at]
        # rooms at each candidate: the thresholds up to it, per stage (counted by position):
        # those up to the block's first, then one more for the stage of each candidate after it
        block = np.empty((len(rows), _BLOCK, stages), dtype=np.int64)
        (position[rows] <= at_k[:, :1, None]).sum(axis=2, out=block[:, 0])
        owner = rank[rows[:, None], sorted_at[:, 1:] // layers]  # each candidate's stage, by rate
        np.cumsum(owner[:, :, None] == np.arange(stages), axis=1, out=block[:, 1:])
        block[:, 1:] += block[:, :1]
        if floor is None:  # the first block prices the most layers of each stage as one more time
            block = np.concatenate([block, np.maximum(n[rows], nr[rows])[:, None, :]], axis=1)
        sums = least_sums(block, budget[rows], base[rows], sorted_rates[rows])
        if floor is None:
            floor = np.full(rows_count, INF)
            floor[rows], sums = sums[:, -1], sums[:, :-1]
        t = (ts if middle is None else np.maximum(ts, middle[rows, None])) / FITS_TOL  # (`FITS_TOL`: the docstring)
        valid &= t < INF  # (past the row's last threshold, or a middle stage that holds no layer)
        t = np.where(valid, t, 0.0)
        pace = t if trips is None else np.maximum(t, round_trip_pace(sums + trips[rows, None], own[rows, None], m))
        values = np.where(valid, (m - 1) * pace + sums, INF)
        best[rows] = np.minimum(best[rows], values.min(axis=1))
        start[rows] += _BLOCK
        going[rows] = valid[:, -1] & ((m - 1) * t[:, -1] + floor[rows] < best[rows])
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
    """`middle_one` of each stage (`LayoutRows.by_place`'s middle place): a floor under
    the pace of any split in whose middle the stage is (`least_steps` prices no pace
    below it)."""
    return middle_one(figures[0, 1][at], figures[1, 1][at], n, nr)


def _unplaced(figures: np.ndarray, at: np.ndarray, plain: np.ndarray, n: np.ndarray, nr: np.ndarray,
              pad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Where a row's order is not known: one of its stages is first, another last, the
    others middle ones, whichever they are (`figures`: `LayoutRows.by_place`). Per row:
    its stages' summed bases beside their increments anywhere (`rows.EndRuns.base`),
    each at its middle place's but one at the first place's and another at the last's,
    the pair that gives the least sum (a stage alone holds the model, at the last's);
    and no pace below the third largest of its stages' `_middle_floor` counts (None
    for fewer than three stages, all ends). `pad`: `least_steps`' padding stages, at no
    place and under every floor (rows of two stages of their own or more). (Two stages
    at the cheaper of either end each, as this was, let a language model's head go
    unpriced: its last place is the dearest.)"""
    def base(place: int) -> np.ndarray:
        return np.where(plain, figures[4, place][at], figures[5, place][at])

    first, last = base(0), base(2)
    if at.shape[1] < 3:
        if at.shape[1] == 1:
            return last[:, 0], None
        return np.minimum(first[:, 0] + last[:, 1], first[:, 1] + last[:, 0]), None
    middle = base(1)
    gain_first, gain_last, floors = middle - first, middle - last, _middle_floor(figures, at, n, nr)
    if pad is not None:
        first, last, middle, floors = (np.where(pad, 0.0, a) for a in (first, last, middle, floors))
        gain_first, gain_last = np.where(pad, -INF, gain_first), np.where(pad, -INF, gain_last)
    i, j = _best_pair(gain_first, gain_last)
    place = np.arange(at.shape[1])
    total = np.where(place == i[:, None], first, np.where(place == j[:, None], last, middle)).sum(axis=1)
    return total, np.sort(floors, axis=1)[:, -3]


def _best_pair(gain_first: np.ndarray, gain_last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the stages i != j with the largest gain_first[i] + gain_last[j]: each
    place's best; where one stage is best at both, the better of it at the first place
    beside the last place's second best and it at the last beside the first's second
    best (the former on a tie, as a scan of the pairs in that order finds)."""
    i, j = gain_first.argmax(axis=1), gain_last.argmax(axis=1)
    clash = np.nonzero(i == j)[0]
    if clash.size:
        best, taken = i[clash], np.arange(gain_first.shape[1]) == i[clash, None]
        last_else = np.where(taken, -INF, gain_last[clash]).argmax(axis=1)  # the last place's second best
        first_else = np.where(taken, -INF, gain_first[clash]).argmax(axis=1)
        keep_first = (gain_first[clash, best] + gain_last[clash, last_else]
                      >= gain_first[clash, first_else] + gain_last[clash, best])
        i[clash] = np.where(keep_first, best, first_else)
        j[clash] = np.where(keep_first, last_else, best)
    return i, j


def places(stages: int, counts: np.ndarray | None = None) -> np.ndarray:
    """Each stage's place in a pipeline of `stages` (`LayoutRows.by_place`'s second axis): first, the
    middle ones, last; one stage alone holds the whole model, its runs the last's. With `counts`,
    per row of that many stages of its own, the last ones (`least_steps`' padding: at the middle's)."""
    if counts is None:
        return np.array([2] if stages == 1 else [0] + [1] * (stages - 2) + [2])
    place = np.ones((len(counts), stages), dtype=np.int64)
    place[np.arange(len(counts)), stages - counts] = 0
    place[:, -1] = 2
    return place


def least_sums(rooms: np.ndarray, budget: int | np.ndarray, base: np.ndarray, rates: np.ndarray) -> np.ndarray:
    """Per row and candidate time (`rooms`: rows x times x stages, the most layers
    each stage may hold there, whole numbers, stages by `rates`): the least summed
    stage time when each stage holds one layer (`base`) and the `budget` layers beyond
    (one figure, or one per row) go to the least increments first (where they fit: the
    caller masks the rest). The
    counts are exact in integers; only the products are summed in floats, along the
    stages (contiguous), in their order."""
    # In C order, and so every array after it (`rooms` may be a transposed view): past 8
    # stages numpy adds a sum pairwise only along a contiguous axis, else in turn.
    extra = np.subtract(rooms, 1, order="C")
    before = np.cumsum(extra, axis=2) - extra
    take = np.minimum(np.maximum(np.reshape(budget, (-1, 1, 1)) - before, 0), extra)
    return base[:, None] + (take * rates[:, None, :]).sum(axis=2)
