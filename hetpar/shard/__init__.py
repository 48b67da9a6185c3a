"""The sharding pass: each stage's operators on its `data` x `model` mesh (or
`data` x `model` x `model2`). The choices (`strategies.py`), solved by
`solver.intra_op`, become PartitionSpecs per value, written into the plan; the split
of a stage's devices into those axes is chosen by the same solver (`_best_mesh`,
then `model_axes.py` for a second model axis). Compile only reads what this pass wrote."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import replace
from typing import Callable

from hetpar.cluster.catalog import device_type
from hetpar.errors import PlanError
from hetpar.options import ShardingOption
from hetpar.passes import announce
from hetpar.plan import Plan, StagePlan
from hetpar.plan.costs import estimate_plan
from hetpar.shard.model_axes import model_collectives, with_model_axes
from hetpar.shard.strategies import AXES, Spec, StageProblem, tensor_parallel, to_source, stage_problem
from hetpar.shard.zero import apply_zero, offloaded_state, stage_params, zero_items
from hetpar.trace.flops import op_costs
from hetpar.trace.layers import Layers, compute_dtype
from hetpar.trace.traced_step import TracedStep
from solver.collectives import LinkCost, Topology
from solver.intra_op import IntraOpError, IntraOpProblem, IntraOpSolution, peak_bytes, solve_intra_op
from solver.memory import model_split_bytes, sharded_state
from solver.zero import choose_zero

log = logging.getLogger(__name__)


def mesh_axes(stage: StagePlan) -> dict[str, int]:
    """The stage mesh's axes and sizes: `data`, then `model` (and `model2` on a
    3-axis mesh, 3D tensor parallelism) where its shape has them."""
    shape = stage.mesh_shape or (stage.num_devices,)
    return dict(zip(AXES, shape))


def layout_axes(stage: StagePlan) -> dict[str, int]:
    """Every axis the stage's layouts may name, with its size: the mesh's, and on a
    hybrid-sharded stage `zero`, ZeRO's in-node part of the data axis."""
    axes = mesh_axes(stage)
    if 0 < stage.zero_group < axes.get("data", 1):
        axes["zero"] = stage.zero_group
    return axes


def shard_stages(traced: TracedStep, layers: Layers, plan: Plan, option: ShardingOption,
                 devices_per_node: dict[str, int] | None = None, links: dict[str, LinkCost] | None = None) -> Plan:
    """The sharding pass: every stage's shardings, written into the plan (where
    compile reads them). With `devices_per_node` (by cluster group) each stage's
    split into `data` x `model` is chosen here too (see `_best_mesh`); otherwise the
    plan's mesh shapes stand. `links` (by cluster group) are the links inside a node,
    as the cluster file gives them, that the model axis's collectives cross; a group
    not in it is priced with its device type's catalog link. `plan.operator_stages`
    must be set."""
    solver = _StageSolver(traced, layers, plan, option, links or {})
    stages = []
    for stage in plan.stages:
        announce(f"sharding stage {stage.index + 1} of {len(plan.stages)} ({stage.num_devices} {stage.device_type})")
        if devices_per_node is not None:
            stage = _best_mesh(solver, plan, stage, traced.batch_size, devices_per_node.get(stage.group, stage.num_devices))
        if option.factor_model_axis or (option.factor_model_axis is None and devices_per_node is not None):
            stage = _model_axes(solver, plan, stage)
        mesh = mesh_axes(stage)
        stage = replace(stage, zero_group=zero_group(stage, mesh, option, plan))
        specs, _, operands, moved = solver.solve(stage, mesh) if tensor_parallel(mesh) else ({}, 0.0, {}, ())
        moved = moved if AXES[2] in mesh else ()  # one model axis: priced by Megatron's collectives (solver.cost.model_axes)
        specs, zero, gathered = _zero(traced, layers, plan, stage, specs, mesh, option, solver.link(stage))
        kept = offloaded_state(traced, plan, stage) if stage.offload else ()
        stages.append(replace(stage, shardings=tuple(sorted(specs.items())), operand_shardings=tuple(sorted(operands.items())),
                              zero=zero, zero_group=stage.zero_group if zero else 0, gathered=tuple(sorted(gathered.items())),
                              offloaded=kept, model_collectives=moved))
    return replace(plan, stages=tuple(stages))


