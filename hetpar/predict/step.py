"""Predicted step time of a compiled plan, split into compute, communication and
pipeline bubble, with the figures a user wants: tokens/s and MFU.

Stages on different devices run concurrently: the step is the plan's schedule
simulated (`solver.pipeline_sim.step_time`, the figure the planner ranks by and
`hetpar simulate` draws) over each stage's predicted forward, backward, incoming
transfer and once-per-step programs. CPU virtual devices of one process share the
host's cores, so their stages do not overlap: the step is the sum of every program
run (`concurrent=False`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetpar.cluster.cluster import Cluster
from hetpar.plan import Plan
from hetpar.predict.compute import ComputeModel
from hetpar.predict.profile import Profile
from hetpar.predict.programs import ProgramEstimate, estimate_task
from hetpar.compile.compiled import CompiledStep
from solver.collectives import LinkCost
from solver.pipeline_sim import StageTimes, step_time


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    compute_s: float  # on the critical path
    communication_s: float  # gradient all-reduces and stage-to-stage transfers on it
    bubble_s: float
    stage_memory_bytes: tuple[int, ...]  # peak per device, by stage
    programs: tuple[ProgramEstimate, ...]  # by compiled program
    model_flops: float
    tokens: int
    peak_flops: float  # of the devices the plan uses

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float:
        """PaLM's model FLOPs utilization: forward + backward FLOPs (no
        rematerialization) per second over the peak of the devices used."""
        return self.model_flops / self.step_s / self.peak_flops


def device_models(plan: Plan, profile: Profile | None, cluster: Cluster) -> dict[int, tuple[ComputeModel, LinkCost]]:
    out = {}
    for stage in plan.stages:
        group = next(g for g in cluster.groups if g.type_name == stage.device_type)
        measured = profile.devices.get(stage.device_type) if profile else None
        if measured:
            model = measured.model_for(len(stage.device_ids))
            allreduce = LinkCost(measured.allreduce_bandwidth, measured.allreduce_latency_s)
        else:
            model = ComputeModel.from_catalog(group.spec)
            allreduce = group.intra_cost()  # host-staged where the group lacks peer-to-peer
        out[stage.index] = (model, allreduce)
    return out


def predict_step(
    compiled: CompiledStep,
    plan: Plan,
    cluster: Cluster,
    profile: Profile | None = None,
    concurrent: bool = True,
    tokens: int = 0,
) -> StepPrediction:
    models = device_models(plan, profile, cluster)
    sizes = {s.index: len(s.device_ids) for s in plan.stages}
    estimates = []
    for program in compiled.programs:
        model, allreduce = models[program.task.stage]
        estimates.append(estimate_task(program.task, compiled.graph, compiled.analysis, sizes[program.task.stage], model, allreduce,
                                       program.stacked))

    transfer = {s.index: 0.0 for s in plan.stages}  # per microbatch, into each stage
    for program in compiled.programs:
        if program.task.per_microbatch:
            for v in program.task.inputs:
                producer = compiled.graph.producer.get(v)
                src = _stage_of(compiled, producer)
                if src is not None and src != program.task.stage:
                    transfer[program.task.stage] += _transfer_s(compiled, plan, cluster, v, src, program.task.stage)

    m = compiled.num_microbatches
    forward = {s.index: 0.0 for s in plan.stages}  # one microbatch
    backward = {s.index: 0.0 for s in plan.stages}
    once = {s.index: 0.0 for s in plan.stages}  # once per step: before the pipeline and after it
    comm = 0.0
    for item in compiled.order:
        if item.combine:
            continue
        est = estimates[item.program]
        task = compiled.programs[item.program].task
        if item.microbatch is None:
            once[task.stage] += est.time_s
        elif item.microbatch == 0:
            (forward if task.kind == "fwd" else backward)[task.stage] += est.time_s
        comm += est.communication_s
        if item.last_microbatch:  # the partials kept across microbatches, reduced once
            once[task.stage] += est.finish_s
            comm += est.finish_s
        if item.fused is not None:  # the stage's update, dispatched with its last microbatch
            once[task.stage] += estimates[item.fused].time_s
            comm += estimates[item.fused].communication_s
            folded = compiled.fusions.get(item.program)
            if folded is not None and folded.pre is not None:  # and, with one microbatch, its pre work
                pre = compiled.tasks.index(folded.pre)
                once[task.stage] += estimates[pre].time_s
                comm += estimates[pre].communication_s
    comm += sum(transfer.values()) * m
    per_mb = {i: forward[i] + backward[i] + transfer[i] for i in forward}
    if concurrent:
        step = max(step_time(_stage_times(plan.replica_stages(r), forward, backward, transfer, once), m, plan.schedule, plan.chunks)
                   for r in range(plan.num_replicas))
        bubble = max(0.0, step - max(once.values()) - m * max(per_mb.values()))
    else:
        step = m * sum(per_mb.values()) + sum(once.values())
        bubble = 0.0
    memory = []
    for stage in plan.stages:
        own = [e for p, e in zip(compiled.programs, estimates) if p.task.stage == stage.index]
        memory.append(max((e.memory_bytes for e in own), default=0))
    return StepPrediction(
        step_s=step,
        compute_s=step - bubble - comm,
        communication_s=comm,
        bubble_s=bubble,
        stage_memory_bytes=tuple(memory),
        programs=tuple(estimates),
        model_flops=sum(s.flops for s in plan.stages),
        tokens=tokens,
        peak_flops=sum(len(s.device_ids) * cluster_peak(cluster, s.device_type) for s in plan.stages),
    )


def _stage_times(stages, forward: dict[int, float], backward: dict[int, float], transfer: dict[int, float],  # noqa: ANN001
                 once: dict[int, float]) -> list[StageTimes]:
    """One replica's stages for the simulator: what enters stage i+1 per microbatch
    is stage i's send; its once-per-step programs are its tail."""
    ids = [s.index for s in stages]
    sends = [transfer[j] for j in ids[1:]] + [0.0]
    return [StageTimes(forward[i], backward[i], send, once[i]) for i, send in zip(ids, sends)]


def cluster_peak(cluster: Cluster, device_type: str) -> float:
    return next(g for g in cluster.groups if g.type_name == device_type).spec.matmul_flops()


def _stage_of(compiled: CompiledStep, op_index: int | None) -> int | None:
    if op_index is None:
        return None
    for program in compiled.programs:
        if op_index in program.task.ops:
            return program.task.stage
    return None


def _transfer_s(compiled: CompiledStep, plan: Plan, cluster: Cluster, value: int, src: int, dst: int) -> float:
    groups = {g.type_name: g for g in cluster.groups}
    a, b = groups[plan.stages[src].device_type], groups[plan.stages[dst].device_type]
    link = cluster.link_between(a, b)
    return link.latency + compiled.graph.nbytes(value) / link.bandwidth
