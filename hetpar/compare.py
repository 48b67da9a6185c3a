"""The planner's choice beside configurations fixed by hand and the best plan on
each device kind alone, all priced by one cost model on one problem (`hetpar solve
--compare`, `hetpar.compare_plans`): "what would Megatron's configuration give here?"

Every row is a `solver.planner.PlanChoice` of the same `Problem` (the traced step's
layers on the cluster) priced by the one estimator, so the rows differ only in their
configuration. Given the solved Plan, its row is that plan as it will run (its
meshes and ZeRO stages after the sharding pass), priced the way `hetpar show`
prices it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from hetpar.cluster.cluster import Cluster
from hetpar.errors import PlanError
from hetpar.options import StageOption
from hetpar.plan import Plan
from hetpar.plan.auto import problem_for
from hetpar.plan.costs import estimate_plan
from hetpar.pipeline import layers_pass, search_options, tokens_per_example
from hetpar.trace.traced_step import TracedStep, trace_step
from solver.planner import PlanChoice, PlanningError, Problem, plan
from solver.planner.manual import ManualConfig, choice_of, price

__all__ = ["ComparisonRow", "ManualConfig", "compare", "compare_plans"]


@dataclass(frozen=True)
class ComparisonRow:
    label: str  # "planner", "manual tp8 pp8 ...", "A100 alone"
    choice: PlanChoice | None
    error: str = ""  # why there is no plan (does not fit, cannot run)

    @property
    def memory_bytes(self) -> int:
        """The most any device of the plan holds."""
        return max((s.memory_bytes for s in self.choice.stages), default=0) if self.choice else 0

    @property
    def memory_capacity(self) -> int:
        return max((s.memory_capacity for s in self.choice.stages), default=0) if self.choice else 0


def compare(problem: Problem, manual: tuple[ManualConfig, ...] = (), single_kinds: bool = True,
            solved: Plan | None = None) -> list[ComparisonRow]:
    """The planner's best (or `solved`, the plan as it will run, when given), each
    manual configuration, and (with `single_kinds`, on a cluster of several kinds)
    the planner's best on each kind alone."""
    if solved is not None:
        rows = [_row("planner", lambda: choice_of(problem, estimate_plan(replace(solved, cost_inputs=problem))))]
    else:
        rows = [_row("planner", lambda: plan(problem, top_k=1).best)]
    for config in manual:
        rows.append(_row(f"manual {config.describe()}" + (f" on {config.kind}" if config.kind else ""),
                         lambda config=config: price(problem, config)))
    if single_kinds and len(problem.kinds) > 1:
        for kind in problem.kinds:
            alone = replace(problem, kinds=(kind,), links=(), allow_replicas=False)
            rows.append(_row(f"{kind.name} alone", lambda alone=alone: plan(alone, top_k=1).best))
    return rows


def _row(label: str, make: Callable[[], PlanChoice]) -> ComparisonRow:
    try:
        return ComparisonRow(label, make())
    except PlanningError as e:
        return ComparisonRow(label, None, str(e))


def compare_traced(traced: TracedStep, cluster: Cluster, manual: tuple[ManualConfig, ...] = (),
                   stage_option: StageOption = StageOption(), search_microbatches: bool = True,
                   solved: Plan | None = None) -> list[ComparisonRow]:
    """`compare` on the problem the planner solves for this traced step (`solved`'s
    own cost inputs, when it is given and has them)."""
    if solved is not None and solved.cost_inputs is not None:
        return compare(solved.cost_inputs, manual, solved=solved)
    if not all(g.device_ids for g in cluster.groups):
        cluster = cluster.numbered()
    layers = layers_pass(traced, cluster, stage_option, True)
    options = search_options(traced, stage_option, search_microbatches)
    problem = problem_for(layers, cluster, traced.batch_size, tokens_per_example(traced), options)
    return compare(problem, manual, solved=solved)


def compare_plans(fn: Callable, args: tuple, cluster: Cluster, manual: tuple[ManualConfig | str, ...] = (), *,
                  num_microbatches: int | None = None, batch_argnum: int = 1, solved: Plan | None = None,
                  **stage: Any) -> list[ComparisonRow]:
    """Price hand-fixed configurations (`ManualConfig`, or text such as
    "tp=2,pp=2,dp=2,mb=1,schedule=1f1b,remat=full") beside the planner's choice and
    the best plan on each kind alone, for `fn(*args)` on `cluster`, without running
    anything (`args` may be `jax.eval_shape` trees). `num_microbatches=None`: the
    planner's row searches the count (a manual row's follows from its microbatch size).
    `solved`: the plan already made for this step, listed as it will run."""
    try:
        configs = tuple(ManualConfig.parse(c) if isinstance(c, str) else c for c in manual)
    except PlanningError as e:
        raise PlanError(str(e)) from None
    traced = trace_step(fn, args, batch_argnum, num_microbatches or 1)
    return compare_traced(traced, cluster, configs, StageOption(**stage), num_microbatches is None, solved)
