"""Compile a traced step, cut into stages, into one program per task.

Compile reads the plan and nothing else: each operator's stage and each stage's
shardings are the plan's (`Plan.operator_stages`, `StagePlan.shardings`); no layer
is rebuilt and no solver runs here, so a saved plan compiles to the programs it was
solved for. `step_tasks` touches no device, so a driver and its workers (one process
per mesh, runtime/ray_runtime.py) derive the same tasks and agree on every index;
`compile_step(keep=...)` gives each of them the same step, compiled only where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from jax.sharding import Mesh

from hetpar.cluster.catalog import catalog
from hetpar.compile.compiled import CompiledStep
from hetpar.compile.programs import FusedProgram, Fusion, Program, compile_fused, compile_task, fusion
from hetpar.compile.remat import recompute
from hetpar.compile.tasks import Task, build_tasks
from hetpar.trace.stages import op_stages
from hetpar.errors import PlanError
from hetpar.plan import Plan
from hetpar.plan.file import check_parts
from hetpar.trace.layers import Layers
from hetpar.trace.microbatch import MicrobatchAnalysis
from hetpar.trace.opgraph import OpGraph
from hetpar.trace.traced_step import TracedStep, trace_microbatch


@dataclass(frozen=True)
class StepTasks:
    tasks: tuple[Task, ...]
    replica_of: tuple[int, ...]  # per task
    microbatch_sizes: tuple[int, ...]  # per task: the batch size its program runs at
    slices: tuple[tuple[int, int], ...]  # per global microbatch: (start, size) in the batch
    num_microbatches: int  # per replica
    # Mixed-kind stages (`StagePlan.part_of`): each part's rows of every microbatch
    # ((offset, count) by stage index), and each lead's parts in row order.
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    parts: dict[int, tuple[int, ...]] = field(default_factory=dict)


def step_tasks(traced: TracedStep, plan: Plan) -> StepTasks:
    """Every data-parallel replica's tasks; replica r's microbatches are global
    microbatches r*m .. r*m+m-1, laid end to end over the batch. Every replica runs
    its own post work (the update) on its own stages, on the reductions of all
    replicas combined (each replica sums them in the same order, so every replica's
    new state is replica 0's, bit for bit): the next step's replicas read their own
    copies, and no parameter crosses from replica 0 (runtime/replicas.py). A mixed
    stage's other parts run copies of its lead's forward and backward tasks at their
    own rows of each microbatch (`mixed_rows`), and copies of its post work (the
    update, each part on its own copy of the parameters and optimizer state, so no
    part waits for the lead's new parameters next step); its pre work runs on the lead."""
    if not plan.operator_stages:
        raise PlanError("the plan does not say which stage runs each operator (operator_stages): it can be shown and "
                        "simulated but not run; make it with hetpar solve or hetpar.make_plan")
    if len(plan.operator_stages) != plan.num_replicas or any(
            sum(n for _, n in runs) != len(traced.full.ops) for runs in plan.operator_stages):
        raise PlanError(f"the plan places {[sum(n for _, n in r) for r in plan.operator_stages]} operators per replica; this step "
                        f"has {len(traced.full.ops)} in each of {plan.num_replicas} replica(s). Solve the plan again for this step.")
    m = plan.num_microbatches
    batches = plan.replica_batch or (traced.batch_size,)
    rows, parts = mixed_rows(plan, [examples // m for examples in batches])
    tasks, replica_of, sizes, slices = [], [], [], []
    start = 0
    for r, examples in enumerate(batches):
        size = examples // m
        built = build_tasks(traced.full, traced.analysis, plan.stage_of_operators(r))
        for t in recompute(built, traced.full, {s.index: s.remat for s in plan.replica_stages(r)}):
            copies = parts.get(t.stage, (t.stage,)) if t.per_microbatch or t.kind == "post" else (t.stage,)
            for stage in copies:  # a mixed stage's forward, backward and update: one task per part
                tasks.append(t if stage == t.stage else replace(t, stage=stage))
                replica_of.append(r)
                sizes.append(rows[stage][1] if stage in rows and t.per_microbatch else size)
        slices += [(start + j * size, size) for j in range(m)]
        start += examples
    return StepTasks(tuple(tasks), tuple(replica_of), tuple(sizes), tuple(slices), m, rows, parts)


def mixed_rows(plan: Plan, microbatch: list[int]) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, ...]]]:
    """Each mixed stage's parts' rows of a microbatch ((offset, count) by stage index,
    in row order from the lead) and each lead's parts, read from the plan
    (`StagePlan.examples`); `microbatch`: the examples of each replica's microbatch.
    The parts are checked as a loaded plan's are (`check_parts`: leads, layers,
    replicas), and their examples against the microbatch the step was traced with."""
    check_parts(plan)
    rows: dict[int, tuple[int, int]] = {}
    parts: dict[int, tuple[int, ...]] = {}
    for lead in plan.mixed_stages:
        mine = plan.parts(lead)
        size = microbatch[mine[0].replica]
        counts = [s.examples for s in mine]
        if any(c < 1 for c in counts) or sum(counts) != size:
            raise PlanError(f"the parts of mixed stage {lead} (stages {[s.index for s in mine]}) take {counts} examples of each "
                            f"microbatch, which has {size}: give each part at least one example and make them sum to {size}")
        offset = 0
        for s in mine:
            rows[s.index] = (offset, s.examples)
            offset += s.examples
        parts[lead] = tuple(s.index for s in mine)
    return rows, parts


def compile_tasks(
    traced: TracedStep, plan: Plan, plan_tasks: StepTasks, meshes: dict[int, Mesh], graphs: dict[int, OpGraph],
    keep: Callable[[Task], bool] = lambda t: True,
) -> list[Program | None]:
    """One program per task that `keep` accepts (None for the others: another
    process runs them), at its replica's microbatch size (`graphs[size]`)."""
    m = plan_tasks.num_microbatches
    layouts = stage_layouts(plan)
    return [
        compile_task(
            t, graphs[size], traced.full.constants, traced.analysis, meshes[t.stage], m,
            mean_weight=size / traced.batch_size, **layouts.get(t.stage, {}),
        ) if keep(t) else None
        for t, size in zip(plan_tasks.tasks, plan_tasks.microbatch_sizes)
    ]


def stage_layouts(plan: Plan) -> dict[int, dict[str, dict]]:
    """Per stage, the layouts its programs apply, as `compile_task`'s keywords: the
    intra-op shardings, the matmul operand pins, the ZeRO-3 gathered layouts, and the
    values kept in host memory (host offload: each state the step reads and the new
    state it returns for it)."""
    return {
        s.index: {"specs": dict(s.shardings), "operand_specs": dict(s.operand_shardings), "gathered": dict(s.gathered),
                  "host": frozenset(v for pair in s.offloaded for v in pair)}
        for s in plan.stages
    }


def compile_step(traced: TracedStep, plan: Plan, meshes: dict[int, Mesh], graphs: dict[int, OpGraph],
                 keep: Callable[[int], bool] = lambda stage: True) -> CompiledStep:
    """The compile pass: `meshes[s]` is the mesh stage s runs on (stages may share
    one, as when layers are profiled one by one). Each stage's update is fused into
    its last microbatch's program where it can be (`fusible_updates`). Only the
    stages `keep` accepts are compiled (a Ray worker compiles its own, a Ray driver
    none); the step's structure and order are the same everywhere."""
    plan_tasks = step_tasks(traced, plan)
    programs = compile_tasks(traced, plan, plan_tasks, meshes, graphs, keep=lambda t: keep(t.stage))
    replicated = plan.num_replicas > 1
    mixed = bool(plan_tasks.parts)  # the update waits for a mixed stage's parts to be summed, as for replicas
    fused: dict[int, FusedProgram] = {}
    fusions: dict[int, Fusion] = {}
    fused_posts: dict[int, int] = {}
    folded_pres: set[int] = set()
    if not replicated and not mixed:
        layouts = stage_layouts(plan)
        tasks = plan_tasks.tasks
        for host, post in fusible_updates(traced.full, traced.analysis, tasks).items():
            task, size = tasks[host], plan_tasks.microbatch_sizes[host]
            elsewhere = _read_elsewhere(traced.full, task, tasks[post])
            pre = foldable_pre(traced.full, tasks, host, post) if plan_tasks.num_microbatches == 1 else None
            fusions[host] = fusion(task, tasks[post], elsewhere, plan_tasks.num_microbatches,
                                   None if pre is None else tasks[pre])
            fused_posts[host] = post
            if pre is not None:
                folded_pres.add(pre)
            if keep(task.stage):
                fused[host] = compile_fused(
                    task, tasks[post], graphs[size], traced.full.constants, traced.analysis, meshes[task.stage],
                    plan_tasks.num_microbatches, elsewhere, mean_weight=size / traced.batch_size, **layouts.get(task.stage, {}),
                    pre=None if pre is None else tasks[pre],
                )
    return CompiledStep(
        traced.exec_graph, traced.full.constants, traced.analysis, programs, set(traced.batch_invars),
        plan_tasks.num_microbatches, traced.microbatch_size, plan.schedule,
        plan_tasks.replica_of if replicated else (), plan_tasks.slices if replicated else (), plan.chunks,
        fused, fused_posts, fusions, plan_tasks.tasks, frozenset(folded_pres), stage_vendors(plan, meshes),
        plan_tasks.rows, plan_tasks.parts,
    )


def stage_vendors(plan: Plan, meshes: dict[int, Mesh]) -> dict[int, str]:
    """Each stage device's vendor (by JAX device id), when the plan's stages span
    more than one vendor; empty otherwise (every move is device to device)."""
    kinds = catalog()
    vendor = {s.index: kinds[s.device_type].vendor for s in plan.stages if s.device_type in kinds}
    if len(set(vendor.values())) < 2:
        return {}
    return {d.id: vendor[s] for s, mesh in meshes.items() if s in vendor for d in mesh.devices.flat}


def fusible_updates(graph: OpGraph, analysis: MicrobatchAnalysis, tasks: Sequence[Task]) -> dict[int, int]:
    """host task -> post task: each stage's first post work (its optimizer update),
    run inside the program of the stage's last per-microbatch work (its backward; the
    last stage's forward, which holds its backward). Only where the post work reads
    nothing but that program's own reductions and values ready before any microbatch
    (step inputs, pre work): then moving it to the last microbatch changes no value,
    only when it is dispatched. Single pipeline only: with replicas, the update waits
    for the replicas' reductions to be combined."""
    producer = {v: t for t in tasks for v in (*t.outputs, *t.reductions)}
    fused = {}
    for post, p in enumerate(tasks):
        if p.kind != "post" or p.phase != 0:
            continue
        hosts = [i for i, t in enumerate(tasks) if t.stage == p.stage and t.kind in ("fwd", "bwd")]
        if not hosts:
            continue
        host = max(hosts, key=lambda i: tasks[i].kind == "bwd")  # the backward, where the stage has one
        own = set(tasks[host].reductions)
        if all(v in own or v not in producer or producer[v].kind == "pre" for v in p.inputs) and own & set(p.inputs):
            fused[host] = post
    return fused


def foldable_pre(graph: OpGraph, tasks: Sequence[Task], host: int, post: int) -> int | None:
    """The pre task that can run inside the fused program of `host` (with its update
    `post`) when a step has one microbatch: the stage's only pre work, reading only
    step inputs, whose results nothing but `host` and `post` reads (no other stage,
    no later post phase, no step output). Then the one-stage step is one program,
    and the pre work's results never leave it: one dispatch fewer per step."""
    stage = tasks[host].stage
    pres = [i for i, t in enumerate(tasks) if t.kind == "pre" and t.stage == stage]
    if len(pres) != 1:
        return None
    pre = tasks[pres[0]]
    made = {v for t in tasks for v in (*t.outputs, *t.reductions)}
    inside = set(pre.ops) | set(tasks[host].ops) | set(tasks[post].ops)
    outputs = set(graph.outvars)
    if any(v in made for v in pre.inputs) or any(
            v in outputs or any(c not in inside for c in graph.consumers.get(v, ())) for v in pre.outputs):
        return None
    return pres[0]


def _read_elsewhere(graph: OpGraph, host: Task, post: Task) -> set[int]:
    """The host's reductions that something besides the fused post work reads (a later
    post phase, a step output): the fused program must still return them."""
    inside = set(post.ops)
    outputs = set(graph.outvars)
    return {v for v in host.reductions if v in outputs or any(c not in inside for c in graph.consumers.get(v, ()))}


def compile_layer_stages(traced: TracedStep, layers: Layers, layer_stage: list[int], meshes: dict[int, Mesh],
                         remat: str = "", layouts: dict[int, dict] | None = None) -> CompiledStep:
    """The step with layer i on stage `layer_stage[i]`, no plan needed: how the
    profiler compiles each layer on its own (all on one mesh). `remat`: every stage's
    backward recomputes its forward under that policy (hetpar.compile.remat), as a
    plan's stage with that policy would. `layouts`: per stage, the layouts its
    programs apply (`stage_layouts` of a plan the sharding pass laid out: how the
    profiler runs a layer on a mesh with a model axis as a plan's stage would run it)."""
    m = traced.batch_size // traced.microbatch_size
    tasks = build_tasks(traced.full, traced.analysis, op_stages(traced.full, traced.analysis, layers, layer_stage))
    if remat:
        tasks = recompute(tasks, traced.full, {stage: remat for stage in set(layer_stage)})
    layouts = layouts or {}
    programs = [compile_task(t, traced.exec_graph, traced.full.constants, traced.analysis, meshes[t.stage], m,
                             **layouts.get(t.stage, {})) for t in tasks]
    return CompiledStep(
        traced.exec_graph, traced.full.constants, traced.analysis, programs, set(traced.batch_invars), m, traced.microbatch_size
    )


def microbatch_graphs(fn: Callable, args: tuple, batch_argnum: int, traced: TracedStep, plan: Plan) -> dict[int, OpGraph]:
    """The step at every microbatch size the plan's replicas run with."""
    sizes = {b // plan.num_microbatches for b in plan.replica_batch} or {traced.microbatch_size}
    sizes |= {s.examples for s in plan.stages if s.examples}  # a mixed stage's parts' rows
    return {size: trace_microbatch(fn, args, batch_argnum, traced, size) for size in sizes}
