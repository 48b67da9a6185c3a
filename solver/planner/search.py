"""The planner: the fastest plan that fits, over pipelines that mix device kinds,
data and tensor parallelism inside each stage, microbatch counts and schedules,
and pipelines of different kinds side by side splitting the batch.

The space, per kind used: `k` stages of `dp x tp` devices each, all of the kind's
devices used (`k * dp * tp = count`), tensor parallelism inside a node. A pipeline
is the used kinds in some order, each contributing its `k` stages in a row; layers
are split over that row exactly (`layer_split`). A replica plan runs one such
single-kind pipeline per kind, each on its share of every microbatch, and sums the
gradients across them (`replica_search.py`, the planner's mixin for them).

Search is branch and bound: every layout gets a lower bound (`bounds.py`: first one
computed for a whole product of layouts at once, tightened to the layout's own (with
the product's next few, in one pass) and then per order of kinds as it reaches the front
of the line), layouts are scored
exactly in the order of their bounds, and the search stops when the next bound
cannot beat the k-th best plan found (k: `FINALISTS`, whose closed forms the estimator
then replaces by its simulated step to choose). Pipelines are therefore the model's optimum; replica batch shares
are too on grids of up to 16 steps, and found by proportional split and local
descent beyond. With a time limit, the best plan so far comes back with its gap.

Schedules come from the registry (`solver.schedules`); an interleaved one is tried with
each allowed chunk count, its device groups' chunks splitting the layers in a row
repeated `chunks` times, on every order the search reaches, whichever plans it has
found so far (its own floor, `LowerBounds.interleaved_floor`, refuses most before their
tables). Its splits are close, not proven optimal (`layer_split`), and layouts whose
plain schedules' bounds the search prunes are not tried interleaved: it stays exact for the
plain schedules, and interleaving improves on the pipelines it reaches. An interleaved
plan found is ranked by its simulated step where that is slower than its closed form
(which misses the stalls of uneven chunks). With no plain
schedule allowed every order is tried interleaved, pruned by bounds taken under the
interleaved schedule (`bounds.py`: the work floor only). Where no pipeline shape can run at all (too few layers for the
chunks, no microbatch count the schedule accepts), the error says so rather than
blaming memory.
"""

from __future__ import annotations

import copy
import gc
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, TypeVar
import numpy as np

from solver import schedules as registry
from solver.planner.bounds import LowerBounds
from solver.planner.chunk_memory import chunks_fit, chunks_may_fit
from solver.planner.layouts import KindLayout, kind_layouts
from solver.planner.layer_split import best_split, score
from solver.planner.problem import PlanChoice, PlanningError, Problem, SearchResult, StageChoice
from solver.planner.replica_search import ReplicaSearch
from solver.cost.stage_costs import INF, StageConfig, StageCosts, in_flight
from solver.memory import OFFLOAD_TIERS
from solver.planner.mixed import ranked_to, with_mixed_stages
from solver.planner.no_plan import why_nothing_fits
from solver.planner.step import rank, simulated_step_s

log = logging.getLogger(__name__)
T = TypeVar("T")
# The search's best plans by its closed form (interleaved ones by their simulated step
# where slower) that the estimator ranks: the fewest with which every scenario of
# benchmarks/search_scale.py chooses what ten times as many, and 150, choose (on 64 GPUs
# of two kinds the estimator's choice hides its tails in the drain and the closed form
# ranks it fifth; benchmarks/finalists.py prints how many each scenario needs).
FINALISTS = 5
# A stream's combinations tightened at once when the first of them reaches the front of
# the line (most of the next ones soon do; one array pass prices them all).
_TIGHTEN_AHEAD = 16
_STREAM = None  # a queue entry that stands for a stream's next combination, not yet drawn
_WAITING = object()  # one that stands for a combination tightened to its own bound, its orders not yet bounded


