"""The 1F1B floor of rows of stages over candidate bottleneck times, in one array
pass: the part of `bounds.py`'s bounds that every row shares, whatever its order or
set (a set's, an order's, several sets' of as many stages at once).

For a bottleneck t, each stage holds at most the layers whose least run fits within
t (and its memory); each holds one layer at least, at its least one-layer time, and
every further layer costs at least its least increment, so the least summed stage
time hands the layers beyond one each to the least increments first. The floor is
the least (m - 1) t plus that sum over the candidate times, plus the row's offset.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from solver.cost.stage_costs import INF

_BLOCK = 16  # candidate step times priced at once


class LastStage(NamedTuple):
    """A pipeline's last stage (`LowerBounds._last_stage`): its least one-layer time and
    increment per further layer, plain and recomputing, over the model's last runs,
    and its rooms per candidate step time of its group."""

    first: float
    first_remat: float
    step: float
    step_remat: float
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
    index: dict[tuple, int]  # a layout (`bounds.KindLayout`) -> its row
    rows: dict[tuple, np.ndarray]  # per row of these layouts, each stage's position in the arrays above
    lasts: dict[tuple, LastStage]  # per layout, its figures as a pipeline's last stage (`LowerBounds._last_stage`)


def least_steps(group: Group, at: np.ndarray, n: np.ndarray, nr: np.ndarray, m: int, layers: int, offsets: np.ndarray,
                beat: float, lasts: list[LastStage] | None = None) -> np.ndarray:
    """Per row (`at`: each stage's layout in the group's arrays; `n`, `nr`: the most
    layers each stage holds without and with recomputation): the least (m - 1) t +
    summed stage times over the group's candidate times t, plus the row's offset,
    stopped at `beat` (a figure that reaches it is as good as exact for pruning);
    `lasts`: each row's last stage's own figures, where the order is known."""
    plain = n >= 1  # a stage that cannot hold one layer without recomputing recomputes
    firsts = np.where(plain, group.firsts[at], group.firsts_remat[at])
    rates = np.where(plain, group.rates[at], group.rates_remat[at])
    if lasts is not None:
        ends = plain[:, -1]
        firsts[:, -1] = np.where(ends, [s.first for s in lasts], [s.first_remat for s in lasts])
        rates[:, -1] = np.where(ends, [s.step for s in lasts], [s.step_remat for s in lasts])
        last_rooms = np.maximum(np.minimum(np.stack([s.rooms for s in lasts]), n[:, -1:]),
                                np.minimum(np.stack([s.rooms_remat for s in lasts]), nr[:, -1:]))
    base = firsts.sum(axis=1)[:, None]
    # The stages sorted by their increment per layer, once: the least sums hand the
    # layers beyond one per stage to the least increments first.
    by_rate = np.argsort(rates, axis=1, kind="stable")
    each = np.arange(len(at))[:, None]
    at, n, nr, sorted_rates = at[each, by_rate], n[each, by_rate], nr[each, by_rate], rates[each, by_rate][:, None, :]
    # Per row, stage and candidate bottleneck time t: the most layers the stage may hold.
    rooms = np.maximum(np.minimum(group.plain_rooms[at], n[:, :, None]), np.minimum(group.remat_rooms[at], nr[:, :, None]))
    if lasts is not None:
        end = np.argmax(by_rate == by_rate.shape[1] - 1, axis=1)  # where the last stage sorted to
        rooms[each[:, 0], end] = np.minimum(rooms[each[:, 0], end], last_rooms)
    budget = layers - n.shape[1]  # layers beyond one per stage

    def least_sums(rooms: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per row (of `rows`) and candidate time (`rooms`: the most layers each
        stage may hold there, stages by rate): the least summed stage time when each
        stage holds at least one layer, the extra layers going to the least
        increments (inf where the layers do not fit)."""
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
    # From the least time at which some row's layers all have room, a block of times
    # at a time: a time's bound is (m - 1) t plus its least sum (inf before the row's
    # layers have room), and once (m - 1) t plus a row's least sum of all reaches its
    # best so far, no later time can win it.
    going = some.copy()
    for start in range(int(np.argmax(enough.any(axis=0))) if some.any() else len(steps), len(steps), _BLOCK):
        ts = steps[start : start + _BLOCK]
        # (a block's rooms contiguous along the stages, as the sums over them add in that layout's order)
        block = np.ascontiguousarray(rooms[going, :, start : start + _BLOCK].transpose(0, 2, 1))
        values = (m - 1) * ts + least_sums(block, going)
        best[going] = np.minimum(best[going], values.min(axis=1))
        going[going] = (m - 1) * ts[-1] + floor_sums[going] < best[going]
        if not going.any():
            break
    return np.where(some, best + offsets, INF)

