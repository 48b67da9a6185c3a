"""Lower bounds on the step time of a stage layout, before any split is tried.

The planner scores layouts in the order of these bounds and stops when the next
bound cannot beat the plans it has, so the tighter they are, the fewer exact splits
it computes. Each is valid for every split and every order it covers: no stage
holds more whole layers than fit its memory beside the activations in flight, or
more than the bottleneck time allows at its least time per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from solver.planner.problem import Problem
from solver.planner.stage_costs import INF, StageConfig, StageCosts, in_flight


_BLOCK = 16  # candidate step times order_bound prices at once


class KindLayout(NamedTuple):
    """How one kind's devices form stages. (A tuple: the search hashes millions of
    them as cache keys, and a tuple hashes in C.)"""

    kind: str
    stages: int
    dp: int
    tp: int

    @property
    def config(self) -> StageConfig:
        return StageConfig(self.kind, self.dp, self.tp)


def kind_layouts(problem: Problem, kind_name: str) -> list[KindLayout]:
    kind = problem.kind(kind_name)
    out = []
    for tp in kind.tp_degrees(problem.max_tp):
        if kind.count % tp:
            continue
        rest = kind.count // tp
        for k in range(1, min(rest, len(problem.layers)) + 1):
            if rest % k == 0:
                out.append(KindLayout(kind_name, k, rest // k, tp))
    return out


class LowerBounds:
    def __init__(self, problem: Problem, costs: StageCosts):
        self.problem = problem
        self.costs = costs
        self._fitting: dict[tuple[KindLayout, int, int], tuple[int, int]] = {}
        self._capacity: dict[tuple[KindLayout, int], tuple[float, int, float, int]] = {}
        self._step_times: dict[tuple, np.ndarray] = {}
        self._held: dict[tuple[str, int, int], tuple[int, ...]] = {}

    def stage_capacity(self, layout: KindLayout, b: int) -> tuple[float, int, float, int]:
        """(least seconds per layer, most layers that fit) of one of these stages,
        without and with rematerialization, over the best case of every layer and
        position (one microbatch in flight): no split can do better than a stage
        holding n layers in n times the least layer time."""
        if (layout, b) not in self._capacity:
            self._capacity[(layout, b)] = self._stage_capacity(layout, b)
        return self._capacity[(layout, b)]

    def _stage_capacity(self, layout: KindLayout, b: int) -> tuple[float, int, float, int]:
        layer = self.costs.per_layer(layout.config, b)
        time = layer.forward + layer.backward
        most, most_remat = self._layers_fitting(layout, b, 1)
        return float(time.min()), most, float((time + layer.forward).min()), most_remat

    def bound(self, layouts: tuple[KindLayout, ...], m: int, b: int) -> float:
        """No split of any order of these stages is faster than this (inf: none fits):
        the slowest stage takes at least the least T at which the stages, each holding
        min(T // its least layer time, what fits) layers, hold every layer."""
        caps = [(lay.stages, *self.stage_capacity(lay, b)) for lay in layouts]

        def held(t: float) -> int:
            return sum(k * max(min(int(t / c * (1 + 1e-12)), n), min(int(t / cr * (1 + 1e-12)), nr)) for k, c, n, cr, nr in caps)

        if sum(k * max(n, nr) for k, _, n, _, nr in caps) < self.costs.n:
            return INF
        steps = sorted({i * c for _, c, n, cr, nr in caps for i in range(1, n + 1)} |
                       {i * cr for _, c, n, cr, nr in caps for i in range(1, nr + 1)})
        lo, hi = 0, len(steps) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if held(steps[mid]) >= self.costs.n else (mid + 1, hi)
        return (m - 1) * steps[lo] + self.costs.n * min(c for _, c, _, _, _ in caps)

    def order_bound(self, order: tuple[KindLayout, ...], m: int, b: int, schedule: str, beat: float = INF) -> float:
        """`bound` for one order of the kinds, and tighter: each stage holds only as many
        layers as fit beside the activations its position keeps in flight, a stage
        that cannot hold one layer without recomputing pays the recompute, and the
        summed stage times (the pipeline's fill and drain) are at least those of the
        cheapest placement of the layers within the bottleneck. Stops at `beat`: a
        bound that reaches it is as good as exact for pruning."""
        stages = [lay for lay in order for _ in range(lay.stages)]
        caps = {lay: self.stage_capacity(lay, b) for lay in order}
        counts = [lay.stages for lay in order]
        c = np.repeat([caps[lay][0] for lay in order], counts)
        cr = np.repeat([caps[lay][2] for lay in order], counts)
        held = self._in_flight(schedule, m, len(stages))
        fitting = np.array([self._layers_fitting(lay, b, k) for lay, k in zip(stages, held)])
        n, nr = fitting[:, 0], fitting[:, 1]
        layers = self.costs.n
        if np.maximum(n, nr).sum() < layers:
            return INF

        rates = np.where(n >= 1, c, cr)
        by_rate = np.argsort(rates, kind="stable")
        sorted_rates = rates[by_rate]

        budget = layers - len(stages)  # layers beyond one per stage

        def least_sums(rooms: np.ndarray) -> np.ndarray:
            """Per row of `rooms` (the most layers each stage may hold): the least
            summed stage time when each stage holds at least one layer, the extra
            layers going to the fastest rates (inf where the layers do not fit)."""
            extra = (rooms - 1)[:, by_rate]
            before = np.cumsum(extra, axis=1) - extra
            take = np.clip(budget - before, 0, extra)
            sums = rates.sum() + (take * sorted_rates).sum(axis=1)
            return np.where((extra.min(axis=1) < 0) | (extra.sum(axis=1) < budget), INF, sums)

        # Per candidate bottleneck time t: the most layers each stage may hold.
        steps = self._steps(tuple(caps.values()))
        rooms = np.maximum(np.minimum(np.floor(steps[:, None] / c * (1 + 1e-12)), n),
                           np.minimum(np.floor(steps[:, None] / cr * (1 + 1e-12)), nr))
        lo = int(np.argmax(rooms.sum(axis=1) >= layers))  # the least time at which every layer has room
        floor_sum, best = float(least_sums(np.maximum(n, nr)[None, :])[0]), beat
        # From there on, a block of times at a time: a time's bound is (m - 1) t plus
        # its least sum, and once (m - 1) t plus the least sum of all loses to the best
        # so far, no later time can win.
        for start in range(lo, len(steps), _BLOCK):
            ts = steps[start : start + _BLOCK]
            values = (m - 1) * ts + least_sums(rooms[start : start + _BLOCK])
            before = np.minimum.accumulate(np.concatenate(([best], values)))[:-1]  # the best so far, before each t
            losing = np.nonzero((m - 1) * ts + floor_sum >= before)[0]
            if losing.size:
                return float(before[losing[0]])
            best = min(float(before[-1]), float(values[-1]))
        return best

    def _in_flight(self, schedule: str, m: int, num_stages: int) -> tuple[int, ...]:
        """Microbatches each position of a pipeline holds; the last holds one
        (solver.memory)."""
        key = (schedule, m, num_stages)
        if key not in self._held:
            self._held[key] = tuple(in_flight(schedule, m, p, num_stages) for p in range(num_stages - 1)) + (1,)
        return self._held[key]

    def _steps(self, caps: tuple[tuple[float, int, float, int], ...]) -> np.ndarray:
        """Every time a stage of these kinds can take for a whole number of layers."""
        if caps not in self._step_times:
            layers = np.arange(1, self.costs.n + 1)
            self._step_times[caps] = np.unique(np.concatenate([layers * c for c, _, cr, _ in caps] + [layers * cr for c, _, cr, _ in caps]))
        return self._step_times[caps]

    def _layers_fitting(self, layout: KindLayout, b: int, in_flight_count: int) -> tuple[int, int]:
        """The most layers a stage holds with this many microbatches in flight,
        keeping every activation or (full recomputation, solver.memory) only its input
        per microbatch and one microbatch's activations: capacity over the least bytes
        any one layer needs, under the ZeRO stage that shards the most."""
        key = (layout, b, in_flight_count)
        if key not in self._fitting:
            layer = self.costs.per_layer(layout.config, b)
            capacity = self.costs.capacity(layout.kind)

            def most(room: float, per_layer: np.ndarray) -> int:
                return int(min(max(room, 0.0) // max(float(per_layer.min()), 1.0), self.costs.n))

            p = self.problem
            self._fitting[key] = (0 if p.force_remat else most(capacity, layer.state + layer.saved * in_flight_count),
                                  most(capacity - float(layer.inputs.min()) * in_flight_count, layer.state + layer.recomputed)
                                  if p.allow_remat or p.force_remat else 0)
        return self._fitting[key]
