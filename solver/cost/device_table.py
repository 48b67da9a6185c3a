"""A stage table where the optimizer state stays on the devices (most problems), priced
over the layer ranges that exist alone.

A table's [i, j] entries with i >= j hold no range: the table says "does not fit" there
whatever the choices. So its per-range work (each choice's memory at the position's
microbatches in flight, which choices fit, the first of the fastest) runs on the
(L+1)L/2 ranges with i < j, about half of the (L+1)^2 entries, and the picks are laid
into full tables at the end. Each figure is the one `StageCosts.variant` gives the
picked choice (`ChoiceMemory.totals` at the ranges, the stacked times read there).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from solver.cost.choice_memory import StageCosts, choice_arrays
from solver.cost.stage_config import StageConfig
from solver.cost.stage_tables import StageTable

INF = float("inf")
_OTHERWISE = np.array([INF, INF, 0.0, 0.0])[:, None]  # forward, backward, tail, sync where nothing fits


class DeviceTables:
    """`StageCosts._table` for stages whose optimizer state no tier may take off the devices."""

    def __init__(self, costs: StageCosts):
        self.costs = costs
        self.shape = costs._choice_memory.shape
        self.ranges = costs._choice_memory.ranges  # [i, j] with i < j, flattened
        self._index = np.arange(len(self.ranges))
        self._rows, self._cols = np.divmod(self.ranges, self.shape[1])  # each range's [i, j]
        self._blank = np.repeat(_OTHERWISE, self.shape[0] * self.shape[1], axis=1)  # a table where nothing fits
        self._times = lru_cache(maxsize=None)(self._times_uncached)

    def table(self, cfg: StageConfig, b: int, held: int, last: bool, m: int, capacity: int,
              choices: list[tuple[int, str]]) -> StageTable:
        """Per range the first of the fastest choices that fit (`StageCosts._table`'s pick)."""
        time_cost, times = self._times(cfg, b, m, last)
        totals = self.costs._choice_memory.totals(cfg, b, held, last, choices, ranges=True)
        cost = np.where(totals <= capacity, time_cost, INF)
        least = cost.min(axis=0)  # then the first of the fastest (numpy's argmin down a short axis is slower)
        pick = (cost == least).argmax(axis=0)
        ok = least < INF
        flat = pick * len(self.ranges) + self._index  # each range's entry in its picked row, flattened
        four = self._blank.copy()
        four[:, self.ranges] = np.where(ok, times[:, flat], _OTHERWISE)
        zeros, remats = choice_arrays(tuple(choices))
        size = self.shape[0] * self.shape[1]
        memory, zero, remat = np.zeros(size), np.zeros(size, dtype=int), np.zeros(size, dtype=bool)
        memory[self.ranges] = np.where(ok, totals.reshape(-1)[flat], 0.0)
        zero[self.ranges] = np.where(ok, zeros[pick], 0)
        remat[self.ranges] = remats[pick] & ok
        forward, backward, tail, sync = four.reshape(len(four), *self.shape)
        return StageTable(forward, backward, remat.reshape(self.shape), memory.reshape(self.shape), tail, sync, capacity,
                          zero.reshape(self.shape), np.zeros(self.shape, dtype=int))

    def _times_uncached(self, cfg: StageConfig, b: int, m: int, last: bool) -> tuple[np.ndarray, np.ndarray]:
        """Each choice's cost of a step of `m` microbatches (choices, ranges) and its four
        times (4, choices x ranges, flat: a pick's are one gather), at the ranges: read
        from each choice's times (`_placed_times`, as `_table_times` stacks them) at the
        ranges alone, not stacked over every [i, j] first."""
        costs = self.costs
        choices = costs.table_choices(cfg)
        placed = last and bool(costs.measured(cfg, b / cfg.dp))  # `_table_times`' last stage
        times = np.empty((4, len(choices), len(self.ranges)))
        for c, (zero, remat) in enumerate(choices):
            for k, values in enumerate(costs._placed_times(cfg, b, zero, remat, placed)[:4]):
                times[k, c] = self._at_ranges(values)
        return m * (times[0] + times[1]) + times[2], times.reshape(len(times), -1)

    def _at_ranges(self, values: np.ndarray | float) -> np.ndarray | float:
        """A figure per [i, j] (an array, a view broadcast to one, or a number) at the ranges."""
        if isinstance(values, np.ndarray) and values.shape == self.shape:
            return np.take(values, self.ranges) if values.flags.c_contiguous else values[self._rows, self._cols]
        return values if not isinstance(values, np.ndarray) else np.broadcast_to(values, self.shape)[self._rows, self._cols]
