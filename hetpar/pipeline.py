"""The pass list: from a traced step and a cluster to a Plan, one named, timed pass
after another (layers → stage assignment → operator stages → sharding → placement),
and the checks
that a saved plan fits the step and cluster it is about to run on. Shared by
`parallelize` and `hetpar solve` (which runs offline: it needs the step's shapes,
not the cluster's devices). The Plan it returns holds everything compile needs."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Callable

import jax

from hetpar.cluster.cluster import Cluster, DeviceGroup
from hetpar.compile.remat import rerun, saveable
from hetpar.trace.stages import op_stages
from hetpar.errors import PlanError
from hetpar.options import ShardingOption, StageOption, build_options
from hetpar.passes import announce, timed_pass
from hetpar.plan.auto import Measured, SearchOptions, planner_for, problem_for, search_problem
from hetpar.plan.costs import estimate_plan, fit_problems, priced, unpriced
from hetpar.plan.manual import assign_replicas, assign_stages
from hetpar.plan.model import Plan, Spec, StagePlan, runs
from hetpar.plan.runnable import check_runnable, runnable_problems
from hetpar.predict.layer_profile import dtype_policy, layer_signatures, problem_layers
from hetpar.predict.profile import Profile
from hetpar.shard import layout_axes, shard_stages
from hetpar.trace.fingerprint import differences, signature
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import Layers, block_count, build_layers, compute_dtype, structure_of
from hetpar.trace.microbatch import Phase, input_roles
from hetpar.trace.traced_step import TracedStep, trace_step
from solver import schedules
from solver.collectives import LinkCost
from solver.planner import Planner, PlanningError, Problem

log = logging.getLogger(__name__)


def make_plan(
    fn: Callable,
    args: tuple,
    cluster: Cluster,
    *,
    num_microbatches: int | None = 1,
    batch_argnum: int = 1,
    stage_option: StageOption | None = None,
    sharding_option: ShardingOption | None = None,
    **shortcuts: Any,
) -> Plan:
    """A plan for `fn(*args)` on `cluster`, without running anything: `args` may be
    abstract (`jax.ShapeDtypeStruct` trees from `jax.eval_shape`) and the cluster a
    file's description of machines this process does not have. Options and their
    keyword shortcuts (`num_stages`, `schedule`, `mesh_shape`, ...) as `parallelize`.
    `num_microbatches=None`: the planner chooses the count."""
    stage, sharding, _ = build_options(stage_option, sharding_option, **shortcuts)
    traced = trace_step(fn, args, batch_argnum, num_microbatches or 1)
    if not all(g.device_ids for g in cluster.groups):
        cluster = cluster.numbered()
    return solve(traced, cluster, stage, sharding, search_microbatches=num_microbatches is None)


def layers_of(traced: TracedStep, num_layers: int) -> Layers:
    return build_layers(traced.full, traced.analysis, [c.flops for c in op_costs(traced.full)], num_layers)


def solve(traced: TracedStep, cluster: Cluster, stage_option: StageOption = StageOption(),
          sharding_option: ShardingOption = ShardingOption(), search_microbatches: bool = False) -> Plan:
    """The planning passes, from a traced step to a Plan that holds everything compile
    needs: layers, stage assignment, operator stages, sharding, placement. With
    `search_microbatches` the planner chooses the microbatch count instead of taking
    the traced step's. Every plan, the planner's or one fixed by hand, is priced by
    the one estimator (`hetpar.plan.costs`) on the same cost inputs.

    `cluster` needs device ids or positions (`Cluster.numbered()` offline)."""
    stage_option = _whole_batch(traced, stage_option)
    auto = stage_option.mode == "auto" and sharding_option.mesh_shape is None
    layers = layers_pass(traced, cluster, stage_option, auto)
    options = search_options(traced, stage_option, search_microbatches, zero=sharding_option.zero)
    inputs = problem_for(layers, cluster, traced.batch_size, tokens_per_example(traced), options)
    if stage_option.profile:
        inputs = with_measured_layers(inputs, traced, layers, cluster, Profile.load(stage_option.profile))
    plan = stage_pass(traced, layers, cluster, stage_option, sharding_option, auto, options, inputs)
    plan = replace(plan, operator_stages=_operator_stages(traced, layers, plan), cost_inputs=inputs)
    per_node = {g.label: g.devices_per_node or g.size for g in cluster.groups} if auto else None
    links = {g.label: g.intra_cost() for g in cluster.groups}  # the cluster file's (peer-to-peer or host-staged), not the catalog's
    plan = sharding_pass(traced, layers, plan, sharding_option, per_node, links)
    if auto:
        check_runnable(plan, traced.batch_size)
    plan = placement_pass(traced, layers, plan)
    return replace(plan, program=signature(traced.full))


def price_like(traced: TracedStep, plan: Plan, cluster: Cluster) -> Plan:
    """A plan placed `like=` a train step (hetpar.plan.like) priced as what it runs:
    the function's own layers (a forward-only eval has no backward, gradients or
    update), each layer on the stage that runs its operators. Unpriced, with a note,
    where its operators do not fall into contiguous layer ranges per stage."""
    for n in range(plan.num_layers, 0, -1):
        try:
            layers = layers_of(traced, n)
            break
        except PlanError:
            continue
    else:
        return unpriced(replace(plan, notes=(*plan.notes, "not priced: the function could not be cut into layers")))
    stage_of_op = plan.stage_of_operators(0)
    layer_stage = [0] * layers.num_layers
    for op, layer in layers.op_layer.items():
        layer_stage[layer] = max(layer_stage[layer], stage_of_op[op])
    bounds = [(layer_stage.index(s.index), len(layer_stage) - layer_stage[::-1].index(s.index))
              if s.index in layer_stage else None for s in plan.stages]
    if None in bounds or [a for a, _ in bounds] != [0] + [b for _, b in bounds[:-1]] or bounds[-1][1] != layers.num_layers:
        return unpriced(replace(plan, notes=(*plan.notes, "not priced: its stages do not hold whole runs of its layers")))
    training = any(traced.analysis.backward)
    options = search_options(traced, StageOption())
    inputs = problem_for(layers, cluster, traced.batch_size, tokens_per_example(traced), options)
    if not training:
        inputs = replace(inputs, training=False, state_factor=1.0, optimizer_traffic=0.0)
    stages = tuple(replace(s, layer_start=a, layer_end=b, zero=s.zero if training else 0, remat=s.remat if training else "",
                           offload=s.offload if training else "", offloaded=s.offloaded if training else (),
                           # the train step's collectives name its layers, not this function's: Megatron's estimate
                           model_collectives=(),
                           flops=sum(layers.flops[a:b]))  # the function's own: a forward-only eval's, no backward
                   for s, (a, b) in zip(plan.stages, bounds))
    return priced(replace(plan, stages=stages, num_layers=layers.num_layers, cost_inputs=inputs))


def _whole_batch(traced: TracedStep, option: StageOption) -> StageOption:
    """A step that only runs whole (one microbatch, nothing it could combine) runs as
    one pipeline: data-parallel replicas would each see part of the batch."""
    if not traced.analysis.single:
        return option
    if (option.num_replicas or 1) > 1:
        raise PlanError(
            f"this step only runs on the whole batch at once (its per-example results cannot be combined), "
            f"so it cannot be split over num_replicas={option.num_replicas} data-parallel pipelines; leave num_replicas unset"
        )
    return replace(option, mode="manual" if option.mode == "auto" else option.mode, num_replicas=1)


@timed_pass("layers")
def layers_pass(traced: TracedStep, cluster: Cluster, option: StageOption, auto: bool) -> Layers:
    """The step cut into layers at module boundaries: as many as the user asked for,
    enough for the stages, or (for the planner) one per repeated block at least, found
    by structure at whatever depth the blocks sit, plus the embedding and the head (so
    a faster kind can take any number of blocks), and one per device up to
    `max_planning_layers`; fewer only when the step cannot be cut that finely."""
    if option.num_layers:
        return layers_of(traced, option.num_layers)
    flops = [c.flops for c in op_costs(traced.full)]
    wanted = max(block_count(traced.full, traced.analysis, flops), min(cluster.num_devices, option.max_planning_layers))
    structure = structure_of(traced.full, traced.analysis, flops)
    if structure is not None and wanted > structure.pieces:
        # Finer than one layer per block: every block cut alike (a block's layers match
        # every other block's), so no block is coarser than its neighbours.
        wanted = structure.pieces + structure.blocks * math.ceil((wanted - structure.pieces) / structure.blocks)
    if not auto:
        # Stages fixed by hand are cut as finely as the planner's, so a faster stage can
        # take more layers (one layer per stage would split the model evenly whatever
        # the speeds); a finer cut that cannot tell its layers apart by module (inside
        # a scanned block) is passed over for a coarser one.
        least = _stages_per_pipeline(option, cluster) * _chunks(option)
        for n in range(wanted, least, -1):
            try:
                layers = build_layers(traced.full, traced.analysis, flops, n)
            except PlanError:
                continue
            if len(set(layers.names)) == len(layers.names):
                return layers
        return layers_of(traced, least)
    for n in range(wanted, 0, -1):
        try:
            return build_layers(traced.full, traced.analysis, flops, n)
        except PlanError:
            continue
    raise PlanError("the step cannot be cut into layers")


@timed_pass("stage assignment")
def stage_pass(traced: TracedStep, layers: Layers, cluster: Cluster, option: StageOption, sharding: ShardingOption,
               auto: bool, search: SearchOptions, inputs: Problem) -> Plan:
    """Which layers form which stage on which devices: the planner's search over
    `inputs` (the cost inputs every plan is priced with), or the user's stage count
    with layers split by speed ("manual") or evenly ("uniform")."""
    num_microbatches = traced.batch_size // traced.microbatch_size
    if auto:
        planner = planner_for(inputs, search)
        plan, result = search_problem(layers, cluster, planner)
        notes = idle_kinds(cluster, planner, plan, result.best.step_s)
        if result.gap > 0:
            notes = (f"the search stopped at its time limit ({option.time_limit_s:g} s): this plan's step time is "
                     f"within {1 / max(1e-9, 1 - result.gap):.2f}x of the best possible (its bound); allow more time "
                     "to close the gap", *notes)
        return replace(plan, notes=(*plan.notes, *notes))
    if search.microbatches is None:  # the user fixed the stages, not the microbatches: the fastest count that fits
        return _fastest_count(traced, layers, cluster, option, sharding, search, inputs)
    return _fixed_stages(traced, layers, cluster, option, sharding, inputs, num_microbatches)


def _fixed_stages(traced: TracedStep, layers: Layers, cluster: Cluster, option: StageOption, sharding: ShardingOption,
                  inputs: Problem, num_microbatches: int) -> Plan:
    """The user's stage (or replica) count over `num_microbatches` microbatches."""
    uniform = option.mode == "uniform"
    stages = _stages_per_pipeline(option, cluster)
    schedule = option.schedule or schedules.DEFAULT
    speeds = {k.name: k.flops for k in inputs.kinds}  # sustained per device at the step's dtype
    if (option.num_replicas or 1) > 1:
        if traced.analysis.marked:
            log.warning(
                "num_replicas=%d on a hetpar.value_and_grad step: each pipeline runs its own share of every microbatch, "
                "so whatever the loss computes over the microbatch as a whole (batch statistics) it computes over that "
                "share, as data-parallel training without synchronised batch norm does, and the loss can differ from the "
                "per-microbatch one; leave num_replicas unset for the per-microbatch figures", option.num_replicas)
        plan = assign_replicas(layers, cluster, option.num_replicas, stages, num_microbatches, traced.batch_size,
                               schedule, uniform=uniform, chunks=_chunks(option), speeds=speeds)
    else:
        plan = assign_stages(layers, cluster, stages, num_microbatches, schedule, sharding.mesh_shape, uniform=uniform,
                             chunks=_chunks(option), speeds=speeds)
        _check_schedule(plan)
    if option.remat:
        plan = replace(plan, stages=tuple(replace(s, remat=option.remat) for s in plan.stages))
    if option.offload:
        plan = replace(plan, stages=tuple(replace(s, offload=option.offload) for s in plan.stages))
    return plan


