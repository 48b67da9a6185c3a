"""How many layers a stage of a layout holds, per count of microbatches in flight:
the memory half of the planner's lower bounds (`bounds.py`), kept apart from their
times. A layout meets every microbatch size, and an order asks each position's count,
so each layout's counts are priced in one array pass (`rows.layers_fitting`), a
kind's layouts at once (`all`: the bounds keep them in their table per size,
`LowerBounds._layout_rows`), not as an entry per count."""

from __future__ import annotations

import numpy as np

from solver.cost.stage_costs import StageCosts
from solver.planner.layouts import KindLayout
from solver.planner.problem import Problem
from solver.planner.rows import layers_fitting


class LayoutFits:
    """`LowerBounds`' fitting figures, kept for its lifetime."""

    def __init__(self, problem: Problem, costs: StageCosts):
        self.problem = problem
        self.costs = costs
        self._one: dict[tuple[KindLayout, int, int], tuple[int, int]] = {}
        self._tables: dict[tuple[KindLayout, int], np.ndarray] = {}
        self._memory: dict[KindLayout, tuple[int, np.ndarray]] = {}

    def one(self, layout: KindLayout, b: int, in_flight_count: int) -> tuple[int, int]:
        """The most layers a stage holds with this many microbatches in flight,
        keeping every activation or (full recomputation, solver.memory) only its input
        per microbatch and one microbatch's activations: capacity over the least bytes
        any one layer needs, under the ZeRO stage that shards the most."""
        key = (layout, b, in_flight_count)
        if key not in self._one:
            self._one[key] = tuple(self.table(layout, b, in_flight_count)[in_flight_count - 1].tolist())
        return self._one[key]

    def kind(self, layouts: tuple[KindLayout, ...], b: int) -> np.ndarray:
        """[layout, 2]: `one` of each of a kind's layouts at one microbatch in flight (a
        set's bound reads each), in one pass."""
        fits = self.all(layouts, b, range(1, 2))[:, 0]
        self._one.update(zip([(lay, b, 1) for lay in layouts], map(tuple, fits.tolist())))
        return fits

    def table(self, layout: KindLayout, b: int, most: int) -> np.ndarray:
        """[count - 1, 2]: `one` of a layout at each count of microbatches in flight, up
        to `most` at least (and to the layers: an order asks each count up to its stages')."""
        table = self._tables.get((layout, b))
        if table is None or len(table) < most:
            table = self._tables[layout, b] = self.all((layout,), b, range(1, max(most, self.costs.n) + 1))[0]
        return table

    def all(self, layouts: tuple[KindLayout, ...], b: int, counts: range) -> np.ndarray:
        """[layout, count, 2]: `one` of each of `layouts` at each count of microbatches
        in flight, in one array pass. The state per layer is the stage's whatever its
        microbatch (`memory`); the activations scale with its examples per device, as
        `StageCosts.per_layer` scales them."""
        c, p = self.costs, self.problem
        memory = [self.memory(lay, b) for lay in layouts]
        return layers_fitting([cap for cap, _ in memory], np.array([state for _, state in memory]),
                              c.saved, c.inputs, c.recomputed, np.array([b / lay.dp / lay.tp for lay in layouts]),  # per_layer's shard
                              np.array(counts), not p.force_remat, p.allow_remat or p.force_remat)

    def memory(self, layout: KindLayout, b: int) -> tuple[int, np.ndarray]:
        """A layout's bytes per device (`StageCosts.capacity`) and
        `StageCosts.per_layer(layout.config, ...).state`, the same at every microbatch
        size: read at the first asked (`b`), kept per layout."""
        if layout not in self._memory:
            self._memory[layout] = self.costs.capacity(layout.kind), self.costs.per_layer(layout.config, b).state
        return self._memory[layout]
