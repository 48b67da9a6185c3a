"""How the planner's choices meet the estimator (`solver.cost.estimate`).

The search scores thousands of splits with each schedule's closed form
(`Schedule.step_time`), which is exact for some shapes and close for others (an
interleaved pipeline, or GPipe's two flow shops). Its finalists are then priced by
the estimator, the one price every plan gets (the schedule simulated event by
event), so the plan it returns is the best under the same model that prices
everything else and a plan is never chosen over one its own price rates faster.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from solver.cost.estimate import Decisions, PlanCost, StageDecision, estimate, simulated, step_floor_s
from solver.pipeline_sim import pipeline_time, step_time
from solver.planner.problem import PlanChoice, Problem
from solver.cost.stage_costs import StageCosts
from solver.schedules import StageTimes

ROUNDING = 1e-9  # relative: a floor and the simulation add the same figures in other orders


def decisions(choice: PlanChoice) -> Decisions:
    """What a planner's choice decides, as the estimator reads it."""
    return Decisions(
        tuple(StageDecision(s.kind, s.dp, s.tp, s.layer_start, s.layer_end, "full" if s.remat else "", s.zero, s.replica,
                            offload=s.offload, part_of=s.part_of, examples=s.examples)
              for s in choice.stages),
        choice.num_microbatches, choice.schedule, choice.replica_batch, choice.chunks,
    )


def priced(problem: Problem, choice: PlanChoice, costs: StageCosts | None = None) -> PlanCost:
    return estimate(problem, decisions(choice), costs)


def with_estimate(problem: Problem, choice: PlanChoice, costs: StageCosts | None = None) -> PlanChoice:
    """`choice` with its step time the estimator's."""
    return replace(choice, step_s=priced(problem, choice, costs).step_s)


def with_costs(choice: PlanChoice, cost: PlanCost) -> PlanChoice:
    """`choice` with each stage's figures and the step the estimator's `cost` of it."""
    stages = tuple(replace(s, forward_s=c.forward_s, backward_s=c.backward_s, send_s=c.send_s, sync_s=c.sync_s,
                           optimizer_s=c.optimizer_s, memory_bytes=int(c.group_memory_bytes), memory_capacity=c.capacity)
                   for s, c in zip(choice.stages, cost.stages))
    return replace(choice, stages=stages, step_s=cost.step_s, peak_flops=cost.peak_flops)


def rank(problem: Problem, choices: list[PlanChoice], costs: StageCosts | None = None,
         exact_to: Callable[[list[PlanChoice]], float] | None = None) -> list[PlanChoice]:
    """Finalists priced by the estimator, fastest first (ties in the finalists' order).
    `exact_to`: given the ranking of the plans simulated so far, the step up to which the
    caller reads the ranking (it may only fall as more are simulated): the plans are
    simulated in the order of their floors (`step_floor_s`, provably at most their
    simulated step), and those whose floor is above it are left out, as they could not
    rank before any plan the caller reads (simulating the step is about half an estimate)."""
    if exact_to is None:
        return sorted((with_estimate(problem, c, costs) for c in choices), key=lambda c: c.step_s)
    costs = costs or StageCosts(problem)
    priced = [estimate(problem, decisions(c), costs, simulate_step=False) for c in choices]
    floors = [step_floor_s(problem, cost) for cost in priced]
    done: list[tuple[int, PlanChoice]] = []
    ranked: list[PlanChoice] = []
    for i in sorted(range(len(choices)), key=lambda i: floors[i]):
        if ranked and floors[i] * (1 - ROUNDING) > exact_to(ranked):
            break
        done.append((i, replace(choices[i], step_s=simulated(problem, priced[i]).step_s)))
        ranked = sorted((c for _, c in sorted(done, key=lambda x: x[0])), key=lambda c: c.step_s)
    return ranked


def stage_times(choice: PlanChoice, replica: int) -> list[StageTimes]:
    """One replica's virtual stages as the choice itself records them (the gradient
    sum across replicas joined to each stage's sync, as the estimator charges it)."""
    return [StageTimes(s.forward_s, s.backward_s, s.send_s, s.sync_s + choice.cross_sync_s, s.optimizer_s)
            for s in choice.stages if s.replica == replica and s.part_of < 0]


def simulated_step_s(choice: PlanChoice) -> float:
    """The slowest replica pipeline of the choice's own stage times, simulated."""
    return max(step_time(stage_times(choice, r), choice.num_microbatches, choice.schedule, choice.chunks)
               for r in range(len(choice.replica_batch)))


def closed_form_step_s(choice: PlanChoice) -> float:
    """The slowest replica pipeline's closed-form step: what the search scored."""
    return max(pipeline_time(stage_times(choice, r), choice.num_microbatches, choice.schedule, choice.chunks)
               for r in range(len(choice.replica_batch)))