def _fastest_count(traced: TracedStep, layers: Layers, cluster: Cluster, option: StageOption, sharding: ShardingOption,
                   search: SearchOptions, inputs: Problem) -> Plan:
    """The user's stages with the microbatch count the estimator rates fastest among
    those that run and fit (every data-parallel device keeping at least
    `search.min_microbatch` examples per microbatch where the batch allows); the
    first that runs when none fits, for the placement to refuse with its numbers."""
    best, best_s, first, why = None, float("inf"), None, ""
    for m in (m for m in range(1, traced.batch_size + 1) if traced.batch_size % m == 0):
        if m > 1 and traced.batch_size // m < search.min_microbatch:
            break
        try:
            plan = replace(_fixed_stages(traced, layers, cluster, option, sharding, inputs, m), cost_inputs=inputs)
            if check := runnable_problems(plan, traced.batch_size):
                raise PlanError("; ".join(check))
        except PlanError as e:
            why = why or str(e)
            continue
        first = first or plan
        cost = estimate_plan(plan)
        if cost.fits and cost.step_s < best_s:
            best, best_s = plan, cost.step_s
    if best is None and first is None:
        raise PlanError(why or "no microbatch count runs these stages")
    chosen = best or first
    log.info("stages fixed by hand: %d microbatches, the fastest count that fits", chosen.num_microbatches)
    return chosen