def _model_axes(solver: "_StageSolver", plan: Plan, stage: StagePlan) -> StagePlan:
    """A stage whose model axis has 4 or more devices, on one model axis or two
    (`hetpar.shard.model_axes`), whichever its ILP prices cheaper; its degrees kept.
    Where the plan can be priced, the two axes are kept only if the one estimator
    agrees that the step is not slower, each mesh priced with the collectives its
    ILP solution runs: the ILP sees one stage's matmuls, the estimator the whole step
    (how often each collective runs, the bubble, the other stages)."""
    chosen = with_model_axes(stage, lambda mesh, beat: solver.cost(stage, mesh, beat))
    if chosen.mesh_shape == stage.mesh_shape:
        return stage
    chosen = replace(chosen, data_parallel=chosen.mesh_shape[0], tensor_parallel=math.prod(chosen.mesh_shape[1:]))
    if plan.cost_inputs is None:
        return chosen
    trials = {"one": replace(stage, model_collectives=solver.solve(stage, mesh_axes(stage))[3]),
              "two": replace(chosen, model_collectives=solver.solve(chosen, mesh_axes(chosen))[3])}
    step = {name: estimate_plan(replace(plan, stages=tuple(trial if s.index == stage.index else s for s in plan.stages))).step_s
            for name, trial in trials.items()}
    if step["two"] > step["one"]:
        log.info("stage %d: kept one model axis: the estimator prices the step on %s at %.4g s against %.4g s",
                 stage.index, "x".join(map(str, chosen.mesh_shape)), step["two"], step["one"])
        return stage
    return chosen


def zero_group(stage: StagePlan, mesh: dict[str, int], option: ShardingOption, plan: Plan | None = None) -> int:
    """The stage's hybrid-sharding group (StagePlan.zero_group): the user's
    `option.zero_group` where it splits the data axis ("auto": `_auto_group`), else
    the stage's own (a plan's decision); 0 where ZeRO spans the whole data axis. A
    group that does not divide the data axis is refused, naming the stage and the
    sizes that would."""
    dp = mesh.get("data", 1)
    if option.zero_group == "auto":
        return _auto_group(plan, stage, mesh, option)
    group = option.zero_group if option.zero_group else stage.zero_group
    if not group or group >= dp:
        return 0
    if dp % group:
        divisors = [d for d in range(1, dp) if dp % d == 0]
        raise PlanError(f"stage {stage.index}: zero_group {group} does not divide its data axis of {dp} devices; "
                        f"use one of {divisors} (the devices of a node) or 0 to shard over all of them")
    return group


def _auto_group(plan: Plan | None, stage: StagePlan, mesh: dict[str, int], option: ShardingOption) -> int:
    """`zero_group="auto"`: a stage whose ZeRO stage is known (forced, or the
    planner's) and whose data axis spans several nodes shards within a node (its data
    ranks there) where the estimator prices that step faster, or where only it fits;
    otherwise over the whole data axis."""
    level = option.zero if option.zero is not None else stage.zero
    dp = mesh.get("data", 1)
    inputs = plan.cost_inputs if plan is not None else None
    kind = next((k for k in inputs.kinds if k.name == stage.group), None) if inputs is not None else None
    if not level or kind is None:
        return 0
    group = kind.devices_per_node // (stage.num_devices // dp)
    if group < 2 or group >= dp or dp % group:
        return 0
    priced = {}
    for g in (0, group):
        trial = replace(stage, zero=level, zero_group=g)
        cost = estimate_plan(replace(plan, stages=tuple(trial if s.index == stage.index else s for s in plan.stages)))
        priced[g] = (not cost.stages[stage.index].fits, cost.step_s)
    chosen = min(priced, key=lambda g: priced[g])
    log.info("stage %d: ZeRO-%d over %s (estimated %.4g s against %.4g s)", stage.index, level,
             f"groups of {group} (a node's data ranks)" if chosen else "the whole data axis", priced[chosen][1],
             priced[group if not chosen else 0][1])
    return chosen


