"""Memory per device of each stage, by what holds it, read off the compiled
programs and priced by the one memory model (solver.memory).

Parameters, gradient accumulators and optimizer state stay for the whole step
(split by the stage's ZeRO stage and tensor parallelism); the activations a stage's
forward program hands its backward program live once per microbatch the schedule
keeps in flight at the stage's position in its own pipeline. A recomputing stage's
programs already hand over less (hetpar.compile.remat), and its backward's
recomputation shows in that program's temporaries: the workspace, the largest
program's temporaries. `remat` prices recomputation a plan does not have yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.plan import Plan
from hetpar.predict.programs import ProgramEstimate, share
from hetpar.compile.compiled import CompiledStep
from hetpar.trace.microbatch import input_roles
from solver.memory import StageActivations, in_flight, offloaded, sharded_state, stage_memory as device_memory


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
    remat: str = "",  # price this recomputation on every stage that does not recompute already
) -> list[MemoryBreakdown]:
    schedule = schedule or plan.schedule
    graph, analysis = compiled.graph, compiled.analysis
    roles = input_roles(graph, analysis, sorted(compiled.batch_invars))
    out = []
    for stage in plan.stages:
        k = len(stage.device_ids)
        tp = max(stage.tensor_parallel, 1)
        programs = [(p, e) for p, e in zip(compiled.programs, estimates) if p.task.stage == stage.index]
        reads = {v for p, _ in programs for v in p.task.inputs}
        params = sum(graph.nbytes(v) for v in reads if roles.get(v) == "parameter") / tp
        opt = sum(graph.nbytes(v) for v in reads if roles.get(v) == "optimizer_state") / tp
        grads = sum(graph.nbytes(v) for p, _ in programs if p.task.per_microbatch for v in p.task.reductions) / tp
        state = sharded_state(params, grads, opt, stage.data_parallel or k, stage.zero)
        if stage.offload:  # the optimizer state in host memory: on the devices one array of it at a time, in the update
            state = offloaded(state, stage.offload, max((graph.nbytes(v) for v, _ in stage.offloaded), default=0) / tp)
        forward = [p for p, _ in programs if p.task.kind == "fwd"]
        backward = {v for p, _ in programs if p.task.kind == "bwd" for v in p.task.inputs}
        kept = [v for p in forward for v in p.task.outputs if v in backward]
        per_mb = sum(graph.nbytes(v) * share(graph, analysis, v, k) for v in kept)
        stage_inputs = sum(graph.nbytes(v) * share(graph, analysis, v, k) for p in forward for v in p.task.inputs
                           if compiled.per_microbatch(v))
        stages = plan.replica_stages(stage.replica)
        position = [s.index for s in stages].index(stage.lead)  # a part: its lead's
        held = in_flight(schedule, plan.num_microbatches, position, len(stages), plan.chunks)
        workspace = max((e.temp_bytes for _, e in programs), default=0)
        price = remat if not stage.remat else ""  # a recomputing stage's programs already keep less
        need = device_memory(state, StageActivations(per_mb, stage_inputs), held, price, workspace=workspace)
        out.append(MemoryBreakdown(int(need.parameters), int(need.gradients), int(need.optimizer_state), int(need.activations),
                                   int(need.workspace), capacity[stage.index]))
    return out
