"""Lower bounds on the step time of a stage layout, before any split is tried.

The planner scores layouts in the order of these bounds and stops when the next
bound cannot beat the plans it has, so the tighter they are, the fewer exact splits
it computes. Each is valid for every split and every order it covers: no stage
holds more whole layers than fit its memory beside the activations in flight, or
more than the bottleneck time allows at its least time per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.planner.problem import Problem
from solver.planner.stage_costs import INF, StageConfig, StageCosts, in_flight


@dataclass(frozen=True)
class KindLayout:
    """How one kind's devices form stages."""

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
        c = np.array([caps[lay][0] for lay in stages])
        cr = np.array([caps[lay][2] for lay in stages])
        fitting = np.array([self._layers_fitting(lay, b, in_flight(schedule, m, p, len(stages)) if p < len(stages) - 1 else 1)
                            for p, lay in enumerate(stages)])  # the last stage holds one microbatch (solver.memory)
        n, nr = fitting[:, 0], fitting[:, 1]
        layers = self.costs.n
        if np.maximum(n, nr).sum() < layers:
            return INF

        def room(t: float) -> np.ndarray:
            if t == INF:
                return np.maximum(n, nr)
            return np.maximum(np.minimum(np.floor(t / c * (1 + 1e-12)), n), np.minimum(np.floor(t / cr * (1 + 1e-12)), nr))

        rates = np.where(n >= 1, c, cr)
        by_rate = np.argsort(rates, kind="stable")
        sorted_rates = rates[by_rate]

        def least_sum(t: float) -> float:
            extra = (room(t) - 1)[by_rate]
            if extra.min() < 0 or extra.sum() < layers - len(stages):
                return INF
            before = np.cumsum(extra) - extra
            take = np.clip(layers - len(stages) - before, 0, extra)
            return float(rates.sum() + (take * sorted_rates).sum())

        steps = self._steps(tuple(caps.values()))
        lo, hi = 0, len(steps) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if room(steps[mid]).sum() >= layers else (mid + 1, hi)
        floor_sum, best = least_sum(INF), beat
        for t in steps[lo:]:
            if (m - 1) * t + floor_sum >= best:
                break
            best = min(best, (m - 1) * t + least_sum(t))
        return best

    def _steps(self, caps: tuple[tuple[float, int, float, int], ...]) -> np.ndarray:
        """Every time a stage of these kinds can take for a whole number of layers."""
        layers = np.arange(1, self.costs.n + 1)
        return np.unique(np.concatenate([layers * c for c, _, cr, _ in caps] + [layers * cr for c, _, cr, _ in caps]))

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
                                  most(capacity - float(layer.inputs.min()) * in_flight_count, layer.state + layer.saved)
                                  if p.allow_remat or p.force_remat else 0)
        return self._fitting[key]
