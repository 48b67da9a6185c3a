"""Memory per device of each stage, by what holds it.

Parameters, gradient accumulators and optimizer state stay for the whole step;
activations a stage keeps for its backward live once per microbatch in flight: GPipe
runs every forward before any backward, so it keeps all of them; 1F1B keeps at most
as many as there are stages from this one to the last. Rematerialization keeps only
each microbatch's stage inputs and recomputes the rest, at the cost of one
microbatch's activations at a time. Workspace is the largest program's temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.plan import Plan
from hetpar.predict.programs import ProgramEstimate, share
from hetpar.compile.compiled import CompiledStep
from hetpar.trace.microbatch import input_roles
from solver.planner.stage_costs import in_flight


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # kept for backward, all microbatches in flight
    workspace: int
    capacity: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.workspace

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def stage_memory(
    compiled: CompiledStep,
    plan: Plan,
    capacity: dict[int, int],
    estimates: list[ProgramEstimate],
    schedule: str | None = None,  # None: the plan's
    remat: bool = False,
) -> list[MemoryBreakdown]:
    schedule = schedule or plan.schedule
    graph, analysis = compiled.graph, compiled.analysis
    roles = input_roles(graph, analysis, sorted(compiled.batch_invars))
    out = []
    for stage in plan.stages:
        k = len(stage.device_ids)
        programs = [(p, e) for p, e in zip(compiled.programs, estimates) if p.task.stage == stage.index]
        reads = {v for p, _ in programs for v in p.task.inputs}
        params = sum(graph.nbytes(v) for v in reads if roles.get(v) == "parameter")
        opt = sum(graph.nbytes(v) for v in reads if roles.get(v) == "optimizer_state")
        grads = sum(graph.nbytes(v) for p, _ in programs if p.task.per_microbatch for v in p.task.reductions)
        forward = [p for p, _ in programs if p.task.kind == "fwd"]
        backward = {v for p, _ in programs if p.task.kind == "bwd" for v in p.task.inputs}
        kept = [v for p in forward for v in p.task.outputs if v in backward]
        per_mb = sum(graph.nbytes(v) * share(graph, analysis, v, k) for v in kept)
        if remat:
            stage_inputs = sum(graph.nbytes(v) * share(graph, analysis, v, k) for p in forward for v in p.task.inputs if compiled.per_microbatch(v))
            activations = int(stage_inputs * in_flight(schedule, plan.num_microbatches, stage.index, plan.num_stages, plan.chunks) + per_mb)
        else:
            activations = int(per_mb * in_flight(schedule, plan.num_microbatches, stage.index, plan.num_stages, plan.chunks))
        workspace = max((e.temp_bytes for _, e in programs), default=0)
        out.append(MemoryBreakdown(params, grads, opt, activations, workspace, capacity[stage.index]))
    return out
