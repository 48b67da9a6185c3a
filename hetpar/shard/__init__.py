"""Intra-operator sharding of each stage on its `data` x `model` mesh: the choices
(`strategies.py`), solved by `solver.intra_op`, become PartitionSpecs per value; and
the split of a stage's devices into those two axes, chosen by the same solver."""

from __future__ import annotations

import logging
from dataclasses import replace

from hetpar.cluster.catalog import device_type
from hetpar.compile.tasks import op_stages
from hetpar.plan import Plan, StagePlan
from hetpar.shard.strategies import AXES, Spec, to_source, stage_problem
from hetpar.trace.layers import Layers
from hetpar.trace.traced_step import TracedStep
from solver.collectives import LinkCost
from solver.intra_op import solve_intra_op

log = logging.getLogger(__name__)

TIME_LIMIT_S = 5.0  # per stage; past it the best sharding found is used and its gap logged
# The solver prices matmuls and their collectives; the elementwise work between them,
# which it does not see, is repeated on every device of a model axis, so a model axis
# must win by this much.
MODEL_AXIS_MARGIN = 0.10
_SOLVED: dict[tuple, tuple[TracedStep, dict[int, Spec], float]] = {}  # planning and compiling share one solve


def mesh_axes(stage: StagePlan) -> dict[str, int]:
    shape = stage.mesh_shape or (stage.num_devices,)
    return dict(zip(AXES, shape)) if len(shape) == 2 else {AXES[0]: shape[0]}


def stage_specs(traced: TracedStep, layers: Layers, plan: Plan, stage: StagePlan, memory_budget: int | None = None) -> dict[int, Spec]:
    """Value id -> the mesh axis of each dimension, for the values the stage's
    sharding fixes: every matmul's result and every weight (by its first reader).
    Empty for a purely data-parallel stage (no `model` axis)."""
    mesh = mesh_axes(stage)
    if mesh.get("model", 1) == 1:
        return {}
    return dict(_solved(traced, layers, plan, stage, mesh, memory_budget)[0])


def choose_mesh_shapes(traced: TracedStep, layers: Layers, plan: Plan, devices_per_node: dict[str, int]) -> Plan:
    """Every stage's devices split into `data` x `model` as the sharding solver finds
    fastest, as Alpa has its intra-op pass price each logical mesh: a model axis
    within a node (`devices_per_node`, by cluster group) where the stage's weights
    are large against its microbatch, else all data parallel. The planner's own
    `dp x tp` came from a rougher estimate; this is the final word. The data axis
    must divide the stage's microbatch, since it splits examples."""
    stages = []
    for stage in plan.stages:
        n = stage.num_devices
        micro = (plan.replica_batch[stage.replica] if plan.replica_batch else traced.batch_size) // plan.num_microbatches
        per_node = devices_per_node.get(stage.group, n)
        shapes = [(n // m, m) for m in range(2, min(n, per_node) + 1)
                  if n % m == 0 and per_node % m == 0 and micro % (n // m) == 0]
        all_data = micro % n == 0  # else the planner's own data x model split, whose data axis divides it
        best: tuple[int, ...] = (n,) if all_data else tuple(stage.mesh_shape)
        if shapes:
            least = _solved(traced, layers, plan, stage, {"data": n}, None)[1] * (1 - MODEL_AXIS_MARGIN) if all_data else float("inf")
            for d, m in shapes:
                cost = _solved(traced, layers, plan, stage, {"data": d, "model": m}, None)[1]
                if cost < least:
                    best, least = (d, m), cost
        if len(best) == 2:
            log.info("stage %d: a %dx%d (data x model) mesh, its matmuls predicted at %.3g s", stage.index, *best, least)
        stages.append(replace(stage, mesh_shape=best, data_parallel=best[0], tensor_parallel=best[1] if len(best) == 2 else 1))
    return replace(plan, stages=tuple(stages))


def _solved(traced: TracedStep, layers: Layers, plan: Plan, stage: StagePlan, mesh: dict[str, int],
            budget: int | None) -> tuple[dict[int, Spec], float]:
    """The stage's sharding on `mesh` and its predicted time, solved once per plan."""
    key = (id(traced), tuple(layers.flops), stage.layer_start, stage.layer_end, stage.replica, tuple(mesh.items()), budget)
    if key not in _SOLVED:
        if len(_SOLVED) > 32:
            _SOLVED.clear()
        _SOLVED[key] = (traced, *_solve(traced, layers, plan, stage.index, tuple(mesh.items()), budget))  # holds `traced`: its id stays unique
    return _SOLVED[key][1], _SOLVED[key][2]


def _solve(traced: TracedStep, layers: Layers, plan: Plan, index: int, mesh_items: tuple,
           budget: int | None) -> tuple[dict[int, Spec], float]:
    stage = plan.stages[index]
    replica = plan.replica_stages(stage.replica)
    layer_stage = [s.index for s in replica for _ in range(s.layer_start, s.layer_end)]
    of_op = op_stages(traced.full, traced.analysis, layers, layer_stage)
    ops = [i for i, s in enumerate(of_op) if s == index]
    batch_free = {v for v in traced.full.invars if v not in traced.analysis.batch_axis}
    spec = device_type(stage.device_type)
    link = spec.intra_node_link
    problem = stage_problem(traced.full, ops, batch_free, dict(mesh_items), spec.matmul_flops(), LinkCost(link.bandwidth, link.latency),
                            budget, batch_axis=traced.analysis.batch_axis, op_layer=layers.op_layer)
    if problem is None:
        return {}, 0.0
    solution = solve_intra_op(problem.problem, TIME_LIMIT_S)
    log.info("stage %d sharded on %s: %.3g s predicted (%s)", index, dict(mesh_items), solution.cost_s,
             "optimal" if solution.optimal else f"gap {solution.gap:.1%}")
    out: dict[int, Spec] = {}
    for n, op_index in enumerate(problem.dots):
        choice = problem.choices[n][solution.choice[n]]
        out[traced.full.ops[op_index].outputs[0]] = choice.out
    for weight, (n, pos, dims) in problem.weights.items():
        choice = problem.choices[n][solution.choice[n]]
        out[weight] = to_source((choice.lhs, choice.rhs)[pos], dims)
    return _follow_state(traced, out), solution.cost_s


def _follow_state(traced: TracedStep, specs: dict[int, Spec]) -> dict[int, Spec]:
    """Optimizer state lies like the parameter it belongs to (same shape, path ending
    in the parameter's path), and the step's new state like the old, so the update
    runs where the parameters are instead of gathering them."""
    graph, paths = traced.full, traced.input_paths
    if paths:
        laid = {paths[k]: (v, specs[v]) for k, v in enumerate(graph.invars) if v in specs}
        for k, v in enumerate(graph.invars):
            if v in specs or v in traced.analysis.batch_axis:
                continue
            for path, (w, spec) in laid.items():
                tail = path.split("params", 1)[-1]
                if tail and paths[k].endswith(tail) and graph.avals[v].shape == graph.avals[w].shape:
                    specs[v] = spec
                    break
    for new, old in zip(graph.outvars, graph.invars):  # a step returns its new state first
        if old in specs and graph.avals[new].shape == graph.avals[old].shape:
            specs.setdefault(new, specs[old])
    return specs
