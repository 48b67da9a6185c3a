"""A stage table where the optimizer state stays on the devices (most problems), priced
over the layer ranges that exist alone.

A table's [i, j] entries with i >= j hold no range: the table says "does not fit" there
whatever the choices. So its per-range work (each choice's memory at the position's
microbatches in flight, which choices fit, the first of the fastest) runs on the
(L+1)L/2 ranges with i < j, about half of the (L+1)^2 entries, and the picks are laid
into full tables at the end. Each figure is the one `StageCosts.variant` gives the
picked choice (`ChoiceMemory.totals` at the ranges, the stacked times read there).

What a table picks among (each choice's step cost and figures) does not depend on how
many microbatches it holds, nor on its place unless a last stage's measured layers
change its times: only its memory does. So per stage, microbatch, microbatch count and
those times (`_Picks`) the choices' costs and figures are laid out once, flat, after a
first row that stands for
"nothing fits" (a step that never ends, `INF` times, no memory, ZeRO 0, no
recomputation): a table's `argmin` down the costs of the choices that fit then lands on
that row where none does, and every figure of every range is one gather from the flat
rows, blank ones included, instead of a gather, a mask and a `where` each. Its memory
adds parts stacked once per stage, microbatch and place (`ChoiceMemory.range_parts`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from solver.cost.choice_memory import StageCosts, choice_arrays, grid_of, range_totals
from solver.cost.stage_config import StageConfig
from solver.cost.stage_tables import StageTable

INF = float("inf")
_OTHERWISE = np.array([INF, INF, 0.0, 0.0])[:, None]  # forward, backward, tail, sync where nothing fits


class _Picks(NamedTuple):
    """What every table of one stage, microbatch and microbatch count picks from, where
    its times are the same (every place but a last stage's that measured layers price
    apart, `_placed_times`): C choices over R ranges as (C + 1) x R rows, the first
    row's "nothing fits", then the choices in order."""

    cost: np.ndarray  # (C + 1, R): a step of m microbatches per choice (INF first)
    times: np.ndarray  # (4, (C + 1) x R): forward, backward, tail, sync, flat
    zero: np.ndarray  # (C + 1,) int: each row's ZeRO stage
    remat: np.ndarray  # (C + 1,) bool: whether it recomputes
    nan: bool  # whether a step cost is NaN (`argmin` would pick it; `min` and `==` say nothing fits)


def first_least(cost: np.ndarray, nan: bool = True) -> np.ndarray:
    """Per column of `cost` (rows: "nothing fits" at INF, then the choices, INF where one
    does not fit) the row of its first least entry: row 0 where every entry is INF, and
    where a NaN fits too, as `min` then `==` find it (`nan`: whether one may be there;
    without one, `argmin` finds the same row in one pass)."""
    if nan:
        return (cost == cost.min(axis=0)).argmax(axis=0)
    return cost.argmin(axis=0)


