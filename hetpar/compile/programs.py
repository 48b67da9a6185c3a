"""Stage programs: each task becomes one jitted function on its stage's mesh.

A stage mesh is data parallel: values that carry the batch dimension are split over
its devices along that dimension, everything else is replicated. Reductions over the
examples stay per-data-shard partial sums across microbatches and are summed (one
all-reduce) when finished (partials.py); ZeRO-2/3 gradients are reduce-scattered per
microbatch (scatter.py). Reductions are accumulated inside the
program (the accumulator is donated), so a microbatch costs one dispatch per stage;
and a stage's update (its post work) runs inside the program of its last
microbatch (`compile_fused`), so it costs no dispatch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetpar.cluster.cluster import jax_devices
from hetpar.compile.once import CompiledOnce
from hetpar.compile.layouts import DATA_AXIS, MODEL2_AXIS, MODEL_AXIS, REPLICA_AXIS, ZERO_AXIS, data_entry, data_size, spec_sharding
from hetpar.compile.partials import partial_ops, partial_sums, stack_axis, stacked_spec
from hetpar.compile.scatter import reduce_scatter, scatter_ops
from hetpar.compile.tasks import Task
from hetpar.trace import jaxpr_ir
from hetpar.trace.microbatch import MicrobatchAnalysis
from hetpar.trace.opgraph import OpGraph


HOST_MEMORY = "pinned_host"  # the memory kind offloaded state lives in (JAX's page-locked host memory)


def stage_mesh(device_ids: tuple[int, ...], shape: tuple[int, ...] = (), zero_group: int = 0) -> Mesh:
    """A 1-D data-parallel mesh, or `data` x `model` when `shape` has two dimensions,
    `data` x `model` x `model2` when it has three (3D tensor parallelism). Auto axes:
    the traced step is mesh-agnostic, shardings are steered from outside.
    `zero_group` (hybrid sharding, `StagePlan.zero_group`): a divisor of the data
    axis below it splits that axis into `replica` x `zero`, consecutive devices (one
    node's) on `zero`, where ZeRO shards; layouts' `data` spans both (layouts.py)."""
    devices = np.array(jax_devices(device_ids))
    shape = tuple(shape) or (len(device_ids),)
    names = (DATA_AXIS, MODEL_AXIS, MODEL2_AXIS)[: len(shape)]
    if len(shape) == 2 and shape[1] == 1:
        shape, names = shape[:1], names[:1]
    if 0 < zero_group < shape[0]:
        if shape[0] % zero_group:
            raise ValueError(f"zero_group {zero_group} does not divide the data axis of {shape[0]} devices")
        shape, names = (shape[0] // zero_group, zero_group, *shape[1:]), (REPLICA_AXIS, ZERO_AXIS, *names[1:])
    return Mesh(devices.reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape))


def value_sharding(mesh: Mesh, aval: Any, batch_axis: int | None) -> NamedSharding:
    ndim = len(getattr(aval, "shape", ()))
    size = data_size(mesh)
    if batch_axis is not None and size > 1 and aval.shape[batch_axis] % size == 0:
        spec: list = [None] * ndim
        spec[batch_axis] = data_entry(mesh)
        return NamedSharding(mesh, PartitionSpec(*spec))
    return NamedSharding(mesh, PartitionSpec())


_COMBINE: dict[str, Callable] = {
    "sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "only": lambda acc, x: x,
}
_IDENTITY = {"sum": 0, "mean": 0, "max": -np.inf, "min": np.inf, "only": 0}


def shared_zeros(made: dict, shape: tuple, dtype: Any, sharding: Any = None) -> jax.Array:
    """Zeros of `shape` and `dtype` where `sharding` places them (else on the default
    device), one array per (shape, dtype, sharding) kept in `made`: a program donates
    only its accumulators, never its inputs, so runs that zero-fill their inputs from
    one dict may share the arrays (a profile's runs, a step run on zeros)."""
    key = (shape, dtype, sharding)
    if key not in made:
        x = jnp.zeros(shape, dtype)
        made[key] = x if sharding is None else jax.device_put(x, sharding)
    return made[key]


def accumulator_dtype(dtype: Any, combine: str) -> Any:
    """Sums of low-precision floats accumulate in float32, as `jax.jit` keeps f32
    parameters and optimizer state: adding a bf16 gradient per microbatch into a bf16
    accumulator would round at every microbatch. max/min are exact in any dtype."""
    if combine in ("sum", "mean") and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return dtype


@dataclass
class Program:
    task: Task
    mesh: Mesh
    fn: Callable  # (accumulators, *inputs) -> (outputs, accumulators)
    in_shardings: tuple[NamedSharding, ...]
    acc_shardings: tuple[NamedSharding, ...]
    init_acc: Callable | None  # () -> accumulators of zeros (or the combine's identity)
    finish: Callable | None = None  # accumulators -> the reductions: partial stacks summed, in their own dtype
    arg_types: tuple = ()  # (accumulators, *inputs) as ShapeDtypeStructs with their shardings
    # Reductions accumulated as stacks of per-data-shard partial sums, reduced over
    # `data` once, by `finish` or the fused update (partials.py), not per microbatch.
    stacked: frozenset[int] = frozenset()
    # The first microbatch: (*inputs) -> (outputs, accumulators), its reductions made
    # the accumulators (what `fn` from `init_acc`'s would give), so a step does not
    # dispatch (and fill) fresh accumulators per stage before its first microbatch.
    first: Callable | None = None

    def run(self, acc: tuple | None, args: Sequence[Any], last: bool) -> tuple[tuple, tuple]:
        """One microbatch, from the accumulators `acc` (None: the first). With `last`,
        returns the finished reductions in place of the accumulators."""
        if acc is None and self.first is not None:
            outs, acc = self.first(*args)
        else:
            outs, acc = self.fn(() if acc is None else acc, *args)
        if last and self.finish is not None:
            acc = self.finish(acc)
        return outs, acc

    def lower(self) -> Any:
        """The program lowered for its argument types, e.g. `.as_text()` for StableHLO:
        what two processes compare to know they run the same thing."""
        return self.fn.lower(*self.arg_types)


def compile_task(
    task: Task, graph: OpGraph, constants: dict[int, Any], analysis: MicrobatchAnalysis, mesh: Mesh, num_microbatches: int,
    mean_weight: float | None = None, specs: dict[int, tuple] | None = None,
    operand_specs: dict[int, tuple[tuple, tuple]] | None = None, gathered: dict[int, tuple] | None = None,
    host: frozenset[int] = frozenset(),
) -> Program:
    """`graph` is the trace at the shapes this program runs with (one microbatch);
    `constants` are the full-batch trace's, so means divide by the full batch
    (unless the step is marked: then each microbatch is its own mean, averaged here
    with `mean_weight`, its share of the batch: 1/num_microbatches unless microbatches
    differ in size, as on data-parallel replicas of different speeds). `specs` are
    the stage's intra-op shardings: weights arrive in them, matmul results are
    constrained to them, and XLA's partitioner fills in the collectives.
    `operand_specs` (operator index -> its two operands' layouts) pins each matmul's
    operands to the layout its strategy was priced with. Without the pins Shardy
    chooses the operand layouts itself, and for a matmul whose operands arrive
    axis-swapped against its result ((data, model) in, (model, data) out) it
    computes wrong numbers (tests/test_shardy_axis_swap.py); with every operand
    pinned, each dot is partitioned exactly as chosen and the reshards between
    dots are plain layout changes, which it gets right.
    `gathered` (ZeRO-3: parameter -> its layout while in use) gathers each parameter
    that arrives sharded over `data` where a forward or backward program reads it;
    the once-per-step update keeps working on the shards. `host` (host offload) names
    the values that live in host memory between steps: they arrive and leave in
    their layout's `pinned_host` memory kind and are moved to the devices where the
    program reads them."""
    if task.kind == "pre" and analysis.whole_batch and not analysis.marked:
        # Once-per-step work before the microbatches sees the whole batch (whole_batch.py);
        # everything else in it is batch-independent, the same in both traces.
        graph = analysis.full
    body = _Body(task, graph, constants, analysis, mesh, num_microbatches, mean_weight, specs, operand_specs, gathered, host)

    def run(acc: tuple, *args: Any) -> tuple[tuple, tuple]:
        env = body.evaluate(args)
        return tuple(env[v] for v in task.outputs), body.accumulate(acc, env)

    in_sh, out_sh, acc_sh = body.shardings(task.inputs), body.shardings(task.outputs), body.acc_shardings()
    arg_types = (body.acc_types(), *body.types(task.inputs, in_sh))
    name = program_name(task)
    fn = CompiledOnce(jax.jit(run, in_shardings=(acc_sh, *in_sh), out_shardings=(out_sh, acc_sh), donate_argnums=0),
                      arg_types, name)

    init_acc = finish = first = None
    if task.reductions:
        def run_first(*args: Any) -> tuple[tuple, tuple]:
            env = body.evaluate(args)
            return tuple(env[v] for v in task.outputs), body.started(env)

        first = CompiledOnce(jax.jit(run_first, in_shardings=in_sh, out_shardings=(out_sh, acc_sh)), arg_types[1:],
                             f"{name}: first microbatch")
        acc_types = body.acc_types()
        init_acc = CompiledOnce(jax.jit(
            lambda: tuple(jnp.full(a.shape, _IDENTITY[c], a.dtype) for a, c in zip(acc_types, body.combine)),
            out_shardings=acc_sh,
        ), (), f"{name}: zeros of its sums")
        if body.stacked or any(d != a.dtype for a, d in zip(body.reduction_avals, body.acc_dtypes)):
            finish = CompiledOnce(jax.jit(body.finals, in_shardings=(acc_sh,), out_shardings=body.shardings(task.reductions)),
                                  (acc_types,), f"{name}: finished sums")
    return Program(task, mesh, fn, in_sh, acc_sh, init_acc, finish, arg_types, frozenset(body.stacked), first)


def program_name(task: Task, fused: bool = False) -> str:
    """How a progress line names a stage program."""
    kind = {"pre": "once-per-step work before", "fwd": "forward", "bwd": "backward", "post": "update"}.get(task.kind, task.kind)
    return f"stage {task.stage} {kind}" + (" with its update" if fused else "") + (f" (phase {task.phase})" if task.phase else "")


@dataclass(frozen=True)
class Fusion:
    """What a runtime reads of a fused update (FusedProgram), known without compiling
    it: which post program is folded in (and, with one microbatch, which pre program),
    what the fused program reads from outside, which finished reductions it still
    returns, and what it makes. A process (or a Ray driver) that does not run the
    stage needs this to keep its books."""

    post: Task
    post_inputs: tuple[int, ...]  # what the post (and pre) work reads from outside the fused program
    reductions: tuple[int, ...]  # the finished reductions still needed after it
    accumulates: bool  # False with one microbatch: nothing to add to, no accumulator argument
    inputs: tuple[int, ...] = ()  # of the microbatch task's inputs, those from outside (not made by `pre`)
    pre: Task | None = None  # the stage's pre work, folded in (its program is not dispatched)


def fusion(task: Task, post: Task, keep: set[int], num_microbatches: int, pre: Task | None = None) -> Fusion:
    """`task`'s last microbatch with `post` folded in, and `pre` before it where given
    (one microbatch only): `keep` names the reductions someone other than `post` reads
    (a later post phase, a step output)."""
    own, made_before = set(task.reductions), set(pre.outputs) if pre is not None else set()
    inputs = [v for v in task.inputs if v not in made_before]
    post_inputs = [v for v in post.inputs if v not in own and v not in made_before]
    if pre is not None:
        post_inputs += [v for v in dict.fromkeys(pre.inputs) if v not in inputs and v not in post_inputs]
    return Fusion(post, tuple(post_inputs), tuple(v for v in task.reductions if v in keep), num_microbatches > 1,
                  tuple(inputs), pre)


@dataclass
class FusedProgram:
    """A stage's last microbatch and its once-per-step update in one program: the
    microbatch's work (a backward, or the last stage's forward and backward), the
    last accumulation, and the post work (the optimizer update) on the finished
    reductions. It replaces, for the last microbatch, the dispatch of `task` and the
    separate dispatch of `post`, so the gradients never return to the runtime
    between them and XLA fuses the update into the backward. With one microbatch it
    may also hold the stage's pre work (`pre`): the step's only dispatch on the
    stage, a whole one-stage step in one program, as `jax.jit` runs it."""

    task: Task  # the per-microbatch task whose last microbatch this runs (inputs: those from outside the program)
    post: Task  # the post work folded in
    mesh: Mesh
    fn: Callable  # (accumulators, *task inputs, *post_inputs) -> (outputs, reductions, post outputs)
    in_shardings: tuple[NamedSharding, ...]  # of task.inputs, then post_inputs
    post_inputs: tuple[int, ...]  # what the post (and pre) work reads from outside this program
    reductions: tuple[int, ...]  # the finished reductions still needed after it (others, step outputs)
    accumulates: bool  # False with one microbatch: nothing to add to, no accumulator argument
    arg_types: tuple = ()
    pre: Task | None = None  # the stage's pre work, folded in (its program is not dispatched)

    def lower(self) -> Any:
        """As `Program.lower`: what two processes compare."""
        return self.fn.lower(*self.arg_types)


def compile_fused(
    task: Task, post: Task, graph: OpGraph, constants: dict[int, Any], analysis: MicrobatchAnalysis, mesh: Mesh,
    num_microbatches: int, keep: set[int], mean_weight: float | None = None, specs: dict[int, tuple] | None = None,
    operand_specs: dict[int, tuple[tuple, tuple]] | None = None, gathered: dict[int, tuple] | None = None,
    pre: Task | None = None, host: frozenset[int] = frozenset(),
) -> FusedProgram:
    """`task`'s last microbatch with `post` after it (see FusedProgram), and `pre`
    before it where given (one microbatch only: its outputs must be read by `task`
    and `post` alone, `fold_pre` checks). `keep` names the reductions someone other
    than `post` reads (a later post phase, a step output): they are returned; the
    others live only inside the program. The shardings are the ones the programs
    would have had apart."""
    body = _Body(task, graph, constants, analysis, mesh, num_microbatches, mean_weight, specs, operand_specs, gathered, host)
    after = _Body(post, graph, constants, analysis, mesh, num_microbatches, mean_weight, specs, operand_specs, gathered, host)
    before = None
    if pre is not None:
        if num_microbatches != 1:
            raise ValueError("pre work is folded into a stage's last microbatch only when it is the only one")
        pre_graph = analysis.full if analysis.whole_batch and not analysis.marked else graph  # as compile_task
        before = _Body(pre, pre_graph, constants, analysis, mesh, num_microbatches, mean_weight, specs, operand_specs, gathered,
                       host)
    folded = fusion(task, post, keep, num_microbatches, pre)
    inputs, post_inputs, kept, accumulates = list(folded.inputs), folded.post_inputs, folded.reductions, folded.accumulates

    def run(acc: tuple, *args: Any) -> tuple[tuple, tuple, tuple]:
        given = dict(zip(inputs, args[: len(inputs)]))
        given.update(zip(post_inputs, args[len(inputs):]))
        if before is not None:
            made = before.evaluate([given[v] for v in pre.inputs])
            given.update((v, made[v]) for v in pre.outputs)
        env = body.evaluate([given[v] for v in task.inputs])
        new = body.accumulate(acc, env) if accumulates else body.scaled(env)
        finals = dict(zip(task.reductions, body.finals(new)))
        updated = after.evaluate([finals[v] if v in finals else given[v] for v in post.inputs])
        return tuple(env[v] for v in task.outputs), tuple(finals[v] for v in kept), tuple(updated[v] for v in post.outputs)

    # What only the pre work reads is laid out as the pre program would have wanted it.
    in_sh = body.shardings(inputs) + tuple(
        after.sharding(v) if v in post.inputs else before.sharding(v) for v in post_inputs)
    acc_sh = body.acc_shardings() if accumulates else ()
    out_sh = (body.shardings(task.outputs), body.shardings(kept), after.shardings(post.outputs))
    arg_types = (body.acc_types() if accumulates else (), *_types(graph, inputs + list(post_inputs), in_sh))
    fn = CompiledOnce(jax.jit(run, in_shardings=(acc_sh, *in_sh), out_shardings=out_sh, donate_argnums=0), arg_types,
                      program_name(task, fused=True))
    outer = task if pre is None else replace(task, inputs=inputs)
    return FusedProgram(outer, post, mesh, fn, in_sh, post_inputs, kept, accumulates, arg_types, pre)


def _types(graph: OpGraph, values: Sequence[int], shardings: Sequence[NamedSharding]) -> tuple:
    return tuple(jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype, sharding=sh,
                                      weak_type=getattr(graph.avals[v], "weak_type", False))
                 for v, sh in zip(values, shardings))


class _Body:
    """One task's operators as a traceable function, with the shardings and
    accumulator types its program uses: shared by a task's own program and by a
    fused one, so both compute (and lay out) exactly the same thing."""

    def __init__(self, task: Task, graph: OpGraph, constants: dict[int, Any], analysis: MicrobatchAnalysis, mesh: Mesh,
                 num_microbatches: int, mean_weight: float | None, specs: dict[int, tuple] | None,
                 operand_specs: dict[int, tuple[tuple, tuple]] | None, gathered: dict[int, tuple] | None = None,
                 host: frozenset[int] = frozenset()):
        self.task, self.graph, self.analysis, self.mesh = task, graph, analysis, mesh
        self.host = host  # values kept in host memory between steps (host offload)
        self.specs = specs or {}
        self.operand_specs = operand_specs or {}
        self.ops = [graph.ops[i] for i in task.ops]
        # ZeRO-3 parameters are gathered where a microbatch reads them; the update works on shards.
        self.gather = {v: s for v, s in (gathered or {}).items() if v in task.inputs} if task.per_microbatch else {}
        self.scatter = scatter_ops(self.ops, task.reductions, graph, analysis, self.specs, mesh)
        # Reductions left as per-data-shard partial sums until finished (partials.py).
        # With one microbatch there is one all-reduce either way, and the stacks only
        # cost: XLA's own partitioning of the summing operator is cheaper (about 12%
        # of the GPT step's CPU time, benchmarks/overhead.py).
        self.partial = partial_ops(self.ops, task.reductions, graph, analysis, self.specs, mesh, set(self.scatter)) \
            if task.per_microbatch and num_microbatches > 1 else {}
        self.dp = data_size(mesh)
        self.stacked = {op.outputs[0] for op in self.ops if op.index in self.partial}
        needed = {v for op in self.ops for v in op.inputs if v in graph.constants}
        source = graph.constants if analysis.marked else constants
        self.consts = {v: np.asarray(source[v], dtype=graph.avals[v].dtype) for v in needed}
        self.combine = [analysis.reductions[v] for v in task.reductions]
        weight = 1.0 / num_microbatches if mean_weight is None else mean_weight
        self.scale = [weight if c == "mean" else 1.0 for c in self.combine]
        self.reduction_avals = [graph.avals[v] for v in task.reductions]
        self.acc_dtypes = [accumulator_dtype(a.dtype, c) for a, c in zip(self.reduction_avals, self.combine)]

    def evaluate(self, args: Sequence[Any]) -> dict[int, Any]:
        """Every value the task's operators make, from its inputs (`task.inputs` order)."""
        graph, mesh = self.graph, self.mesh
        env = dict(self.consts)
        env.update(zip(self.task.inputs, args))
        for v in self.host.intersection(self.task.inputs):  # offloaded state: to the devices for the update
            env[v] = jax.device_put(env[v], self.sharding(v, on_device=True))
        for v, spec in self.gather.items():
            env[v] = jax.lax.with_sharding_constraint(env[v], spec_sharding(mesh, graph.avals[v], spec))
        for op in self.ops:
            ins = [env[v] for v in op.inputs]
            if op.index in self.operand_specs:
                ins = [jax.lax.with_sharding_constraint(x, spec_sharding(mesh, graph.avals[v], spec))
                       for x, v, spec in zip(ins, op.inputs, self.operand_specs[op.index])]
            scatter = self.scatter.get(op.index)
            if op.index in self.partial:
                pins = self.operand_specs.get(op.index) or [self._spec(v) for v in op.inputs]
                axis, size = stack_axis(mesh, self._spec(op.outputs[0]))
                stack = partial_sums(op, ins, self.partial[op.index], list(pins), self._spec(op.outputs[0]), mesh, size, axis)
                env[op.outputs[0]] = stack
                continue
            env.update(zip(op.outputs, reduce_scatter(op, ins, mesh, scatter) if scatter is not None else jaxpr_ir.bind(op, ins)))
            for v in op.outputs:
                if v in self.specs:
                    env[v] = jax.lax.with_sharding_constraint(env[v], spec_sharding(mesh, graph.avals[v], self.specs[v]))
        for v in self.host.intersection(self.task.outputs):  # the new offloaded state: back to host memory
            env[v] = jax.device_put(env[v], self.sharding(v))
        return env

    def scaled(self, env: dict[int, Any]) -> tuple:
        """This microbatch's reductions, means weighted by its share of the batch."""
        return tuple(env[v] if k == 1.0 else env[v] * jnp.asarray(k, env[v].dtype) for v, k in zip(self.task.reductions, self.scale))

    def started(self, env: dict[int, Any]) -> tuple:
        """The accumulators after the first microbatch: its reductions, in the
        accumulators' dtypes (each combine's identity combined with x is x)."""
        return tuple(x.astype(d) for x, d in zip(self.scaled(env), self.acc_dtypes))

    def accumulate(self, acc: tuple, env: dict[int, Any]) -> tuple:
        return tuple(_COMBINE[c](a, x.astype(a.dtype)) for c, a, x in zip(self.combine, acc, self.scaled(env)))

    def finals(self, acc: tuple) -> tuple:
        """The finished reductions from their accumulators: each stack of per-data-shard
        partials summed (the step's one reduction over `data`), in the value's dtype."""
        out = []
        for v, x, a in zip(self.task.reductions, acc, self.reduction_avals):
            if v in self.stacked:
                x = jax.lax.with_sharding_constraint(x.sum(axis=0), self.sharding(v))
            out.append(x.astype(a.dtype))
        return tuple(out)

    def sharding(self, v: int, on_device: bool = False) -> NamedSharding:
        """`v`'s layout on the mesh; in host memory (`pinned_host`) for an offloaded
        value unless `on_device`."""
        if v in self.specs:
            out = spec_sharding(self.mesh, self.graph.avals[v], self.specs[v])
        else:
            out = value_sharding(self.mesh, self.graph.avals[v], self.analysis.batch_axis.get(v))
        return out.with_memory_kind(HOST_MEMORY) if v in self.host and not on_device else out

    def _spec(self, v: int) -> tuple:
        """`v`'s layout as a tuple of mesh axes, one per dimension."""
        spec = tuple(self.sharding(v).spec)
        return spec + (None,) * (len(self.graph.avals[v].shape) - len(spec))

    def acc_shardings(self) -> tuple[NamedSharding, ...]:
        """The accumulators' layouts: a reduction's own, or its stack of partials over `data`."""
        return tuple(
            spec_sharding(self.mesh, t, stacked_spec(self._spec(v), t.ndim - 1, stack_axis(self.mesh, self._spec(v))[0]))
            if v in self.stacked else self.sharding(v)
            for v, t in zip(self.task.reductions, self._acc_avals()))

    def _acc_avals(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(((stack_axis(self.mesh, self._spec(v))[1],) if v in self.stacked else ()) + a.shape, d)
                for v, a, d in zip(self.task.reductions, self.reduction_avals, self.acc_dtypes)]

    def shardings(self, values: Sequence[int]) -> tuple[NamedSharding, ...]:
        return tuple(self.sharding(v) for v in values)

    def types(self, values: Sequence[int], shardings: Sequence[NamedSharding]) -> tuple:
        return _types(self.graph, values, shardings)

    def acc_types(self) -> tuple:
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a, sh in zip(self._acc_avals(), self.acc_shardings()))
