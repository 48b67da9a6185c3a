"""From a traced step and a cluster to a Plan, and the checks that a saved plan fits
the step and cluster it is about to run on. Shared by `parallelize` and `hetpar solve`
(which runs offline: it needs the step's shapes, not the cluster's devices)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from hetpar.cluster.cluster import Cluster, DeviceGroup
from hetpar.compile.tasks import op_stages
from hetpar.errors import PlanError
from hetpar.plan import Plan, StagePlan
from hetpar.planner import SearchOptions, search
from hetpar.shard import choose_mesh_shapes, mesh_axes, stage_specs
from hetpar.planning import assign_replicas, assign_stages
from hetpar.runnable import check_runnable
from solver.planner.stage_costs import in_flight
from hetpar.trace.fingerprint import differences, signature
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import Layers, block_count, build_layers, compute_dtype
from hetpar.trace.traced_step import TracedStep, trace_step


def make_plan(
    fn: Callable,
    args: tuple,
    cluster: Cluster,
    num_microbatches: int | None = 1,
    num_stages: int | None = None,
    num_layers: int | None = None,
    schedule: str | None = None,
    batch_argnum: int = 1,
    num_replicas: int | None = None,
    mesh_shape: tuple | None = None,
) -> Plan:
    """A plan for `fn(*args)` on `cluster`, without running anything: `args` may be
    abstract (`jax.ShapeDtypeStruct` trees from `jax.eval_shape`) and the cluster a
    file's description of machines this process does not have. `num_microbatches=None`:
    the planner chooses the count."""
    traced = trace_step(fn, args, batch_argnum, num_microbatches or 1)
    if not all(g.device_ids for g in cluster.groups):
        cluster = cluster.numbered()
    return solve(traced, cluster, num_stages, num_layers, schedule, num_replicas, mesh_shape,
                 search_microbatches=num_microbatches is None)[0]


def layers_of(traced: TracedStep, num_layers: int) -> Layers:
    return build_layers(traced.full, traced.analysis, [c.flops for c in op_costs(traced.full)], num_layers)


def solve(
    traced: TracedStep,
    cluster: Cluster,
    num_stages: int | None = None,
    num_layers: int | None = None,
    schedule: str | None = None,
    num_replicas: int | None = None,
    mesh_shape: tuple | None = None,
    search_microbatches: bool = False,
) -> tuple[Plan, Layers]:
    """`cluster` needs device ids or positions (`Cluster.numbered()` offline).

    Without `num_stages` and `num_replicas` the planner chooses stages, their devices,
    layers, replicas and (without `schedule`) the schedule, and the sharding solver
    each stage's (data, model) mesh (and, with `search_microbatches`, the microbatch
    count instead of the traced step's); with them, layers go to
    that many stages in proportion to their speed; `mesh_shape` (data, model) makes
    every stage's mesh two-dimensional, its operators sharded by the intra-op ILP."""
    num_microbatches = traced.batch_size // traced.microbatch_size
    if num_stages is None and num_replicas is None and mesh_shape is None:
        layers = _planning_layers(traced, cluster, num_layers)
        options = SearchOptions(
            microbatches=None if search_microbatches else (num_microbatches,), schedules=(schedule,) if schedule else ("1f1b", "gpipe"),
            min_microbatch=2 if traced.microbatch_size >= 4 or search_microbatches else 1,  # size 1 traces apart
            dtype=compute_dtype(traced.full, [c.flops for c in op_costs(traced.full)]),
        )
        plan = search(layers, cluster, traced.batch_size, _tokens(traced) // traced.batch_size, options)[0]
        plan = choose_mesh_shapes(traced, layers, plan, {g.label: g.devices_per_node or g.size for g in cluster.groups})
        check_runnable(plan, traced.batch_size)
    elif (num_replicas or 1) > 1:
        stages = num_stages or 1
        layers = layers_of(traced, num_layers or stages)
        plan = assign_replicas(layers, cluster, num_replicas, stages, num_microbatches, traced.batch_size, schedule or "gpipe")
    else:
        stages = num_stages or min(len(cluster.groups), cluster.num_devices)
        layers = layers_of(traced, num_layers or stages)
        plan = assign_stages(layers, cluster, stages, num_microbatches, schedule or "gpipe", mesh_shape)
    placed = _placed_params(traced, layers, plan)
    stages = tuple(
        replace(s, param_specs=tuple((name, spec) for name, spec, _ in specs), memory_bytes=_memory(s, specs, layers, plan))
        for s, specs in zip(plan.stages, placed)
    )
    too_big = [s for s in stages if s.memory_capacity and s.memory_bytes > s.memory_capacity]
    if too_big:
        raise PlanError("the plan does not fit in memory: " + "; ".join(
            f"stage {s.index} needs {s.memory_bytes / 2**30:.1f} GiB per {s.device_type}, which has {s.memory_capacity / 2**30:.0f} GiB"
            for s in too_big
        ) + ". To fit: more microbatches with schedule='1f1b' (fewer activations in flight), more stages, "
            "more devices, or a smaller batch")
    plan = replace(plan, stages=stages)
    return replace(plan, program=signature(traced.full), tokens_per_step=_tokens(traced)), layers


def _planning_layers(traced: TracedStep, cluster: Cluster, num_layers: int | None) -> Layers:
    """One layer per transformer block at least (so a faster kind can take any number
    of blocks), and one per device up to 8 on small models; fewer only when the step
    cannot be cut that finely."""
    if num_layers:
        return layers_of(traced, num_layers)
    flops = [c.flops for c in op_costs(traced.full)]
    wanted = max(block_count(traced.full, traced.analysis, flops), min(cluster.num_devices, 8))
    for n in range(wanted, 0, -1):
        try:
            return build_layers(traced.full, traced.analysis, flops, n)
        except PlanError:
            continue
    raise PlanError("the step cannot be cut into layers")


def _memory(stage: StagePlan, placed: tuple, layers: Layers, plan: Plan) -> int:
    """Per device: the stage's parameters and optimizer state, a gradient per
    parameter, and the activations its microbatches in flight keep for the backward
    (split over its data-parallel devices)."""
    state = sum(nbytes for _, _, nbytes in placed)
    grads = sum(layers.param_bytes[stage.layer_start : stage.layer_end]) / max(stage.tensor_parallel, 1) if layers.param_bytes else 0
    saved = sum(layers.saved_bytes[stage.layer_start : stage.layer_end]) if layers.saved_bytes else 0
    stages = plan.replica_stages(stage.replica)
    position = [s.index for s in stages].index(stage.index)
    kept = saved * stage.batch_share / plan.num_microbatches * in_flight(plan.schedule, plan.num_microbatches, position, len(stages))
    return int(state + grads + kept / max(stage.num_devices, 1))  # the model axis shards the wide activations too, as the planner assumes


def _placed_params(traced: TracedStep, layers: Layers, plan: Plan) -> list[tuple[tuple[str, str, int], ...]]:
    """Each stage's parameters and optimizer state (batch-free step inputs its
    operators read): path, sharding (replicated over a data-parallel stage mesh, or
    as the intra-op ILP lays it out on a data x model mesh), bytes per device."""
    specs = {s.index: stage_specs(traced, layers, plan, s) for s in plan.stages}
    position = {v: i for i, v in enumerate(traced.full.invars)}
    out: list[list[tuple[str, str, int]]] = [[] for _ in plan.stages]
    for r in range(plan.num_replicas):
        stages = plan.replica_stages(r)
        layer_stage = [s.index for s in stages for _ in range(s.layer_start, s.layer_end)]
        stage_of_op = op_stages(traced.full, traced.analysis, layers, layer_stage)
        owner: dict[int, int] = {}
        for op in traced.full.ops:  # the first operator to read a parameter places it
            for v in op.inputs:
                if v in position and traced.analysis.batch_axis.get(v) is None:
                    owner.setdefault(v, stage_of_op[op.index])
        for v, stage in sorted(owner.items(), key=lambda kv: position[kv[0]]):
            name = traced.input_paths[position[v]] if traced.input_paths else f"arg {position[v]}"
            spec = specs[stage].get(v)
            if spec is None:
                out[stage].append((name, "PartitionSpec()", traced.full.nbytes(v)))
            else:
                mesh = mesh_axes(plan.stages[stage])
                shards = math.prod(mesh[a] for a in spec if a is not None)
                out[stage].append((name, f"PartitionSpec({', '.join(repr(a) for a in spec)})", traced.full.nbytes(v) // shards))
    return [tuple(specs) for specs in out]


def _tokens(traced: TracedStep) -> int:
    """Examples x positions of the batch's first leaf: tokens for a sequence model."""
    first = traced.full.avals[traced.batch_invars[0]]
    shape = tuple(first.shape)
    return int(shape[0] * (shape[1] if len(shape) > 1 and first.dtype.kind in "iu" else 1))


def check_fits(plan: Plan, traced: TracedStep, cluster: Cluster) -> None:
    """Refuses a plan made for another step or another cluster, saying what differs."""
    if plan.program is not None:
        diff = differences(plan.program, signature(traced.full))
        if diff:
            raise PlanError("the plan was made for a different step: " + "; ".join(diff) + ". Solve the plan again for this step.")
    if plan.replica_batch and sum(plan.replica_batch) != traced.batch_size:
        raise PlanError(f"the plan's replicas take {list(plan.replica_batch)} examples; this batch has {traced.batch_size}")
    if not plan.replica_batch and plan.num_microbatches * traced.microbatch_size != traced.batch_size:
        raise PlanError(f"the plan splits the batch into {plan.num_microbatches} microbatches; this batch of {traced.batch_size} needs another count")
    if plan.cluster_groups:
        want = [(g.device_type, g.devices) for g in plan.cluster_groups]
        have = [(g.type_name, g.size) for g in cluster.groups]
        if want != have:
            fmt = lambda groups: " + ".join(f"{n}x{t}" for t, n in groups)  # noqa: E731
            raise PlanError(f"the plan was made for a cluster of {fmt(want)}; this cluster is {fmt(have)}")


def cluster_for(plan: Plan) -> Cluster:
    """The cluster a plan names, on this process's devices in order."""
    if not plan.cluster_groups:
        raise PlanError("the plan does not record its cluster; pass cluster= as well")
    groups = tuple(DeviceGroup(g.device_type, name=g.name, devices_per_node=g.devices) for g in plan.cluster_groups)
    return Cluster(groups, name=plan.cluster).bind()
