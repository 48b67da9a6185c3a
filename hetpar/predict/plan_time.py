"""A plan's predicted step time, priced outside the plan: the Plan is data that
compile and `show` read, so the planning pass prices it once (`priced`) and stores
the figure in it, instead of the dataclass running the simulator itself."""

from __future__ import annotations

from dataclasses import replace

from hetpar.plan.model import Plan
from solver.pipeline_sim import step_time


def plan_step_time(plan: Plan) -> float:
    """The plan's schedule simulated with its stages' predicted times (the slowest
    data-parallel pipeline's); without stage timings, the GPipe formula on whole-stage
    times: the first microbatch crosses every stage, the rest follow at the pace of
    the slowest."""
    if plan.has_timings:
        return max(
            step_time([s.times for s in plan.replica_stages(r)], plan.num_microbatches, plan.schedule, plan.chunks)
            for r in range(plan.num_replicas)
        )
    per_mb = [s.predicted_time_s / plan.num_microbatches for s in plan.stages]
    return sum(per_mb) + (plan.num_microbatches - 1) * max(per_mb)


def priced(plan: Plan) -> Plan:
    """`plan` with its predicted step time set: the last thing a planning pass does,
    and again after anything that changes what the price depends on (its schedule)."""
    return replace(plan, predicted_step_time_s=plan_step_time(plan))
