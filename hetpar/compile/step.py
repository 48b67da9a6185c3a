"""Compile a traced step, cut into stages, into one program per task."""

from __future__ import annotations

from jax.sharding import Mesh

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
