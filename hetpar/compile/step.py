"""Compile a traced step, cut into stages, into one program per task."""

from __future__ import annotations

from jax.sharding import Mesh

from hetpar.plan import Plan
from hetpar.trace.opgraph import OpGraph

from hetpar.compile.programs import compile_task
from hetpar.compile.tasks import build_tasks, op_stages
from hetpar.runtime.executor import CompiledStep
from hetpar.trace.layers import Layers
from hetpar.trace.traced_step import TracedStep


def compile_step(
    traced: TracedStep, layers: Layers, layer_stage: list[int], meshes: dict[int, Mesh], schedule: str = "gpipe"
) -> CompiledStep:
    """`layer_stage[i]` is the stage of layer i; `meshes[s]` the mesh stage s runs on
    (stages may share one mesh, as when layers are profiled one by one)."""
    num_microbatches = traced.batch_size // traced.microbatch_size
    stages = op_stages(traced.full, traced.analysis, layers, layer_stage)
    tasks = build_tasks(traced.full, traced.analysis, stages)
    programs = [
        compile_task(t, traced.exec_graph, traced.full.constants, traced.analysis, meshes[t.stage], num_microbatches)
        for t in tasks
    ]
    return CompiledStep(
        traced.exec_graph, traced.full.constants, traced.analysis, programs,
        set(traced.batch_invars), num_microbatches, traced.microbatch_size, schedule,
    )


def compile_replicated(
    traced: TracedStep, layers: Layers, plan: Plan, meshes: dict[int, Mesh], graphs: dict[int, OpGraph]
) -> CompiledStep:
    """Several data-parallel pipelines (the plan's replicas), each compiled at its own
    microbatch size (`graphs[size]`): replica r's microbatches are global microbatches
    r*m .. r*m+m-1, laid end to end over the batch. Only replica 0 runs the post work
    (the update), on the reductions of all replicas combined."""
    m = plan.num_microbatches
    programs, replica_of, slices = [], [], []
    start = 0
    for r, examples in enumerate(plan.replica_batch):
        size = examples // m
        stages = plan.replica_stages(r)
        layer_stage = [s.index for s in stages for _ in range(s.layer_start, s.layer_end)]
        tasks = build_tasks(traced.full, traced.analysis, op_stages(traced.full, traced.analysis, layers, layer_stage))
        for t in tasks:
            if t.kind == "post" and r > 0:
                continue
            programs.append(compile_task(
                t, graphs[size], traced.full.constants, traced.analysis, meshes[t.stage], m, mean_weight=size / traced.batch_size
            ))
            replica_of.append(r)
        slices += [(start + j * size, size) for j in range(m)]
        start += examples
    return CompiledStep(
        traced.exec_graph, traced.full.constants, traced.analysis, programs, set(traced.batch_invars), m,
        traced.microbatch_size, plan.schedule, tuple(replica_of), tuple(slices),
    )