def zero_shards(stage: StagePlan, mesh: dict[str, int]) -> tuple[int, str]:
    """How many devices the stage's ZeRO shards over and the layout axis naming them:
    its in-node group on `zero` (hybrid), else the whole data axis."""
    dp = mesh.get("data", 1)
    return (stage.zero_group, "zero") if 0 < stage.zero_group < dp else (dp, "data")


def _zero(traced: TracedStep, layers: Layers, plan: Plan, stage: StagePlan, specs: dict[int, Spec], mesh: dict[str, int],
          option: ShardingOption, link: LinkCost) -> tuple[dict[int, Spec], int, dict[int, Spec]]:
    """The stage's ZeRO stage per parameter (forced by `option.zero`, or the stage
    assignment's choice where the planner priced one, or else chosen by
    `solver.zero.choose_zero` against the memory its devices have left after the
    activations its schedule keeps in flight), laid out in its shardings."""
    dp = mesh.get("data", 1)
    if dp == 1 or option.zero == 0:
        return specs, 0, {}
    params = stage_params(traced, plan.stage_of_operators(stage.replica), stage.lead)
    shards, axis = zero_shards(stage, mesh)
    forced = option.zero if option.zero is not None else stage.zero  # the user's, or the planner's priced choice
    if forced:
        levels = [forced] * len(params)
    else:
        if not stage.memory_capacity:
            return specs, 0, {}
        budget = memory_share(stage, plan) - kept_bytes(plan, stage)
        items = zero_items(traced, params, specs, mesh, shards)
        if stage.offload:  # the optimizer state lives in host memory: ZeRO frees no device memory of it
            items = [replace(item, opt_bytes=0.0) for item in items]
        levels = choose_zero(items, shards, Topology(1, shards, link, link), plan.num_microbatches, budget)
    specs, zero, gathered = apply_zero(traced, params, levels, specs, shards, axis)
    if zero:
        log.info("stage %d: ZeRO-%d over %d devices of its %d-way data axis (%d of %d parameters sharded)", stage.index, zero,
                 shards, dp, sum(1 for z in levels if z), len(params))
    return specs, zero, gathered


def kept_bytes(plan: Plan, stage: StagePlan) -> float:
    """Per device, the activations the stage keeps for its backward under its
    recomputation: the estimator's figure (the one memory model), which depends on the
    stage's device count, not on how its mesh splits them."""
    return estimate_plan(plan).stages[stage.index].memory.activations


def memory_share(stage: StagePlan, plan: Plan) -> float:
    """The memory per device this stage may fill: all its devices have, unless other
    chunks of an interleaved plan share them, when each gets a share in proportion to
    the memory the planner predicted for it (equal shares without a prediction).
    Budgeting each chunk against the whole device let two chunks that each fit
    overflow it together."""
    sharing = [s for s in plan.stages if s.device_ids == stage.device_ids]
    if len(sharing) == 1:
        return float(stage.memory_capacity)
    planned = [s.memory_bytes for s in sharing]
    if all(planned):
        return stage.memory_capacity * stage.memory_bytes / sum(planned)
    return stage.memory_capacity / len(sharing)


def matmul_speed(device_type_name: str, dtype: str) -> tuple[float, float]:
    """(sustained FLOP/s, F_half) at which the ILP prices a stage's matmuls on
    `solver.efficiency`'s curve: the planner's figures for the device kind
    (`hetpar.plan.auto.device_kinds`), so the two agree on a matmul's time."""
    spec = device_type(device_type_name)
    return spec.sustained_matmul_flops(dtype), spec.matmul_half_flops


def state_factor(zero: int, dp: int, offload: str = "") -> float:
    """Bytes of parameter, gradient and Adam state per parameter byte that a device of
    a `dp`-wide data axis holds at ZeRO stage `zero` (solver.memory's split): what
    the sharding ILP charges each weight byte against the stage's memory budget. A
    stage that keeps its optimizer state in host memory (`offload`) holds none of it."""
    held = sharded_state(1.0, 1.0, 0.0 if offload else 2.0, dp, zero)
    return held.parameters + held.gradients + held.optimizer_state


