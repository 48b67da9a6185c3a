"""Predicted step time of a compiled plan, split into compute, communication and
pipeline bubble, with the figures a user wants: tokens/s and MFU.

Stages on different devices run concurrently: the step follows the GPipe formula.
CPU virtual devices of one process share the host's cores, so their stages do not
overlap: the step is the sum of every program run (`concurrent=False`).
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
            link = group.intra_link
            allreduce = LinkCost(link.bandwidth, link.latency)
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
        estimates.append(estimate_task(program.task, compiled.graph, compiled.analysis, sizes[program.task.stage], model, allreduce))

    transfer = {s.index: 0.0 for s in plan.stages}  # per microbatch, into each stage
    for program in compiled.programs:
        if program.task.per_microbatch:
            for v in program.task.inputs:
                producer = compiled.graph.producer.get(v)
                src = _stage_of(compiled, producer)
                if src is not None and src != program.task.stage:
                    transfer[program.task.stage] += _transfer_s(compiled, plan, cluster, v, src, program.task.stage)

    m = compiled.num_microbatches
    per_mb = {s.index: transfer[s.index] for s in plan.stages}
    once = 0.0
    comm = 0.0
    for item in compiled.order:
        if item.combine:
            continue
        est = estimates[item.program]
        if item.microbatch is None:
            once += est.time_s
        elif item.microbatch == 0:
            per_mb[compiled.programs[item.program].task.stage] += est.time_s
        comm += est.communication_s
        if item.fused is not None:  # the stage's update, dispatched with its last microbatch
            once += estimates[item.fused].time_s
            comm += estimates[item.fused].communication_s
    comm += sum(transfer.values()) * m
    if concurrent:
        pipeline = sum(per_mb.values()) + (m - 1) * max(per_mb.values())
        bubble = pipeline - m * max(per_mb.values())
    else:
        pipeline = m * sum(per_mb.values())
        bubble = 0.0
    step = pipeline + once
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