class DeviceTables:
    """`StageCosts._table` for stages whose optimizer state no tier may take off the devices."""

    def __init__(self, costs: StageCosts):
        self.costs = costs
        self.shape = costs._choice_memory.shape
        self.ranges = costs._choice_memory.ranges  # [i, j] with i < j, flattened
        self._index = np.arange(len(self.ranges))
        self._rows, self._cols = np.divmod(self.ranges, self.shape[1])  # each range's [i, j]
        size = self.shape[0] * self.shape[1]
        self._blank = np.repeat(_OTHERWISE, size, axis=1)  # a table where nothing fits
        self._spots = (np.arange(4)[:, None] * size + self.ranges).reshape(-1)  # the ranges in each of four tables, flat
        self._picks = lru_cache(maxsize=None)(self._picks_uncached)
        self.plan = lru_cache(maxsize=None)(self._plan_uncached)

    def _plan_uncached(self, cfg: StageConfig) -> tuple[int, tuple[tuple[int, str], ...]] | None:
        """A stage's capacity and the choices its tables pick among where its optimizer state
        stays on the devices (no tier offered, or no room to offload to skips every other
        tier: `StageCosts._table`); None where a table must try the tiers too."""
        costs = self.costs
        tiers, host, disk = costs.offload.tiers(cfg), costs.offload.host_capacity(cfg.kind), costs.offload.nvme_capacity(cfg.kind)
        if tiers[0] == "" and (not host or not disk and all(t == "nvme" for t in tiers[1:])):
            return costs.capacity(cfg.kind), tuple(costs.table_choices(cfg))
        return None

    def table(self, cfg: StageConfig, b: int, held: int, last: bool, m: int, capacity: int,
              choices: tuple[tuple[int, str], ...]) -> StageTable:
        """Per range the first of the fastest choices that fit (`StageCosts._table`'s pick)."""
        costs = self.costs
        picks = self._picks(cfg, b, m, last and bool(costs.measured(cfg, b / cfg.dp)), choices)  # `_table_times`' last stage
        parts = costs._choice_memory.range_parts(cfg, b, last, choices)
        ranges = len(self.ranges)
        totals = np.empty(picks.cost.shape)  # each choice's bytes after none for "nothing fits"
        totals[0] = 0.0
        if parts is None:
            totals[1:] = costs._choice_memory.totals(cfg, b, held, last, list(choices), ranges=True)
        else:
            range_totals(parts, held, totals[1:])
        pick = first_least(np.where(totals <= capacity, picks.cost, INF), picks.nan)
        flat = pick * ranges + self._index  # each range's entry in its picked row, flattened
        four = self._blank.copy()
        four.reshape(-1)[self._spots] = picks.times.take(flat, axis=1).reshape(-1)
        size = self.shape[0] * self.shape[1]
        memory, zero, remat = np.zeros(size), np.zeros(size, dtype=int), np.zeros(size, dtype=bool)
        memory[self.ranges] = totals.take(flat)
        zero[self.ranges] = picks.zero.take(pick)
        remat[self.ranges] = picks.remat.take(pick)
        forward, backward, tail, sync = four.reshape(len(four), *self.shape)
        return StageTable(forward, backward, remat.reshape(self.shape), memory.reshape(self.shape), tail, sync, capacity,
                          zero.reshape(self.shape), np.zeros(self.shape, dtype=int))

    def _picks_uncached(self, cfg: StageConfig, b: int, m: int, placed: bool, choices: tuple[tuple[int, str], ...]) -> _Picks:
        """The choices' step costs and times at the ranges after the nothing-fits row:
        read from each choice's times (`_placed_times`, as `_table_times` stacks them)
        at the ranges alone, not stacked over every [i, j] first, into their rows: from
        the stacks of every ZeRO stage at once (`ChoiceTimes`) where `_placed_times` reads
        them too (a grid of choices, not a last stage's own times, no overlapped data axis).
        `placed`: a last stage's times, where they differ from the others'."""
        costs = self.costs
        times = np.empty((4, len(choices) + 1, len(self.ranges)))
        times[:, 0] = _OTHERWISE
        zeros, remats, grid = grid_of(choices)
        if grid and not placed and not costs.overlapped(cfg):  # every ZeRO stage's times stacked (`ChoiceTimes`)
            self._stacked_times(cfg, b, zeros, remats, times[:, 1:])
        else:
            for c, (zero, remat) in enumerate(choices, 1):
                for k, values in enumerate(costs._placed_times(cfg, b, zero, remat, placed)[:4]):
                    times[k, c] = self._at_ranges(values)
        cost = np.empty(times.shape[1:])
        cost[0] = INF
        np.add(times[0, 1:], times[1, 1:], out=cost[1:])  # m * (forward + backward) + tail, as `_table_times`
        np.multiply(m, cost[1:], out=cost[1:])
        cost[1:] += times[2, 1:]
        zeros, remats = choice_arrays(choices)
        return _Picks(cost, times.reshape(4, -1), np.append(0, zeros), np.append(False, remats), bool(np.isnan(cost).any()))

    def _stacked_times(self, cfg: StageConfig, b: int, zeros: tuple[int, ...], remats: tuple[str, ...],
                       out: np.ndarray) -> None:
        """Each choice's forward, backward, tail and sync at the ranges, into `out` (4, choices,
        ranges), read from the stacks of every ZeRO stage (`ChoiceTimes.stack`, what
        `_placed_times` reads apart) a take each; the choices ZeRO stage major."""
        grid = out.reshape(4, len(zeros), len(remats), len(self.ranges))  # a view: `out` is contiguous per field
        for r, remat in enumerate(remats):
            stack = self.costs._choice_times.stack(cfg, b, zeros, remat)
            for k, values in enumerate((stack.forward, stack.backward, stack.tail, stack.sync)):
                if r and k != 1:  # the forward, tail and sync the same under every recomputation
                    grid[k, :, r] = grid[k, :, 0]
                else:
                    values.reshape(len(zeros), -1).take(self.ranges, axis=1, out=grid[k, :, r])

    def _at_ranges(self, values: np.ndarray | float) -> np.ndarray | float:
        """A figure per [i, j] (an array, a view broadcast to one, or a number) at the ranges
        (`take` the method: `np.take` dispatches for thrice as long)."""
        if isinstance(values, np.ndarray) and values.shape == self.shape:
            return values.take(self.ranges) if values.flags.c_contiguous else values[self._rows, self._cols]
        return values if not isinstance(values, np.ndarray) else np.broadcast_to(values, self.shape)[self._rows, self._cols]