def idle_kinds(cluster: Cluster, planner: Planner, plan: Plan, step_s: float) -> list[str]:
    """One line per device kind the planner's best plan leaves idle, with the number
    that decided it: the best plan that puts every kind to work, priced by the same
    estimator (or why there is none), searched with what the planner already priced."""
    used = {s.group for s in plan.stages}
    idle = [g for g in cluster.groups if g.label not in used]
    if not idle:
        return []
    what = ", ".join(f"{g.type_name} x{g.size}" for g in idle)
    announce(f"the best plan that also uses {what}")  # (a second search: seconds on a 768-GPU cluster)
    try:
        every = planner.requiring_every_kind().solve().best
    except PlanningError as e:
        return [f"{what} idle: no plan that uses every kind fits or runs ({e})"]
    return [f"{what} idle: the best plan using every kind is {every.step_s / step_s:.2f}x slower ({every.describe()}: "
            f"{every.step_s * 1e3:.4g} ms a step against {step_s * 1e3:.4g} ms); use_all_kinds=True (--use-all-kinds) plans with them"]


def search_options(traced: TracedStep, option: StageOption, search_microbatches: bool = False,
                   zero: int | None = None) -> SearchOptions:
    """What the planner may choose for this step: the user's schedule, chunks and
    ZeRO stage (`ShardingOption.zero`) if given, the traced microbatch count unless
    `search_microbatches`; neither pipelines side by side nor a mixed-kind stage
    where the microbatch work may mix examples (`SearchOptions.allow_replicas`,
    `allow_mixed`): the planner's choice would change what the step computes."""
    chunks = {"chunks": (option.chunks,)} if option.chunks else {}  # else the planner's choices
    keeps_examples_apart = not (traced.analysis.marked or traced.analysis.single)
    return SearchOptions(
        microbatches=None if search_microbatches else (traced.batch_size // traced.microbatch_size,),
        schedules=(option.schedule,) if option.schedule else schedules.names(),
        min_microbatch=2 if traced.microbatch_size >= 4 or search_microbatches else 1,  # size 1 traces apart
        dtype=compute_dtype(traced.full, [c.flops for c in op_costs(traced.full)]),
        time_limit_s=option.time_limit_s, layer_overhead_s=option.layer_overhead_s, use_all_kinds=option.use_all_kinds,
        allow_replicas=keeps_examples_apart, allow_mixed=keeps_examples_apart,
        measured=measured_devices(option.profile) if option.profile else (),
        **({} if zero is None else {"zero_stages": (zero,)}), **chunks,
        **({} if option.offload is None else {"offload_tiers": (option.offload,)}),
        **({} if option.finalists is None else {"finalists": option.finalists}),
    )


def measured_devices(path: str) -> tuple[tuple[str, Measured], ...]:
    """A `hetpar profile` file's figures per device type, as the cost inputs take them:
    sustained matmul rate and its half-rate size, memory bandwidth and the all-reduce
    link, per device of the mesh each was measured on."""
    profile = Profile.load(path)
    out = []
    for name, entry in sorted(profile.devices.items()):
        c = entry.compute
        link = LinkCost(entry.allreduce_bandwidth, entry.allreduce_latency_s) if entry.allreduce_bandwidth > 0 else None
        out.append((name, Measured(c.matmul_flops, c.half_flops, c.memory_bandwidth, link, entry.shared_host)))
    log.info("priced with measured figures for %s (profile %s)", ", ".join(n for n, _ in out) or "no device", path)
    return tuple(out)


def with_measured_layers(inputs: Problem, traced: TracedStep, layers: Layers, cluster: Cluster, profile: Profile) -> Problem:
    """`inputs` with the layers `profile` measured (`hetpar profile --layers`) for this
    step's layers (by signature and dtype) on the cluster's device kinds: the
    estimator prices those from the measurement, the rest from the model. A kind
    measured on a shared host (CPU virtual devices) is priced as one."""
    if not profile.layers:
        return inputs
    flops = [c.flops for c in op_costs(traced.full)]
    signatures = layer_signatures(traced.full, traced.analysis, layers)
    measured = problem_layers(profile.layers, signatures, dtype_policy(compute_dtype(traced.full, flops)),
                              [(g.label, g.type_name) for g in cluster.groups])
    shared = {m.kind for m in measured if m.shared_host}
    kinds = tuple(replace(k, shared_host=True) if k.name in shared else k for k in inputs.kinds)
    profiled = {g.label for g in cluster.groups if g.type_name in {r.device_kind for r in profile.layers}}
    for kind in inputs.kinds:
        got = sorted({m.layer for m in measured if m.kind == kind.name})
        log.info("%s: layers %s measured (profile), %d modelled", kind.name, got or "none", layers.num_layers - len(got))
        if kind.name in profiled and len(got) < layers.num_layers and profile.jax_version not in ("", jax.__version__):
            log.warning("%s: %d of the step's %d layers match no record of the profile, which JAX %s traced; this is "
                        "JAX %s, which may trace a layer as other operators: profile under this JAX for measured prices",
                        kind.name, layers.num_layers - len(got), layers.num_layers, profile.jax_version, jax.__version__)
    return replace(inputs, kinds=kinds, measured_layers=measured)


def tokens_per_example(traced: TracedStep) -> int:
    return _tokens(traced) // traced.batch_size


def _chunks(option: StageOption) -> int:
    """Stages per device group of a hand-made plan: the user's count, or the
    schedule's default (1 unless it interleaves)."""
    return option.chunks or schedules.get(option.schedule or schedules.DEFAULT).default_chunks


def _check_schedule(plan: Plan) -> None:
    """Refuses a hand-made pipeline its schedule cannot run (say, an interleaved
    schedule over a microbatch count that is not a multiple of the device groups)."""
    groups = plan.num_stages // plan.chunks
    why = schedules.get(plan.schedule).check(groups, plan.num_microbatches, plan.chunks)
    if why:
        raise PlanError(why)


def _stages_per_pipeline(option: StageOption, cluster: Cluster) -> int:
    """The user's stage count; without one, a pipeline per replica has one stage and
    a single pipeline one stage per device group."""
    if option.num_stages:
        return option.num_stages
    return 1 if (option.num_replicas or 1) > 1 else min(len(cluster.groups), cluster.num_devices)


@timed_pass("sharding")
def sharding_pass(traced: TracedStep, layers: Layers, plan: Plan, option: ShardingOption,
                  devices_per_node: dict[str, int] | None, links: dict[str, LinkCost] | None = None) -> Plan:
    """Each stage's operator shardings (and, with `devices_per_node`, its mesh),
    collectives priced on the cluster's links (`links`, by group)."""
    return shard_stages(traced, layers, plan, option, devices_per_node, links)


@timed_pass("placement")
def placement_pass(traced: TracedStep, layers: Layers, plan: Plan) -> Plan:
    """Where each parameter and optimizer state lives, and the plan priced by the
    estimator (`hetpar.plan.costs`): its memory per device is the one memory model's
    answer, the same the planner searched with; refuses a plan that does not fit."""
    placed = _placed_params(traced, plan)
    plan = replace(plan, stages=tuple(replace(s, param_specs=tuple((name, spec) for name, spec, _, _ in specs))
                                      for s, specs in zip(plan.stages, placed)))
    dots = {s.index: _dots_kept(traced, plan, s) / traced.batch_size for s in plan.stages if s.remat == "dots"}
    cost = estimate_plan(plan, dots)
    too_big = fit_problems(plan, cost)
    if too_big and all(c.fits_device for c in cost.stages):
        where = "host memory" if not all(c.fits_host for c in cost.stages) else "its nodes' disks (NVMe tier)"
        raise PlanError(f"the plan does not fit in {where}: " + "; ".join(too_big))
    if too_big:
        raise PlanError("the plan does not fit in memory: " + "; ".join(too_big) + ". To fit: more microbatches with a "
                        f"schedule that keeps fewer activations in flight (the planner's memory model: {', '.join(schedules.names())}), "
                        "recomputation, ZeRO, more stages, more devices, or a smaller batch")
    return priced(plan, dots)


def _operator_stages(traced: TracedStep, layers: Layers, plan: Plan) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each replica's stage of every operator, from the stages' layer ranges."""
    out = []
    for r in range(plan.num_replicas):
        layer_stage = [s.index for s in plan.replica_stages(r) for _ in range(s.layer_start, s.layer_end)]
        out.append(runs(op_stages(traced.full, traced.analysis, layers, layer_stage)))
    return tuple(out)


def _dots_kept(traced: TracedStep, plan: Plan, stage: StagePlan) -> int:
    """Full batch bytes a "dots" stage keeps besides its input: the results of its
    forward matmuls without batch dimensions that its backward's recomputation stops
    at (hetpar.compile.remat)."""
    graph, analysis = traced.full, traced.analysis
    here = [i for i, s in enumerate(plan.stage_of_operators(stage.replica)) if s == stage.index
            and analysis.phase[i] is Phase.MICRO]
    forward = [i for i in here if not analysis.backward[i]]
    wanted = [v for i in here if analysis.backward[i] for v in graph.ops[i].inputs]
    _, kept = rerun(graph, forward, wanted, saveable("dots"))
    return sum(graph.nbytes(v) for v in kept)


def _placed_params(traced: TracedStep, plan: Plan) -> list[tuple[tuple[str, Spec, int, str], ...]]:
    """Each stage's parameters and optimizer state (batch-free step inputs its
    operators read): path, sharding (replicated over a data-parallel stage mesh, or
    as the intra-op ILP lays it out on a data x model mesh), bytes per device, and
    role ("parameter" or "optimizer_state", hetpar.trace.microbatch.input_roles)."""
    specs = {s.index: dict(s.shardings) for s in plan.stages}
    position = {v: i for i, v in enumerate(traced.full.invars)}
    roles = input_roles(traced.full, traced.analysis, sorted(traced.batch_invars))
    out: list[list[tuple[str, Spec, int, str]]] = [[] for _ in plan.stages]
    for r in range(plan.num_replicas):
        stage_of_op = plan.stage_of_operators(r)
        owner: dict[int, int] = {}
        for op in traced.full.ops:  # the first operator to read a parameter places it
            for v in op.inputs:
                if v in position and traced.analysis.batch_axis.get(v) is None:
                    owner.setdefault(v, stage_of_op[op.index])
        for v, stage in sorted(owner.items(), key=lambda kv: position[kv[0]]):
            name = traced.input_paths[position[v]] if traced.input_paths else f"arg {position[v]}"
            spec = specs[stage].get(v)
            role = "optimizer_state" if roles.get(v) == "optimizer_state" else "parameter"
            if spec is None:
                out[stage].append((name, (), traced.full.nbytes(v), role))
            else:
                mesh = layout_axes(plan.stages[stage])
                shards = math.prod(mesh[a] for a in spec if a is not None)
                out[stage].append((name, tuple(spec), traced.full.nbytes(v) // shards, role))
    return [tuple(specs) for specs in out]


def _tokens(traced: TracedStep) -> int:
    """Examples x positions of the batch's first leaf: tokens for a sequence model."""
    first = traced.full.avals[traced.batch_invars[0]]
    shape = tuple(first.shape)
    return int(shape[0] * (shape[1] if len(shape) > 1 and first.dtype.kind in "iu" else 1))


