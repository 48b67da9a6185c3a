"""The one step-time figure of a plan: what the planner ranks by and what `hetpar
show` and `hetpar simulate` report.

The search scores thousands of splits with each schedule's closed form
(`Schedule.step_time`), which is exact for some shapes and close for others (an
interleaved pipeline, or GPipe's two flow shops). Its finalists are then priced by
`solver.pipeline_sim.step_time` (the event-by-event simulation, the closed form only
past `MAX_SIMULATED_MICROBATCHES`), so a plan is never chosen over one its own
simulation rates faster.
"""

from __future__ import annotations

from dataclasses import replace

from solver.pipeline_sim import pipeline_time, step_time
from solver.planner.problem import PlanChoice
from solver.schedules import StageTimes


def stage_times(choice: PlanChoice, replica: int) -> list[StageTimes]:
    """One replica's virtual stages, in pipeline order, as the simulator takes them
    (the gradient sum across replicas joins each stage's sync, as in a Plan)."""
    return [StageTimes(s.forward_s, s.backward_s, s.send_s, s.sync_s + choice.cross_sync_s, s.optimizer_s)
            for s in choice.stages if s.replica == replica]


def simulated_step_s(choice: PlanChoice) -> float:
    """The slowest replica pipeline's simulated step."""
    return max(step_time(stage_times(choice, r), choice.num_microbatches, choice.schedule, choice.chunks)
               for r in range(len(choice.replica_batch)))


def closed_form_step_s(choice: PlanChoice) -> float:
    """The slowest replica pipeline's closed-form step: what the search scored."""
    return max(pipeline_time(stage_times(choice, r), choice.num_microbatches, choice.schedule, choice.chunks)
               for r in range(len(choice.replica_batch)))


def with_simulated_step(choice: PlanChoice) -> PlanChoice:
    """`choice` with its step time replaced by the simulated one."""
    return replace(choice, step_s=simulated_step_s(choice))


def rank(choices: list[PlanChoice]) -> list[PlanChoice]:
    """Finalists re-priced by simulation, fastest first."""
    return sorted((with_simulated_step(c) for c in choices), key=lambda c: c.step_s)