class Planner(ReplicaSearch):
    def __init__(self, problem: Problem, top_k: int = 5, time_limit_s: float | None = None, finalists: int = FINALISTS):
        problem.check()
        self.problem = problem
        self.time_limit_s = time_limit_s
        self.deadline = INF
        self.unexplored = INF  # the least lower bound of what the time limit left unscored
        self.costs = StageCosts(problem)
        self.bounds = LowerBounds(problem, self.costs)
        self.top_k = top_k
        self.finalists = max(top_k, finalists)  # plans the search keeps for the estimator to rank
        self.total_flops = float(self.costs.flops.sum())
        self._plain_bound = _bound_schedule(_schedule_choices(problem, interleave=False))  # replica pipelines' bound schedule
        # FLOPs a device computes per example, at the least (a forward-only function runs no backward)
        self.work_flops = self.total_flops if problem.training else float(self.costs.fwd_flops.sum())
        self._single: dict[tuple[str, int, int], tuple[PlanChoice | None, float]] = {}  # and the bound it was searched under
        self._pipelines: dict[tuple, tuple[PlanChoice | None, float]] = {}  # `pipeline`'s, and the beat it was searched under
        self._share_floors: dict[tuple[str, int, int], float] = {}  # `_share_floor`'s
        self._layout_bounds: dict[tuple[str, int, int], float] = {}  # `_layouts_bound`'s
        self._alone_plans: dict[str, PlanChoice | None] = {}  # `_alone`'s
        self._kind_orders: dict[tuple[str, ...], np.ndarray] = {}  # `_orders`'

    def requiring_every_kind(self, top_k: int = 1) -> Planner:
        """A planner for the same problem whose plans must give every kind work
        (`Problem.use_all_kinds`), sharing this one's stage tables, bounds, pipelines
        and each kind's own best plan: none of them depends on which kinds a plan must
        use, so its search starts from what this one priced (Llama-2-13B on 768 GPUs:
        4.9 s against 8.3 s for a fresh planner, the same plan)."""
        other = copy.copy(self)
        other.problem = replace(self.problem, use_all_kinds=True)
        other.top_k, other.finalists = top_k, max(top_k, self.finalists)
        other.deadline, other.unexplored = INF, INF
        return other

    # --- one pipeline -------------------------------------------------------------

    def pipeline(self, layouts: tuple[KindLayout, ...], m: int, b: int, schedule: str, beat: float = INF,
                 chunks: int = 1) -> PlanChoice | None:
        """The best split of the layers over these stages, if it fits and beats `beat`.
        With `chunks` = v > 1 each stage is a device group holding v chunks: the
        layers are split over the row of stages repeated v times. Remembered: the
        searches for the bound and for replicas meet the same pipelines again (a
        split found is the best whatever the beat; none found stays none below it)."""
        key = (layouts, m, b, schedule, chunks)
        plan, searched_below = self._pipelines.get(key, (None, -INF))
        if plan is not None:
            return plan if plan.step_s < beat else None
        if beat <= searched_below:
            return None
        plan = self._split(layouts, m, b, schedule, beat, chunks)
        self._pipelines[key] = (plan, beat)
        return plan

    def _split(self, layouts: tuple[KindLayout, ...], m: int, b: int, schedule: str, beat: float, chunks: int) -> PlanChoice | None:
        """`pipeline`'s split."""
        groups = [lay.config for lay in layouts for _ in range(lay.stages)]
        configs = groups * chunks
        if len(configs) > self.costs.n or b < self.problem.min_microbatch or any(
                b % lay.dp or b // lay.dp < self.problem.min_examples for lay in layouts):
            return None
        if registry.get(schedule).check(len(groups), m, chunks):
            return None
        if chunks > 1 and self.bounds.interleaved_floor(layouts, m, b, chunks) >= beat:
            return None  # no split's pace could win: refused before the tables of its positions are built
        keys = [(c, b, in_flight(schedule, m, p, len(configs), chunks), p == len(configs) - 1, m) for p, c in enumerate(configs)]
        tables = [self.costs.table(*key) for key in keys]
        if chunks > 1 and not chunks_may_fit(tables, len(groups)):
            return None  # no split fits, so neither would the best one (`chunks_fit` below)
        sends = [self.costs.sends(a, c, b) for a, c in zip(configs, configs[1:])]
        split = best_split(tables, sends, m, beat, schedule, chunks, shared=chunks > 1)
        if split is None or not chunks_fit(tables, split.cuts, len(groups)):
            return None
        plan = self._pipeline_choice(configs, tables, sends, m, b, schedule, split.cuts, split.objective_s, chunks)
        if chunks > 1:  # ranked by its simulation where slower: its form misses uneven chunks' stalls (docstring)
            plan = replace(plan, step_s=max(plan.step_s, simulated_step_s(plan)))
        return plan if plan.step_s < beat else None

    def fixed_split(self, configs: list[StageConfig], m: int, b: int, schedule: str, cuts: tuple[int, ...]) -> PlanChoice | None:
        """A given split over given stages, scored by the same model (for baselines)."""
        if any(b % c.dp for c in configs):
            return None
        tables = [self.costs.table(c, b, in_flight(schedule, m, p, len(configs)), p == len(configs) - 1, m) for p, c in enumerate(configs)]
        sends = [self.costs.sends(a, c, b) for a, c in zip(configs, configs[1:])]
        value = score(tables, sends, m, cuts, schedule)
        return None if value == INF else self._pipeline_choice(configs, tables, sends, m, b, schedule, cuts, value)

    def _pipeline_choice(self, configs, tables, sends, m: int, b: int, schedule: str, cuts, objective: float,  # noqa: ANN001
                         chunks: int = 1) -> PlanChoice:
        bounds = list(zip([0, *cuts], [*cuts, self.costs.n]))
        stages = tuple(
            StageChoice(
                c.kind, c.dp, c.tp, i, j, bool(t.remat[i, j]), float(t.forward[i, j]), float(t.backward[i, j]),
                float(sends[p][j]) if p < len(sends) else 0.0, float(t.sync[i, j]), float(t.tail[i, j] - t.sync[i, j]),
                int(t.memory[i, j]), t.capacity, zero=int(t.zero[i, j]) if t.zero is not None else 0,
                offload=OFFLOAD_TIERS[int(t.offload[i, j])] if t.offload is not None else "",
            )
            for p, (c, t, (i, j)) in enumerate(zip(configs, tables, bounds))
        )
        return self._choice(stages, m, schedule, objective, (b * m,), chunks=chunks)

    def _choice(self, stages: tuple[StageChoice, ...], m: int, schedule: str, step_s: float, batch: tuple[int, ...], cross: float = 0.0,
                chunks: int = 1) -> PlanChoice:
        p = self.problem
        examples = sum(batch)
        peak = sum(s.devices * (p.kind(s.kind).peak_flops or p.kind(s.kind).flops) for s in stages) / chunks
        return PlanChoice(
            stages, m, schedule, step_s, batch, cross, examples * p.tokens_per_example, self.total_flops * examples, peak, chunks,
        )

    # --- the search -----------------------------------------------------------------

    def solve(self) -> SearchResult:
        # The search makes and drops millions of small tuples and arrays, none in a cycle:
        # the collector's passes over everything the process holds (a JAX program's
        # hundreds of thousands of objects) would only slow it, so it pauses meanwhile.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._solve()
        finally:
            if collecting:
                gc.enable()

    def _solve(self) -> SearchResult:
        started = time.perf_counter()
        phases: dict[str, float] = {}  # wall seconds of each part of the solve, as `SearchResult.phases` reports them

        def timed(name: str, part: Callable[[], T]) -> T:
            begun = time.perf_counter()
            out = part()
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - begun
            return out

        if self.time_limit_s is not None:
            self.deadline = started + self.time_limit_s
        found = timed("pipelines", lambda: self._search(tuple(k.name for k in self.problem.kinds), self.finalists))
        if self.problem.allow_replicas and len(self.problem.kinds) > 1:
            if time.perf_counter() < self.deadline:
                beat = found[-1].step_s if len(found) >= self.finalists else INF
                found = sorted(found + timed("replicas", lambda: self._replica_plans(beat)), key=lambda c: c.step_s)
            else:
                self.unexplored = min(self.unexplored, self._replica_floor())
        if not found:
            if self.unexplored < INF:
                raise PlanningError(f"no plan found within the time limit of {self.time_limit_s} s; allow more time")
            raise PlanningError(why_nothing_fits(self.problem, self.costs, _schedule_choices(self.problem)))
        # The finalists by the figure show/simulate report (the estimator's simulated
        # step), not the search's closed form, which is exact for some shapes only.
        finalists = found[: self.finalists]
        # the first `top_k` and what `with_mixed_stages` widens are all that is read of the
        # ranking: plans provably slower than those are not simulated (`rank`'s `exact_to`)
        by_estimate = timed("ranking", lambda: rank(self.problem, finalists, self.costs, lambda ranked: max(
            ranked[self.top_k - 1].step_s if len(ranked) >= self.top_k else INF, ranked_to(self.problem, ranked, finalists))))
        # a stage over idle kinds too, where it wins
        found = timed("mixed stages", lambda: with_mixed_stages(self.problem, by_estimate, self.costs, self.top_k))
        self.deadline = INF  # the bound's own searches run to the end
        per_kind = timed("bound", lambda: tuple((k.name, self._alone(k.name)) for k in self.problem.kinds))
        bound = sum(c.throughput for _, c in per_kind if c is not None)
        gap = max(0.0, 1 - self.unexplored / found[0].step_s) if self.unexplored < INF else 0.0
        result = SearchResult(found[0], tuple(found[1 : self.top_k]), bound, time.perf_counter() - started,
                              tuple((name, c.throughput if c else 0.0) for name, c in per_kind), gap, tuple(phases.items()))
        if gap > 0:
            log.warning("the planner stopped at its time limit of %s s: the best plan found is within %.2fx of the "
                        "best possible step time; allow more time to close the gap", self.time_limit_s,
                        1 / max(1e-9, 1 - gap))
        ratio = result.bound_ratio
        log.info("planned in %.2f s (%s): %s (%s)", result.search_s, result.describe_phases(), result.best.describe(),
                 f"{ratio:.1%} of the bound" if ratio is not None else "no bound: no kind alone fits the model")
        return result

    def _alone(self, kind: str) -> PlanChoice | None:
        """The best plan on `kind`'s devices alone, by the estimator: the bound's part."""
        if kind not in self._alone_plans:
            self._alone_plans[kind] = (rank(self.problem, self._search((kind,), 1), self.costs) or [None])[0]
        return self._alone_plans[kind]

    def _search(self, kinds: tuple[str, ...], top_k: int, batch: int | None = None, beat: float = INF,
                interleave: bool = True, counts: tuple[int, ...] | None = None) -> list[PlanChoice]:
        """The `top_k` best single pipelines over any ordered subset of `kinds` that
        take less than `beat`, with any allowed microbatch count (or one of `counts`),
        without interleaved schedules unless `interleave`."""
        p = self.problem
        batch = batch or p.batch_size
        per_kind = {name: kind_layouts(p, name) for name in kinds}
        schedules = _schedule_choices(p, interleave)
        bound_schedule = _bound_schedule(schedules)
        # Branch and bound with lazily tightened bounds. Each (microbatch count, set of
        # kinds) is a stream of layout combinations sorted by their first bound (a
        # product's, computed for all at once); a combination leaves its stream only
        # when it reaches the front of the line, where it is bounded on its own (still
        # ignoring where its stages sit, with the stream's next few in one pass) and goes
        # back in line; at the front again it is re-bounded per order of its kinds
        # (activations in flight depend on the position), with its stream's others
        # waiting for theirs, and goes back once more. A combination of one kind or two
        # has one order or two: it is bounded per order at once (with its stream's next
        # few), about as dear as the bound that ignores where stages sit and tighter (one
        # kind's: 3-4% off every scenario's search; two kinds': 4% more off two kinds'
        # scenarios, the same plans: `search_ab.py`); three kinds' six orders cost more
        # than that bound saves (`_Stream`).
        streams: list[_Stream] = []
        queue: list[tuple] = []  # (lower bound, tie-break, m, (stream, position) or layouts, _STREAM, _WAITING or orders)
        counter = itertools.count()
        counts = [m for m in counts or p.microbatch_counts() if not batch % m]
        self.bounds.price_runs((lay, batch // m) for m in counts for lays in per_kind.values() for lay in lays
                               if not batch // m % lay.dp)
        for m in counts:
            b = batch // m
            usable = {name: [lay for lay in per_kind[name] if not b % lay.dp and b // lay.dp >= p.min_examples] for name in kinds}
            for r in range(self._fewest_kinds(kinds), len(kinds) + 1):
                for subset in itertools.combinations(kinds, r):
                    lists = [usable[name] for name in subset]
                    # The product's table waits until its floor reaches the front of the line
                    # (most never do); its first combination then takes the floor's place
                    # and tie-break, so the line's order is the one the tables would give.
                    floor = self.bounds.product_floor(lists, m, b, bound_schedule)
                    if floor < beat:
                        streams.append(_Stream(lists))
                        queue.append((floor, next(counter), m, (len(streams) - 1, -1), _STREAM))
        heapq.heapify(queue)
        heap: list[tuple[float, int, PlanChoice]] = []  # the top_k best, worst on top (negated)

        def in_line(lower: float, m: int, layouts: tuple[KindLayout, ...], perms: np.ndarray, lows: np.ndarray) -> None:
            """A combination back in line with its orders (`perms`) ranked by their bounds (`lows`)."""
            orders = [(float(lows[i]), tuple(layouts[j] for j in perms[i])) for i in np.argsort(lows, kind="stable")]
            if orders[0][0] < INF:
                heapq.heappush(queue, (max(orders[0][0], lower), next(counter), m, layouts, orders))

        while queue:
            lower, tie, m, layouts, orders = heapq.heappop(queue)
            worst = -heap[0][0] if len(heap) >= top_k else beat
            if lower >= worst:
                break
            if heap and time.perf_counter() > self.deadline:  # the limit never leaves a user without a plan
                self.unexplored = min(self.unexplored, lower)
                break
            b = batch // m
            if orders is _STREAM:  # the stream's next combination: tighten to the layout's own bound
                stream, position = layouts
                line = streams[stream]
                if position < 0:  # its floor: price the product now
                    lower, index = self.bounds.product_table(line.lists, m, b, bound_schedule)
                    chosen = np.nonzero(lower < beat)[0]
                    if chosen.size:
                        chosen = chosen[np.argsort(lower[chosen], kind="stable")]
                        line.lows, line.index = lower[chosen], index[:, chosen]
                        heapq.heappush(queue, (float(lower[chosen[0]]), tie, m, (stream, 0), _STREAM))
                    continue
                if position + 1 < len(line.lows):
                    heapq.heappush(queue, (float(line.lows[position + 1]), next(counter), m, (stream, position + 1), _STREAM))
                if len(line.lists) <= 2:  # one or two orders: theirs at once (a set's bound is looser and as dear)
                    layouts = line.layouts(position)
                    perms = self._orders(tuple(lay.kind for lay in layouts))
                    if position not in line.ordered:
                        ahead = range(position, min(position + _TIGHTEN_AHEAD, len(line.lows)))
                        line.ordered.update(zip(ahead, self.bounds.sets_order_bounds(
                            [line.layouts(p) for p in ahead], perms, m, b, bound_schedule, worst, last=True)))
                    in_line(lower, m, layouts, perms, line.ordered.pop(position))
                    continue
                if position not in line.tight:  # this and the stream's next few, tightened together
                    ahead = range(position, min(position + _TIGHTEN_AHEAD, len(line.lows)))
                    line.tight.update(zip(ahead, self.bounds.set_bounds([line.layouts(p) for p in ahead], m, b, bound_schedule)))
                tighter = max(float(line.tight.pop(position)), lower)
                if tighter < INF:
                    heapq.heappush(queue, (tighter, next(counter), m, (stream, position), _WAITING))
                    line.waiting[position] = tighter
                continue
            if orders is _WAITING:  # its orders' bounds, with those of its stream's others waiting for theirs
                stream, position = layouts
                line = streams[stream]
                layouts = line.layouts(position)
                perms = self._orders(tuple(lay.kind for lay in layouts))
                if position not in line.ordered:
                    todo = [p for p, key in line.waiting.items() if key < worst]
                    line.ordered.update(zip(todo, self.bounds.sets_order_bounds([line.layouts(p) for p in todo], perms, m, b,
                                                                                bound_schedule, worst, last=True)))
                    for p in todo:
                        del line.waiting[p]
                in_line(lower, m, layouts, perms, line.ordered.pop(position))
                continue
            for order_lower, order in orders:
                for schedule, chunks in schedules:
                    worst = -heap[0][0] if len(heap) >= top_k else beat
                    if chunks == 1 and order_lower >= worst:
                        continue
                    # (interleaved: not held to the plain schedules' bound, which its shorter fill can beat)
                    plan = self.pipeline(order, m, b, schedule, beat=worst, chunks=chunks)
                    if plan is not None:
                        heapq.heappush(heap, (-plan.step_s, next(counter), plan))
                        if len(heap) > top_k:
                            heapq.heappop(heap)
        return sorted((c for _, _, c in heap), key=lambda c: c.step_s)

    def _fewest_kinds(self, kinds: tuple[str, ...]) -> int:
        """How many of `kinds` a plan must use: all of them when the problem asks that
        every kind work and these are all its kinds, else one."""
        return len(kinds) if self.problem.use_all_kinds and len(kinds) == len(self.problem.kinds) else 1

    def _orders(self, kinds: tuple[str, ...]) -> np.ndarray:
        """Every order of a combination of one layout of each of `kinds` (a row each:
        the positions in the combination), slower kinds first first: early stages hold
        the most microbatches in flight and the fastest kinds are best kept for the
        most layers, so good plans come early and prune the rest."""
        if kinds not in self._kind_orders:
            speed = [self.problem.kind(k).flops for k in kinds]

            def inversions(order: tuple[int, ...]) -> int:
                return sum(speed[a] > speed[b] for i, a in enumerate(order) for b in order[i + 1 :])

            self._kind_orders[kinds] = np.array(sorted(itertools.permutations(range(len(kinds))),
                                                       key=lambda o: (inversions(o), [kinds[i] for i in o])))
        return self._kind_orders[kinds]


@dataclass
class _Stream:
    """One (microbatch count, set of kinds)'s combinations of layouts, one of each
    kind's (`lists`), in `_search`'s line: their first bounds ascending (`lows`) and
    each one's layout indices (`index`, a column each), priced when the product's floor
    reaches the front; per position, the combinations tightened to their own bound
    (`tight`), those at the front again waiting for their orders' bounds with that
    bound (`waiting`), and the orders' bounds priced with another's (`ordered`; a
    stream of one or two kinds', priced ahead in place of `tight`).
    Bounding the orders of all of a stream's waiting combinations in one pass (on 64
    GPUs of three kinds a pass per combination cost a third of the search) stays
    lazy: bounding every order of each combination tightened ahead bounded 3.6 times
    the stages on Llama-2-13B over 768 GPUs, and its search took 45% longer (tried
    again on this search: the same plan, its two searches 9.5 and 6.0 s against 7.5 and
    3.4 s, one run each)."""

    lists: list[list[KindLayout]]
    lows: np.ndarray = field(default_factory=lambda: np.zeros(0))
    index: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=int))
    tight: dict[int, float] = field(default_factory=dict)
    waiting: dict[int, float] = field(default_factory=dict)
    ordered: dict[int, np.ndarray] = field(default_factory=dict)

    def layouts(self, position: int) -> tuple[KindLayout, ...]:
        return tuple(lays[i] for lays, i in zip(self.lists, self.index[:, position]))


def _schedule_choices(problem: Problem, interleave: bool = True) -> list[tuple[str, int]]:
    """(schedule, chunks) pairs worth trying, in the registry's order: a schedule
    another allowed one dominates is left out; an interleaved one is tried with each
    allowed chunk count."""
    out = []
    for name in problem.schedules:
        schedule = registry.get(name)
        if schedule.dominated_by in problem.schedules:
            continue
        if schedule.interleaved:
            out += [(name, c) for c in problem.chunks if c > 1] if interleave else []
        else:
            out.append((name, 1))
    return out or [(problem.schedules[0], 1)]


def _bound_schedule(schedules: list[tuple[str, int]]) -> str:
    """The schedule a search's bounds are taken under: its first plain one, else its first."""
    return next((name for name, chunks in schedules if chunks == 1), schedules[0][0])


def plan(problem: Problem, top_k: int = 5, time_limit_s: float | None = None, finalists: int = FINALISTS) -> SearchResult:
    """The best plan for `problem` and the next `top_k - 1`, of the `finalists` best by
    the search's closed form ranked by the estimator. With a time limit, the
    best found by then, and (in `gap`) how much faster the best possible might be."""
    return Planner(problem, top_k, time_limit_s, finalists).solve()
