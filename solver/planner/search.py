"""The planner: the fastest plan that fits, over pipelines that mix device kinds,
data and tensor parallelism inside each stage, microbatch counts and schedules,
and pipelines of different kinds side by side splitting the batch.

The space, per kind used: `k` stages of `dp x tp` devices each, all of the kind's
devices used (`k * dp * tp = count`), tensor parallelism inside a node. A pipeline
is the used kinds in some order, each contributing its `k` stages in a row; layers
are split over that row exactly (`layer_split`). A replica plan runs one such
single-kind pipeline per kind, each on its share of every microbatch, and sums the
gradients across them.

Search is branch and bound: every layout gets a lower bound from its stages' best
seconds per FLOP (no split can beat perfect balance), layouts are scored exactly in
the order of their bounds, and the search stops when the next bound cannot beat the
k-th best plan found. Nothing is sampled or cut off, so the answer is the optimum of
the model.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from solver.collectives import Topology, best
from solver.planner.layer_split import best_split, score
from solver.planner.problem import PlanChoice, PlanningError, Problem, SearchResult, StageChoice
from solver.planner.stage_costs import INF, StageConfig, StageCosts, in_flight

log = logging.getLogger(__name__)


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


class Planner:
    def __init__(self, problem: Problem, top_k: int = 5, time_limit_s: float | None = None):
        problem.check()
        self.problem = problem
        self.time_limit_s = time_limit_s
        self.deadline = INF
        self.unexplored = INF  # the least lower bound of what the time limit left unscored
        self._fitting: dict[tuple[KindLayout, int, int], tuple[int, int]] = {}
        self._capacity: dict[tuple[KindLayout, int], tuple[float, int, float, int]] = {}
        self.costs = StageCosts(problem)
        self.top_k = top_k
        self.total_flops = float(self.costs.flops.sum())
        self._single: dict[tuple[str, int, int], tuple[PlanChoice | None, float]] = {}  # and the bound it was searched under

    # --- one pipeline -------------------------------------------------------------

    def pipeline(self, layouts: tuple[KindLayout, ...], m: int, b: int, schedule: str, beat: float = INF) -> PlanChoice | None:
        """The best split of the layers over these stages, if it fits and beats `beat`."""
        configs = [lay.config for lay in layouts for _ in range(lay.stages)]
        if len(configs) > self.costs.n or b < self.problem.min_microbatch or any(
                b % c.dp or b // c.dp < self.problem.min_examples for c in configs):
            return None
        tables = [self.costs.table(c, b, in_flight(schedule, m, p, len(configs))) for p, c in enumerate(configs)]
        sends = [self.costs.sends(a, c, b) for a, c in zip(configs, configs[1:])]
        split = best_split(tables, sends, m, beat, schedule)
        if split is None:
            return None
        return self._pipeline_choice(configs, tables, sends, m, b, schedule, split.cuts, split.objective_s)

    def fixed_split(self, configs: list[StageConfig], m: int, b: int, schedule: str, cuts: tuple[int, ...]) -> PlanChoice | None:
        """A given split over given stages, scored by the same model (for baselines)."""
        if any(b % c.dp for c in configs):
            return None
        tables = [self.costs.table(c, b, in_flight(schedule, m, p, len(configs))) for p, c in enumerate(configs)]
        sends = [self.costs.sends(a, c, b) for a, c in zip(configs, configs[1:])]
        value = score(tables, sends, m, cuts, schedule)
        return None if value == INF else self._pipeline_choice(configs, tables, sends, m, b, schedule, cuts, value)

    def _pipeline_choice(self, configs, tables, sends, m: int, b: int, schedule: str, cuts, objective: float) -> PlanChoice:  # noqa: ANN001
        bounds = list(zip([0, *cuts], [*cuts, self.costs.n]))
        stages = tuple(
            StageChoice(
                c.kind, c.dp, c.tp, i, j, bool(t.remat[i, j]), float(t.forward[i, j]), float(t.backward[i, j]),
                float(sends[p][j]) if p < len(sends) else 0.0, float(t.sync[i, j]), float(t.tail[i, j] - t.sync[i, j]),
                int(t.memory[i, j]), t.capacity,
            )
            for p, (c, t, (i, j)) in enumerate(zip(configs, tables, bounds))
        )
        return self._choice(stages, m, schedule, objective, (b * m,))

    def _choice(self, stages: tuple[StageChoice, ...], m: int, schedule: str, step_s: float, batch: tuple[int, ...], cross: float = 0.0) -> PlanChoice:
        p = self.problem
        examples = sum(batch)
        peak = sum(s.devices * (p.kind(s.kind).peak_flops or p.kind(s.kind).flops) for s in stages)
        return PlanChoice(
            stages, m, schedule, step_s, batch, cross, examples * p.tokens_per_example, self.total_flops * examples, peak,
        )

    # --- bounds ---------------------------------------------------------------------

    def stage_capacity(self, layout: KindLayout, b: int) -> tuple[float, int, float, int]:
        """(least seconds per layer, most layers that fit) of one of these stages,
        without and with rematerialization, over the best case of every layer and
        position (one microbatch in flight): no split can do better than a stage
        holding n layers in n times the least layer time."""
        if (layout, b) not in self._capacity:
            self._capacity[(layout, b)] = self._stage_capacity(layout, b)
        return self._capacity[(layout, b)]

    def _stage_capacity(self, layout: KindLayout, b: int) -> tuple[float, int, float, int]:
        kind, p = self.problem.kind(layout.kind), self.problem
        per_device = b / layout.dp
        comm = self.costs._tp_allreduce(kind, layout.tp, self.costs.tp_bytes * per_device)
        time = self.costs.flops * per_device / (layout.tp * kind.flops) + 2 * comm + kind.layer_overhead_s
        recompute = self.costs.fwd_flops * per_device / (layout.tp * kind.flops) + comm
        state = self.costs.params * p.state_factor / layout.tp
        shard = per_device / layout.tp
        capacity = kind.memory_bytes * (1 - p.memory_reserve)
        most = int(min(capacity // max(float((state + self.costs.saved * shard).min()), 1.0), self.costs.n))
        most_remat = int(min(capacity // max(float((state + self.costs.inputs * shard).min()), 1.0), self.costs.n))
        return float(time.min()), most, float((time + recompute).min()), most_remat if p.allow_remat else 0

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
        fitting = np.array([self._layers_fitting(lay, b, in_flight(schedule, m, p, len(stages))) for p, lay in enumerate(stages)])
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
        key = (layout, b, in_flight_count)
        if key not in self._fitting:
            p, kind = self.problem, self.problem.kind(layout.kind)
            shard = b / layout.dp / layout.tp
            state = self.costs.params * p.state_factor / layout.tp
            capacity = kind.memory_bytes * (1 - p.memory_reserve)
            whole = float((state + self.costs.saved * shard * in_flight_count).min())
            inputs = float((state + self.costs.inputs * shard * in_flight_count).min())
            self._fitting[key] = (int(min(capacity // max(whole, 1.0), self.costs.n)),
                                  int(min(capacity // max(inputs, 1.0), self.costs.n)) if p.allow_remat else 0)
        return self._fitting[key]

    # --- the search -----------------------------------------------------------------

    def solve(self) -> SearchResult:
        started = time.perf_counter()
        if self.time_limit_s is not None:
            self.deadline = started + self.time_limit_s
        found = self._search(tuple(k.name for k in self.problem.kinds), self.top_k)
        if self.problem.allow_replicas and len(self.problem.kinds) > 1:
            if time.perf_counter() < self.deadline:
                found = sorted(found + self._replica_plans(found[-1].step_s if len(found) >= self.top_k else INF), key=lambda c: c.step_s)
            else:
                self.unexplored = min(self.unexplored, self._replica_floor())
        if not found:
            if self.unexplored < INF:
                raise PlanningError(f"no plan found within the time limit of {self.time_limit_s} s; allow more time")
            raise PlanningError(self._why_nothing_fits())
        self.deadline = INF  # the bound's own searches run to the end
        per_kind = tuple((k.name, (self._search((k.name,), 1) or [None])[0]) for k in self.problem.kinds)
        bound = sum(c.throughput for _, c in per_kind if c is not None)
        gap = max(0.0, 1 - self.unexplored / found[0].step_s) if self.unexplored < INF else 0.0
        result = SearchResult(found[0], tuple(found[1 : self.top_k]), bound, time.perf_counter() - started,
                              tuple((name, c.throughput if c else 0.0) for name, c in per_kind), gap)
        if gap > 0:
            log.warning("the planner stopped at its time limit of %s s: the best plan found may be up to %.1f%% slower "
                        "than the best possible; allow more time to close the gap", self.time_limit_s, 100 * gap)
        log.info("planned in %.2f s: %s (%.1f%% of the bound)", result.search_s, result.best.describe(), 100 * result.bound_ratio)
        return result

    def _replica_floor(self) -> float:
        """No replica plan beats perfect use of every device plus the cheapest gradient sum."""
        p = self.problem
        ideal = self.total_flops * p.batch_size / sum(k.count * k.flops for k in p.kinds)
        names = [k.name for k in p.kinds]
        return ideal + min(self._cross_sync(s) for r in range(2, len(names) + 1) for s in itertools.combinations(names, r))

    def _search(self, kinds: tuple[str, ...], top_k: int, batch: int | None = None, beat: float = INF) -> list[PlanChoice]:
        """The `top_k` best single pipelines over any ordered subset of `kinds` that
        take less than `beat`."""
        p = self.problem
        batch = batch or p.batch_size
        per_kind = {name: kind_layouts(p, name) for name in kinds}
        candidates = []
        for m in p.microbatch_counts():
            if batch % m:
                continue
            b = batch // m
            for r in range(1, len(kinds) + 1):
                for subset in itertools.combinations(kinds, r):
                    for layouts in itertools.product(*(per_kind[name] for name in subset)):
                        if sum(lay.stages for lay in layouts) > len(p.layers):
                            continue
                        if any(b % lay.dp or b // lay.dp < p.min_examples for lay in layouts):
                            continue
                        lower = self.bound(layouts, m, b)
                        if lower < INF:
                            candidates.append((lower, m, layouts))
        # Branch and bound with lazily tightened bounds: a layout's first bound ignores
        # where its stages sit; when it reaches the front it is re-bounded per order of
        # its kinds (activations in flight depend on the position) and goes back in line.
        queue = [(lower, i, m, layouts, None) for i, (lower, m, layouts) in enumerate(candidates)]
        heapq.heapify(queue)
        heap: list[tuple[float, int, PlanChoice]] = []  # the top_k best, worst on top (negated)
        counter = itertools.count(len(queue))
        schedules = ["1f1b"] if "1f1b" in p.schedules else list(p.schedules)
        while queue:
            lower, _, m, layouts, orders = heapq.heappop(queue)
            worst = -heap[0][0] if len(heap) >= top_k else beat
            if lower >= worst:
                break
            if heap and time.perf_counter() > self.deadline:  # the limit never leaves a user without a plan
                self.unexplored = min(self.unexplored, lower)
                break
            b = batch // m
            if orders is None:
                ranked = [(self.order_bound(order, m, b, schedules[0], worst), i, order) for i, order in enumerate(self._orders(layouts))]
                orders = [(bound, order) for bound, _, order in sorted(ranked)]
                if orders and orders[0][0] < INF:
                    heapq.heappush(queue, (orders[0][0], next(counter), m, layouts, orders))
                continue
            for order_lower, order in orders:
                for schedule in schedules:
                    worst = -heap[0][0] if len(heap) >= top_k else beat
                    if order_lower >= worst:
                        break
                    plan = self.pipeline(order, m, b, schedule, beat=worst)
                    if plan is not None:
                        heapq.heappush(heap, (-plan.step_s, next(counter), plan))
                        if len(heap) > top_k:
                            heapq.heappop(heap)
        return sorted((c for _, _, c in heap), key=lambda c: c.step_s)

    def _orders(self, layouts: tuple[KindLayout, ...]) -> list[tuple[KindLayout, ...]]:
        """Every order, slower kinds first first: early stages hold the most
        microbatches in flight and the fastest kinds are best kept for the most layers,
        so good plans come early and prune the rest."""
        speed = {lay.kind: self.problem.kind(lay.kind).flops for lay in layouts}

        def inversions(order: tuple[KindLayout, ...]) -> int:
            return sum(speed[a.kind] > speed[b.kind] for i, a in enumerate(order) for b in order[i + 1 :])

        return sorted(set(itertools.permutations(layouts)), key=lambda o: (inversions(o), [lay.kind for lay in o]))

    # --- pipelines of different kinds side by side ------------------------------------

    def _replica_plans(self, beat: float) -> list[PlanChoice]:
        """Each kind its own pipeline on a share of every microbatch; the shares are
        searched on a grid of at most `replica_units` steps per microbatch."""
        p = self.problem
        out: list[PlanChoice] = []
        names = [k.name for k in p.kinds]
        for m in p.microbatch_counts():
            per_mb = p.batch_size // m
            step = max(1, math.ceil(per_mb / p.replica_units))
            for r in range(2, len(names) + 1):
                for subset in itertools.combinations(names, r):
                    cross = self._cross_sync(subset)
                    ideal = self.total_flops * p.batch_size / sum(p.kind(k).count * p.kind(k).flops for k in subset)
                    if cross + ideal >= beat:
                        continue  # even perfect use of these devices would not beat the best found
                    plan = self._best_shares(subset, m, per_mb, step, cross, beat)
                    if plan is not None:
                        out.append(plan)
                        beat = min(beat, plan.step_s) if len(out) >= self.top_k else beat
        return out

    def _single_kind(self, kind: str, m: int, b: int, beat: float = INF) -> PlanChoice | None:
        """The best pipeline of one kind on `b` examples per microbatch; None when none
        fits or none beats `beat` (which only falls as the search goes on, so a None
        stays true)."""
        key = (kind, m, b)
        plan, searched_below = self._single.get(key, (None, -INF))
        if plan is None and searched_below < beat:
            plans = self._search((kind,), 1, batch=b * m, beat=beat)
            plan = plans[0] if plans else None
            self._single[key] = (plan, beat)
        return plan

    def _best_shares(self, kinds: tuple[str, ...], m: int, per_mb: int, step: int, cross: float, beat: float) -> PlanChoice | None:
        """The split of each microbatch's `per_mb` examples over the kinds' pipelines
        with the least slowest pipeline. Small grids are enumerated; larger ones are
        balanced by bisection on the step time, which assumes a pipeline never gets
        faster with more examples (true up to which data-parallel degrees divide them)."""
        grid = list(range(step, per_mb, step))
        if len(grid) <= 16:
            splits = (s for s in itertools.product(grid, repeat=len(kinds) - 1) if per_mb - sum(s) >= 1)
            choices = ((*s, per_mb - sum(s)) for s in splits)
        else:
            choices = [self._balanced(kinds, m, per_mb, grid)]
        best_plan, best_value = None, beat
        for shares in choices:
            if shares is None:
                continue
            parts = []
            for kind, b in zip(kinds, shares):
                plan = self._single_kind(kind, m, b, beat - cross)
                if plan is None or plan.step_s + cross >= best_value:
                    break
                parts.append(plan)
            else:
                best_value = max(c.step_s for c in parts) + cross
                stages = tuple(StageChoice(**{**s.__dict__, "replica": r}) for r, c in enumerate(parts) for s in c.stages)
                best_plan = self._choice(stages, m, parts[0].schedule, best_value, tuple(c.replica_batch[0] for c in parts), cross)
        return best_plan

    def _balanced(self, kinds: tuple[str, ...], m: int, per_mb: int, grid: list[int]) -> tuple[int, ...] | None:
        """Shares in proportion to each kind's throughput on the whole microbatch (a
        pipeline twice as fast takes twice the examples), then moved one grid step at
        a time from the slowest pipeline to the fastest while that shortens the step."""
        step = grid[0]

        def time_of(kind: str, b: int) -> float:
            plan = self._single_kind(kind, m, b) if b >= 1 else None
            return plan.step_s if plan else INF

        rates = [per_mb / time_of(k, per_mb) if time_of(k, per_mb) < INF else 0.0 for k in kinds]
        if not all(rates):
            return None
        shares = [max(step, round(per_mb * r / sum(rates) / step) * step) for r in rates]
        shares[int(np.argmax(rates))] += per_mb - sum(shares)
        if min(shares) < 1:
            return None
        for _ in range(len(grid)):
            times = [time_of(k, b) for k, b in zip(kinds, shares)]
            slow, fast = int(np.argmax(times)), int(np.argmin(times))
            if slow == fast or shares[slow] - step < 1:
                break
            moved = list(shares)
            moved[slow] -= step
            moved[fast] += step
            if max(time_of(k, b) for k, b in zip(kinds, moved)) >= max(times):
                break
            shares = moved
        return tuple(shares)

    def _cross_sync(self, kinds: tuple[str, ...]) -> float:
        """Summing every gradient across the replicas: a ring over the slowest link
        between their kinds, one stream per device of the smallest replica."""
        p = self.problem
        link = min((p.link(a, b) for a, b in itertools.combinations(kinds, 2)), key=lambda c: c.bandwidth)
        streams = min(p.kind(k).count for k in kinds)
        nbytes = float(self.costs.params.sum()) / streams
        return best("all_reduce", Topology(1, len(kinds), link, link), nbytes)[1]

    # --- when nothing fits ------------------------------------------------------------

    def _why_nothing_fits(self) -> str:
        p = self.problem
        need = float(self.costs.params.sum()) * p.state_factor
        have = sum(k.count * k.memory_bytes * (1 - p.memory_reserve) for k in p.kinds)
        gib = 2**30
        if need > have:
            return (f"no plan fits: parameters, gradients and optimizer state need {need / gib:.1f} GiB and the cluster has "
                    f"{have / gib:.1f} GiB in all; add devices (at least {math.ceil(need / have * sum(k.count for k in p.kinds))} "
                    "like these in all) or use a smaller model")
        fixes = []
        if not p.allow_remat:
            fixes.append("allow rematerialization")
        if max(p.microbatch_counts()) < p.batch_size:
            fixes.append("allow more microbatches (smaller microbatches keep fewer activations)")
        fixes += ["add devices", "use a smaller batch"]
        return (f"no plan fits in memory: the state fits in the cluster's {have / gib:.1f} GiB, but no split of the layers keeps "
                f"every device's state and activations within its memory; to fit: {', '.join(fixes)}")


def plan(problem: Problem, top_k: int = 5, time_limit_s: float | None = None) -> SearchResult:
    """The best plan for `problem` and the next `top_k - 1`. With a time limit, the
    best found by then, and (in `gap`) how much faster the best possible might be."""
    return Planner(problem, top_k, time_limit_s).solve()