def _best_mesh(solver: "_StageSolver", plan: Plan, stage: StagePlan, batch_size: int, per_node: int) -> StagePlan:
    """The stage's devices split into `data` x `model` as the sharding solver finds
    fastest, as Alpa has its intra-op pass price each logical mesh: a model axis
    within a node where the stage's weights are large against its microbatch, else
    all data parallel. The planner's own `dp x tp` came from a rougher estimate; this
    is the final word. The data axis must divide the stage's microbatch, since it
    splits examples (a mixed stage's part's: its own rows); where all data parallel
    would not, the planner's own split (whose data axis does) is the fallback."""
    n = stage.num_devices
    micro = (plan.replica_batch[stage.replica] if plan.replica_batch else batch_size) // plan.num_microbatches
    micro = stage.examples or micro  # a mixed stage's part (or lead) splits only its own rows
    shapes = [(n // m, m) for m in range(2, min(n, per_node) + 1) if n % m == 0 and per_node % m == 0 and micro % (n // m) == 0]
    all_data = micro % n == 0
    # Only meshes the one memory model says fit, where any does (the planner's own does).
    fitting = [shape for shape in shapes if _fits(plan, stage, shape)]
    any_fits = bool(fitting) or _fits(plan, stage, tuple(stage.mesh_shape or (n,)))
    if any_fits:
        shapes = fitting
        all_data = all_data and _fits(plan, stage, (n,))
    best: tuple[int, ...] = (n,) if all_data else tuple(stage.mesh_shape)
    least = float("inf")
    if shapes:
        if all_data:
            least = solver.solve(stage, {"data": n})[1] * (1 - solver.option.model_axis_margin)
        for d, m in shapes:
            cost = solver.cost(stage, {"data": d, "model": m}, beat=least)
            if cost < least:
                best, least = (d, m), cost
    if len(best) == 2:
        log.info("stage %d: a %dx%d (data x model) mesh, its matmuls predicted at %.3g s", stage.index, *best, least)
    return replace(stage, mesh_shape=best, data_parallel=best[0], tensor_parallel=best[1] if len(best) == 2 else 1)


def _fits(plan: Plan, stage: StagePlan, shape: tuple[int, ...]) -> bool:
    """Whether `stage` on a mesh of `shape` fits its devices, as the estimator (the
    placement's fit check) says; True for a plan without cost inputs."""
    if plan.cost_inputs is None:
        return True
    trial = replace(stage, mesh_shape=shape, data_parallel=shape[0], tensor_parallel=shape[1] if len(shape) == 2 else 1)
    stages = tuple(trial if s.index == stage.index else s for s in plan.stages)
    return estimate_plan(replace(plan, stages=stages)).stages[stage.index].fits


class _StageSolver:
    """Solves a stage's sharding on a mesh once per pass (choosing a mesh and then
    recording its shardings ask the same question)."""

    def __init__(self, traced: TracedStep, layers: Layers, plan: Plan, option: ShardingOption, links: dict[str, LinkCost]):
        self.traced, self.layers, self.plan, self.option, self.links = traced, layers, plan, option, links
        self.dtype = compute_dtype(traced.full, [c.flops for c in op_costs(traced.full)])  # as the planner's
        self._solved: dict[tuple, tuple[dict[int, Spec], float, dict[int, tuple[Spec, Spec]], tuple]] = {}
        self._problems: dict[tuple, tuple[Callable, StageProblem, float] | None] = {}

    def solve(self, stage: StagePlan, mesh: dict[str, int]) -> tuple[dict[int, Spec], float, dict[int, tuple[Spec, Spec]], tuple]:
        """Value id -> layout (weights, matmul results), the predicted time,
        operator index -> its two operands' layouts (what compile pins), and the
        collectives those layouts run (`StagePlan.model_collectives`'s records)."""
        key = (stage.index, tuple(mesh.items()), stage.zero_group)  # the group sets the state ZeRO leaves per device
        if key not in self._solved:
            self._solved[key] = self._solve(stage, mesh)
            self._problems.pop(key, None)  # answered: its problem (megabytes on a 3-axis mesh) is not asked again
        return self._solved[key]

    def cost(self, stage: StagePlan, mesh: dict[str, int], beat: float = math.inf) -> float:
        """`solve`'s predicted time, or where the stage's solve without a memory budget
        already proves it no less than `beat`, that proof (its bound): a budget only
        adds constraints, so a mesh that loses without one loses with one, and the
        choice between meshes needs no budgeted solve of it (a budgeted solve is
        CP-SAT's search where the relaxation is fractional: seconds on a large stage).
        Likewise inf where the budgeted problem's relaxation costs more than `beat`."""
        key = (stage.index, tuple(mesh.items()), stage.zero_group)
        if key not in self._solved and beat < math.inf:
            free = self._problem(stage, mesh)
            if free is not None:
                floor = _solve_once(free[1].problem, self.option.time_limit_s).bound_s
                if floor >= beat:
                    self._problems.pop(key, None)
                    return floor
            solved = self._solve(stage, mesh, beat)
            self._problems.pop(key, None)
            if solved is None:
                return math.inf  # its budgeted problem's relaxation already costs more than `beat`
            self._solved[key] = solved
        return self.solve(stage, mesh)[1]

    def link(self, stage: StagePlan) -> LinkCost:
        """The link inside the stage's nodes: the cluster file's, else its device type's
        catalog link. The model axis's collectives and ZeRO's cross it alike."""
        catalog = device_type(stage.device_type).intra_node_link
        return self.links.get(stage.group, LinkCost(catalog.bandwidth, catalog.latency))

    def speed(self, stage: StagePlan) -> tuple[float, float]:
        """The stage's matmul rate and F_half as the planner priced its group (the
        cluster file's overrides and a profile included), else the catalog's."""
        inputs = self.plan.cost_inputs
        kind = next((k for k in inputs.kinds if k.name == stage.group), None) if inputs is not None else None
        if kind is not None and not kind.measured:
            return kind.flops, kind.matmul_half_flops
        return matmul_speed(stage.device_type, self.dtype)

    def _problem(self, stage: StagePlan, mesh: dict[str, int]) -> tuple[Callable, StageProblem, float] | None:
        """How to build the stage's problem on `mesh` under a budget, the problem
        without one (None where it has no matmul to shard), and the bytes of state per
        parameter byte its weights keep; kept per stage and mesh until it is answered
        (`cost` asks, then `_solve`)."""
        key = (stage.index, tuple(mesh.items()), stage.zero_group)
        if key not in self._problems:
            traced = self.traced
            of_op = self.plan.stage_of_operators(stage.replica)
            ops = [i for i, s in enumerate(of_op) if s == stage.lead]
            batch_free = {v for v in traced.full.invars if v not in traced.analysis.batch_axis}
            sustained, half = self.speed(stage)
            link = self.link(stage)
            factor = state_factor(self._zero(stage), zero_shards(stage, mesh)[0], stage.offload)
            build = lambda budget: stage_problem(traced.full, ops, batch_free, mesh, sustained, link,  # noqa: E731
                                                 budget, factor, batch_axis=traced.analysis.batch_axis,
                                                 op_layer=self.layers.op_layer,
                                                 data_state_factor=state_factor(0, mesh.get("data", 1), stage.offload),
                                                 matmul_half_flops=half)
            problem = build(None)
            self._problems[key] = None if problem is None else (build, problem, factor)
        return self._problems[key]

    def _zero(self, stage: StagePlan) -> int:
        """The stage's ZeRO stage: the user's, else the plan's."""
        return self.option.zero if self.option.zero is not None else stage.zero

    def _solve(self, stage: StagePlan, mesh: dict[str, int], beat: float = math.inf,
               ) -> tuple[dict[int, Spec], float, dict[int, tuple[Spec, Spec]], tuple] | None:
        """`solve`'s answer, or None where the stage's budgeted problem provably costs
        no less than `beat` (`solve_intra_op`'s refusal)."""
        traced = self.traced
        built = self._problem(stage, mesh)
        if built is None:
            return {}, 0.0, {}, ()
        build, problem, factor = built
        solution = _solve_once(problem.problem, self.option.time_limit_s)
        gathered = self._gathered(stage, self._zero(stage), mesh)
        within = self._within_memory(stage, build, problem, solution, factor, gathered, beat)
        if within is None:
            return None
        problem, solution = within
        log.info("stage %d sharded on %s: %.3g s predicted (%s)", stage.index, mesh, solution.cost_s,
                 "optimal" if solution.optimal else f"gap {solution.gap:.1%}")
        out: dict[int, Spec] = {}
        operands: dict[int, tuple[Spec, Spec]] = {}
        for n, op_index in enumerate(problem.dots):
            choice = problem.choices[n][solution.choice[n]]
            out[traced.full.ops[op_index].outputs[0]] = choice.out
            operands[op_index] = (choice.lhs, choice.rhs)
        for weight, (n, pos, dims) in problem.weights.items():
            choice = problem.choices[n][solution.choice[n]]
            out[weight] = to_source((choice.lhs, choice.rhs)[pos], dims)
        moved = model_collectives(traced, self.layers, stage, problem, solution.choice)
        return _follow_state(traced, out), solution.cost_s, operands, moved


    def _gathered(self, stage: StagePlan, zero: int, mesh: dict[str, int]) -> float:
        """Under ZeRO-3, the largest layer's parameters gathered while in use, per
        device (matmul weights split over the model axis, the rest whole): the
        workspace placement adds to a ZeRO-3 stage's state, as the planner does."""
        if zero < 3 or mesh.get("data", 1) == 1 or not self.layers.param_bytes:
            return 0.0
        span = slice(stage.layer_start, stage.layer_end)
        unsplit = self.layers.unsplit_param_bytes[span] if self.layers.unsplit_param_bytes else [0] * len(self.layers.param_bytes[span])
        model = mesh.get("model", 1) * mesh.get("model2", 1)
        return max((model_split_bytes(p, u, model) for p, u in zip(self.layers.param_bytes[span], unsplit)), default=0.0)

    def _within_memory(self, stage: StagePlan, build, problem, solution, factor: float = 4.0,  # noqa: ANN001
                       gathered: float = 0.0, beat: float = math.inf):
        """The fastest sharding is kept unless its weights' state overflows what the
        stage's devices have left after their activations and (ZeRO-3) `gathered`
        parameters (the planner priced the stage assuming its weights split over the
        model axis): then the ILP solves again under that budget. Where no sharding
        fits the budget, the fastest one stays and placement's fit check names the
        shortfall. None where the budgeted problem provably costs no less than `beat`."""
        if not stage.memory_capacity:
            return problem, solution
        unsplit = sum(self.layers.unsplit_param_bytes[stage.layer_start : stage.layer_end]) if self.layers.unsplit_param_bytes else 0
        # The ILP holds the matmuls' weights (`factor` bytes of state per weight byte
        # under the stage's ZeRO stage); the parameters no matmul reads (an embedding
        # table) stay whole on the model axis beside them.
        budget = int(memory_share(stage, self.plan) - kept_bytes(self.plan, stage) - factor * unsplit - gathered)
        bounded = build(max(budget, 0))
        if bounded is None or peak_bytes(bounded.problem, solution.choice) <= budget:
            return problem, solution
        try:
            solved = _solve_once(bounded.problem, self.option.time_limit_s, beat)
            return None if solved is None else (bounded, solved)
        except IntraOpError as e:
            log.info("stage %d: %s; keeping the fastest sharding", stage.index, e)
            return problem, solution

_SOLVED: OrderedDict[tuple, IntraOpSolution] = OrderedDict()
_SOLVED_MAX = 256


def _solve_once(problem: IntraOpProblem, time_limit_s: float, beat: float = math.inf) -> IntraOpSolution | None:
    """The ILP's answer, solved once per distinct problem: stages holding the same
    blocks on the same mesh (and a pass asked twice) pose the same problem up to the
    names of its operators, and a solve can take the whole time limit. None, not
    remembered, where the solver refuses the problem against `beat`."""
    # Edges in a canonical order: stages of the same blocks list their optimizer-update
    # edges in their parameters' order, which sorts "layers_10" before "layers_2".
    edges = tuple(sorted(problem.edges, key=lambda e: (e.src, e.dst, e.cost_s)))
    key = (tuple(n.strategies for n in problem.nodes), edges, problem.memory_limit_bytes, problem.live_sets,
           problem.same_as, time_limit_s)
    if key in _SOLVED:
        _SOLVED.move_to_end(key)
        return _SOLVED[key]
    solution = solve_intra_op(problem, time_limit_s, beat=beat)
    if solution is None:  # refused against `beat`: another caller may need the answer
        return None
    _SOLVED[key] = solution
    if len(_SOLVED) > _SOLVED_MAX:
        _SOLVED.popitem(last=False)
    return solution


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
