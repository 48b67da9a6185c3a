"""The planner's pipelines side by side: each of two kinds or more runs its own
single-kind pipeline on a share of every microbatch, and the gradients are summed
across them. A mixin of `search.Planner`, kept apart as the one idea it is: which
shares, searched how far, proven lost how early. It uses the planner's `_search` (a
kind's best pipeline on its share), `_choice`, `_fewest_kinds`, its cost tables and
bounds, and `_plain_bound` (the schedule `_search` bounds plain pipelines under)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from solver.cost.stage_costs import INF
from solver.planner.layouts import KindLayout, kind_layouts
from solver.planner.problem import PlanChoice, StageChoice
from solver.planner.shares import every_split_loses, most_share

SHARE_FLOORS = 16  # floors `_shares_lose` may price per replica plan before leaving it to `_best_shares`


class ReplicaSearch:
    """`Planner`'s search of pipelines of different kinds side by side (module docstring)."""

    def _replica_floor(self) -> float:
        """No replica plan beats perfect use of every device plus the cheapest gradient sum."""
        p = self.problem
        ideal = self.work_flops * p.batch_size / sum(k.count * k.flops for k in p.kinds)
        names = [k.name for k in p.kinds]
        return ideal + min(self._cross_sync(s) for r in range(2, len(names) + 1) for s in itertools.combinations(names, r))

    def _replica_plans(self, beat: float) -> list[PlanChoice]:
        """Each kind its own pipeline on a share of every microbatch; the shares are
        searched on a grid of at most `replica_units` steps per microbatch."""
        p = self.problem
        out: list[PlanChoice] = []
        names = [k.name for k in p.kinds]
        for m in p.microbatch_counts():
            per_mb = p.batch_size // m
            step = max(1, math.ceil(per_mb / p.replica_units))
            for r in range(max(2, self._fewest_kinds(tuple(names))), len(names) + 1):
                for subset in itertools.combinations(names, r):
                    cross = self._cross_sync(subset)
                    ideal = self.work_flops * p.batch_size / sum(p.kind(k).count * p.kind(k).flops for k in subset)
                    if cross + ideal >= beat:
                        continue  # even perfect use of these devices would not beat the best found
                    plan = self._best_shares(subset, m, per_mb, step, cross, beat)
                    if plan is not None:
                        out.append(plan)
                        beat = min(beat, plan.step_s) if len(out) >= self.finalists else beat
        return out

    def _shares_lose(self, kinds: tuple[str, ...], m: int, per_mb: int, cross: float, beat: float) -> bool:
        """Whether no split of each microbatch's `per_mb` examples over `kinds`' pipelines
        provably beats `beat` (`shares.every_split_loses`), so `_best_shares` would keep
        none: it keeps no split where some kind's pipeline on its share, plus `cross`,
        reaches `beat`, and that pipeline is no faster than all the kind's devices at
        full speed (`_ideal_s`, which grows with the share) nor than `_share_floor`."""
        if beat == INF:
            return False
        most = [most_share(per_mb, lambda b, k=k: self._ideal_s(k, b * m) + cross < beat) for k in kinds]
        return every_split_loses(per_mb, most, lambda i, b: self._share_floor(kinds[i], m, b) + cross >= beat, SHARE_FLOORS)

    def _share_floor(self, kind: str, m: int, b: int) -> float:
        """No plan `_single_kind(kind, m, b)` returns is faster: its search draws its
        plans from these layouts, whose bounds never go below their `product_floor` (the
        search's own first floor, under its bound schedule; inf where none fits)."""
        key = (kind, m, b)
        if key not in self._share_floors:
            self._share_floors[key] = self.bounds.product_floor([self._usable(kind, b)], m, b, self._plain_bound)
        return self._share_floors[key]

    def _single_kind(self, kind: str, m: int, b: int, beat: float = INF) -> PlanChoice | None:
        """The best pipeline of one kind on `b` examples per microbatch; None when none
        fits or none beats `beat` (which only falls as the search goes on, so a None
        stays true)."""
        key = (kind, m, b)
        plan, searched_below = self._single.get(key, (None, -INF))
        if plan is None and searched_below < beat:
            # Replicas share one schedule and every replica runs the same m.
            plans = self._search((kind,), 1, batch=b * m, beat=beat, interleave=False, counts=(m,))
            plan = plans[0] if plans else None
            self._single[key] = (plan, beat)
        return plan

    def _best_shares(self, kinds: tuple[str, ...], m: int, per_mb: int, step: int, cross: float, beat: float) -> PlanChoice | None:
        """The split of each microbatch's `per_mb` examples over the kinds' pipelines
        with the least slowest pipeline. Small grids are enumerated; larger ones are
        balanced (`_balanced`), which assumes a pipeline never gets faster with more
        examples (true up to which data-parallel degrees divide them). None, before any
        pipeline is searched, where floors prove no split wins (`_shares_lose`), or
        where the balancing would find no rate: a kind with no pipeline on the whole
        microbatch (its search's own first floor there is inf)."""
        grid = list(range(step, per_mb, step))
        if len(grid) > 16 and any(self._share_floor(k, m, per_mb) == INF for k in kinds):
            return None  # `_balanced`'s rates: its layouts' bounds on the whole microbatch are inf too
        if self._shares_lose(kinds, m, per_mb, cross, beat):
            return None  # every split leaves some kind's share too slow
        if len(grid) <= 16:
            splits = [(*s, per_mb - sum(s)) for s in itertools.product(grid, repeat=len(kinds) - 1) if per_mb - sum(s) >= 1]
            # Nearest the split by peak speed first: a good plan found early lets the
            # other splits' searches stop at their first bound.
            speed = np.array([self.problem.kind(k).count * self.problem.kind(k).flops for k in kinds])
            ideal = per_mb * speed / speed.sum()
            choices = sorted(splits, key=lambda shares: float(np.abs(np.array(shares) - ideal).sum()))
        else:
            choices = [self._balanced(kinds, m, per_mb, grid, beat - cross)]
        best_plan, best_value = None, beat
        for shares in choices:
            if shares is None:
                continue
            if max(self._ideal_s(kind, b * m) for kind, b in zip(kinds, shares)) + cross >= best_value:
                continue  # a kind's share alone, at its devices' full speed, takes too long
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

    def _ideal_s(self, kind: str, examples: int) -> float:
        """No pipeline of `kind` runs `examples` per step faster than all its devices
        at full speed: its busiest stage does at least their average work."""
        k = self.problem.kind(kind)
        return self.work_flops * examples / (k.count * k.flops)

    def _balanced(self, kinds: tuple[str, ...], m: int, per_mb: int, grid: list[int], beat: float) -> tuple[int, ...] | None:
        """Shares in proportion to each kind's speed on the whole microbatch by its
        layouts' own bounds (`_layouts_bound`: close under its fastest pipeline, without
        searching for it), then moved one grid step at a time from the slowest pipeline
        to the fastest while that shortens the step. Each pipeline is searched only
        below `beat` (what a share must beat for the plan to win): one that cannot is
        known as slower, not by how much, and steps move off it while the kind taking
        them stays below `beat` (its share shrinks, so its step does not grow). Rates
        found by searching each kind on the whole microbatch, and every share searched
        in full, cost a quarter of the whole solve on 10 layers over 64 and 256 GPUs of
        two kinds, for the same plans."""
        step = grid[0]

        def time_of(kind: str, b: int, below: float = beat) -> float:
            """Its best pipeline's step (inf: none, or none faster than `below`)."""
            plan = self._single_kind(kind, m, b, below) if b >= 1 else None
            return plan.step_s if plan else INF

        floors = [self._layouts_bound(k, m, per_mb) for k in kinds]
        if INF in floors:
            return None
        rates = [per_mb / f for f in floors]
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
            after = [time_of(k, b, min(max(times), beat)) for k, b in zip(kinds, moved)]
            if max(after) >= max(times) and not (times[slow] == INF and max(after[:slow] + after[slow + 1 :]) < INF):
                break
            shares = moved
        return tuple(shares)

    def _layouts_bound(self, kind: str, m: int, b: int) -> float:
        """No pipeline of `kind` on `b` examples per microbatch is faster: the least of
        its layouts' own bounds (each layout's one order, `LowerBounds.sets_order_bounds`,
        as `_search` tightens them), tighter than `_share_floor` (on 10 layers over 64
        GPUs of two kinds 17-31% under the pipelines it bounds, this 0-14%) and a pass
        over its layouts dearer."""
        key = (kind, m, b)
        if key not in self._layout_bounds:
            sets = [(lay,) for lay in self._usable(kind, b)]
            one = self._orders((kind,))  # a lone kind's one order
            lows = self.bounds.sets_order_bounds(sets, one, m, b, self._plain_bound, last=True) if sets else [INF]
            self._layout_bounds[key] = float(np.min(lows))
        return self._layout_bounds[key]

    def _usable(self, kind: str, b: int) -> list[KindLayout]:
        """The kind's layouts that run microbatches of `b` examples (as `_search` draws them)."""
        p = self.problem
        return [lay for lay in kind_layouts(p, kind) if not b % lay.dp and b // lay.dp >= p.min_examples]

    def _cross_sync(self, kinds: tuple[str, ...]) -> float:
        """Summing every gradient across replicas of these kinds, each using all its
        kind's devices (`StageCosts.replica_sync`, what the estimator charges)."""
        return self.costs.replica_sync(kinds, min(self.problem.kind(k).count for k in kinds))