def check_fits(plan: Plan, traced: TracedStep, cluster: Cluster, paths: tuple[str, ...] = ()) -> None:
    """Refuses a plan made for another step or another cluster, saying what differs
    (an argument by its pytree path where `paths` gives the step's, e.g.
    `traced.input_paths`)."""
    if plan.program is not None:
        diff = differences(plan.program, signature(traced.full), paths or traced.input_paths)
        if diff:
            raise PlanError("the plan was made for a different step: " + "; ".join(diff) + ". Run it with the step and "
                            "arguments it was solved for, or make a plan for this step (hetpar solve, or parallelize "
                            "without plan=)")
    if plan.replica_batch and sum(plan.replica_batch) != traced.batch_size:
        raise PlanError(f"the plan's replicas take {list(plan.replica_batch)} examples; this batch has {traced.batch_size}")
    if not plan.replica_batch and plan.num_microbatches * traced.microbatch_size != traced.batch_size:
        raise PlanError(f"the plan splits the batch into {plan.num_microbatches} microbatches; this batch of {traced.batch_size} needs another count")
    if plan.cost_inputs is not None:  # the pre-flight memory check: the one memory model, as placement asked it
        too_big = fit_problems(plan, estimate_plan(plan))
        if too_big:
            raise PlanError("the plan does not fit in memory: " + "; ".join(too_big) + ". Solve the plan again for this cluster")
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
