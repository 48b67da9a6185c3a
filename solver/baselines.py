"""The planners hetpar is measured against, built as their authors describe them and
scored by the same cost model as hetpar's own search (`solver.planner`).

- `uniform`: Megatron-LM's layout: every stage the same `dp x tp` devices and the same
  number of layers, kinds in the cluster's order; degrees and microbatches searched.
- `fastest_only`: the best plan on the fastest kind alone, the others idle.
- `flops_proportional`: Megatron's layouts, layers in proportion to each stage's peak
  FLOP/s, without searching the split.
- `metis_like`: Metis (ATC'24): every order of the kinds, stages of power-of-two
  device groups (equal within a kind), each stage's own DP/TP degrees picked by its
  cost, layers balanced by profiled per-layer cost in proportion to stage speed, and
  the best over microbatch counts.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import numpy as np

from solver.planner import PlanChoice, Problem
from solver.planner.search import Planner
from solver.cost.stage_costs import INF, StageConfig


@dataclass(frozen=True)
class BaselineResult:
    name: str
    plan: PlanChoice | None  # None: no plan of this family fits
    search_s: float


def proportional_cuts(layer_costs: np.ndarray, speeds: list[float]) -> tuple[int, ...] | None:
    """Cuts giving each stage layers in proportion to its speed (each at least one)."""
    n, k = len(layer_costs), len(speeds)
    if k > n:
        return None
    target = np.cumsum(speeds)[:-1] / sum(speeds) * layer_costs.sum()
    done = np.cumsum(layer_costs)
    cuts, last = [], 0
    for i, t in enumerate(target):
        cut = int(np.argmin(np.abs(done - t))) + 1
        cut = min(max(cut, last + 1), n - (k - 1 - i))
        cuts.append(cut)
        last = cut
    return tuple(cuts)


def _megatron_layouts(problem: Problem):  # noqa: ANN202
    """(dp, tp) shared by every stage, every device used, kinds in order."""
    tps = set.intersection(*(set(k.tp_degrees(problem.max_tp)) for k in problem.kinds))
    for tp in sorted(tps):
        for dp in range(1, max(k.count for k in problem.kinds) + 1):
            if all(k.count % (dp * tp) == 0 for k in problem.kinds):
                yield [StageConfig(k.name, dp, tp) for k in problem.kinds for _ in range(k.count // (dp * tp))]


def _best_over(planner: Planner, layouts, cuts_for) -> PlanChoice | None:  # noqa: ANN001
    best = None
    problem = planner.problem
    for configs in layouts:
        for m in problem.microbatch_counts():
            b = problem.batch_size // m
            cuts = cuts_for(configs, b)
            if cuts is None:
                continue
            for schedule in problem.schedules:
                choice = planner.fixed_split(configs, m, b, schedule, cuts)
                if choice is not None and (best is None or choice.step_s < best.step_s):
                    best = choice
    return best


def uniform(problem: Problem) -> PlanChoice | None:
    planner = Planner(problem)
    n = len(problem.layers)

    def equal(configs: list[StageConfig], b: int) -> tuple[int, ...] | None:
        k = len(configs)
        return None if k > n else tuple(round(i * n / k) for i in range(1, k))

    return _best_over(planner, _megatron_layouts(problem), equal)


def flops_proportional(problem: Problem) -> PlanChoice | None:
    planner = Planner(problem)

    def by_peak(configs: list[StageConfig], b: int) -> tuple[int, ...] | None:
        return proportional_cuts(planner.costs.flops, [c.devices * problem.kind(c.kind).flops for c in configs])

    return _best_over(planner, _megatron_layouts(problem), by_peak)


def fastest_only(problem: Problem) -> PlanChoice | None:
    fastest = max(problem.kinds, key=lambda k: k.count * k.flops)
    try:
        return Planner(replace(problem, kinds=(fastest,), links=()), top_k=1).solve().best
    except ValueError:
        return None


def metis_like(problem: Problem, time_limit_s: float = 600.0) -> PlanChoice | None:
    planner = Planner(problem)
    deadline = time.perf_counter() + time_limit_s

    def stage_options(kind) -> list[int]:  # noqa: ANN001
        return [s for s in (2**i for i in range(12)) if s <= kind.count and kind.count % s == 0]

    def degrees(kind, size: int, b: int) -> StageConfig | None:  # noqa: ANN001
        """The stage's DP x TP with the least time per layer (Metis ranks them by cost)."""
        options = [StageConfig(kind.name, size // tp, tp) for tp in kind.tp_degrees(problem.max_tp)
                   if size % tp == 0 and b % (size // tp) == 0]
        return min(options, key=lambda c: float(planner.costs.table(c, b, 1).time.diagonal(1).sum()), default=None)

    best = None
    for order in itertools.permutations(problem.kinds):
        for sizes in itertools.product(*(stage_options(k) for k in order)):
            if time.perf_counter() > deadline:
                return best
            for m in problem.microbatch_counts():
                b = problem.batch_size // m
                configs = []
                for kind, size in zip(order, sizes):
                    cfg = degrees(kind, size, b)
                    if cfg is None:
                        break
                    configs += [cfg] * (kind.count // size)
                else:
                    if len(configs) > len(problem.layers):
                        continue
                    speeds = [1 / max(float(planner.costs.table(c, b, 1).time.diagonal(1).sum()), 1e-30) for c in configs]
                    cuts = proportional_cuts(planner.costs.flops, speeds)
                    for schedule in problem.schedules:
                        choice = planner.fixed_split(configs, m, b, schedule, cuts) if cuts else None
                        if choice is not None and (best is None or choice.step_s < best.step_s):
                            best = choice
    return best


BASELINES = {"uniform": uniform, "fastest_only": fastest_only, "flops_proportional": flops_proportional, "metis_like": metis_like}


def run_all(problem: Problem) -> list[BaselineResult]:
    out = []
    for name, fn in BASELINES.items():
        started = time.perf_counter()
        plan = fn(problem)
        out.append(BaselineResult(name, plan, time.perf_counter() - started))
    return out


__all__ = ["BASELINES", "BaselineResult", "INF", "fastest_only", "flops_proportional", "metis_like", "run_all", "uniform"]
