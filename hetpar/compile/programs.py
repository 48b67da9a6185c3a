"""Stage programs: each task becomes one jitted function on its stage's mesh.

A stage mesh is data parallel: values that carry the batch dimension are split over
its devices along that dimension, everything else is replicated, and XLA's
partitioner inserts the gradient all-reduce. Reductions are accumulated inside the
program (the accumulator is donated), so a microbatch costs one dispatch per stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetpar.cluster.cluster import jax_devices
from hetpar.compile.scatter import reduce_scatter, scatter_ops
from hetpar.compile.tasks import Task
from hetpar.trace import jaxpr_ir
from hetpar.trace.microbatch import MicrobatchAnalysis
from hetpar.trace.opgraph import OpGraph

DATA_AXIS = "data"
MODEL_AXIS = "model"


def spec_sharding(mesh: Mesh, aval: Any, spec: tuple) -> NamedSharding:
    """A chosen sharding, minus the axes a dimension of this shape cannot divide by
    (a microbatch may be smaller than the batch the sharding was chosen for)."""
    fitted = [a if a is not None and a in mesh.shape and dim % mesh.shape[a] == 0 else None for a, dim in zip(spec, aval.shape)]
    return NamedSharding(mesh, PartitionSpec(*fitted))


def stage_mesh(device_ids: tuple[int, ...], shape: tuple[int, ...] = ()) -> Mesh:
    """A 1-D data-parallel mesh, or `data` x `model` when `shape` has two dimensions.
    Auto axes: the traced step is mesh-agnostic, shardings are steered from outside."""
    devices = np.array(jax_devices(device_ids))
    if len(shape) == 2 and shape[1] > 1:
        return Mesh(devices.reshape(shape), (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))
    return Mesh(devices, (DATA_AXIS,), axis_types=(AxisType.Auto,))


def value_sharding(mesh: Mesh, aval: Any, batch_axis: int | None) -> NamedSharding:
    ndim = len(getattr(aval, "shape", ()))
    size = mesh.shape[DATA_AXIS]
    if batch_axis is not None and size > 1 and aval.shape[batch_axis] % size == 0:
        spec = [None] * ndim
        spec[batch_axis] = DATA_AXIS
        return NamedSharding(mesh, PartitionSpec(*spec))
    return NamedSharding(mesh, PartitionSpec())


_COMBINE: dict[str, Callable] = {
    "sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "only": lambda acc, x: x,
}
_IDENTITY = {"sum": 0, "mean": 0, "max": -np.inf, "min": np.inf, "only": 0}


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
    finish: Callable | None = None  # accumulators -> the reductions in their own dtype
    arg_types: tuple = ()  # (accumulators, *inputs) as ShapeDtypeStructs with their shardings

    def lower(self) -> Any:
        """The program lowered for its argument types, e.g. `.as_text()` for StableHLO:
        what two processes compare to know they run the same thing."""
        return self.fn.lower(*self.arg_types)


def compile_task(
    task: Task, graph: OpGraph, constants: dict[int, Any], analysis: MicrobatchAnalysis, mesh: Mesh, num_microbatches: int,
    mean_weight: float | None = None, specs: dict[int, tuple] | None = None,
    operand_specs: dict[int, tuple[tuple, tuple]] | None = None, gathered: dict[int, tuple] | None = None,
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
    the once-per-step update keeps working on the shards."""
    specs = specs or {}
    if task.kind == "pre" and analysis.whole_batch and not analysis.marked:
        # Once-per-step work before the microbatches sees the whole batch (whole_batch.py);
        # everything else in it is batch-independent, the same in both traces.
        graph = analysis.full
    operand_specs = operand_specs or {}
    gather = {v: spec for v, spec in (gathered or {}).items() if v in task.inputs} if task.per_microbatch else {}
    ops = [graph.ops[i] for i in task.ops]
    scatter = scatter_ops(ops, task.reductions, graph, analysis, specs, mesh)
    needed = {v for op in ops for v in op.inputs if v in graph.constants}
    source = graph.constants if analysis.marked else constants
    consts = {v: np.asarray(source[v], dtype=graph.avals[v].dtype) for v in needed}
    combine = [analysis.reductions[v] for v in task.reductions]
    weight = 1.0 / num_microbatches if mean_weight is None else mean_weight
    scale = [weight if c == "mean" else 1.0 for c in combine]

    def run(acc: tuple, *args: Any) -> tuple[tuple, tuple]:
        env = dict(consts)
        env.update(zip(task.inputs, args))
        for v, spec in gather.items():
            env[v] = jax.lax.with_sharding_constraint(env[v], spec_sharding(mesh, graph.avals[v], spec))
        for op in ops:
            ins = [env[v] for v in op.inputs]
            if op.index in operand_specs:
                ins = [jax.lax.with_sharding_constraint(x, spec_sharding(mesh, graph.avals[v], spec))
                       for x, v, spec in zip(ins, op.inputs, operand_specs[op.index])]
            env.update(zip(op.outputs, reduce_scatter(op, ins, mesh, scatter[op.index]) if op.index in scatter
                           else jaxpr_ir.bind(op, ins)))
            for v in op.outputs:
                if v in specs:
                    env[v] = jax.lax.with_sharding_constraint(env[v], spec_sharding(mesh, graph.avals[v], specs[v]))
        new = tuple(env[v] if k == 1.0 else env[v] * jnp.asarray(k, env[v].dtype) for v, k in zip(task.reductions, scale))
        acc = tuple(_COMBINE[c](a, x.astype(a.dtype)) for c, a, x in zip(combine, acc, new))
        return tuple(env[v] for v in task.outputs), acc

    def sharding(v: int) -> NamedSharding:
        if v in specs:
            return spec_sharding(mesh, graph.avals[v], specs[v])
        return value_sharding(mesh, graph.avals[v], analysis.batch_axis.get(v))

    in_sh = tuple(sharding(v) for v in task.inputs)
    out_sh = tuple(sharding(v) for v in task.outputs)
    acc_sh = tuple(sharding(v) for v in task.reductions)
    fn = jax.jit(run, in_shardings=(acc_sh, *in_sh), out_shardings=(out_sh, acc_sh), donate_argnums=0)

    init_acc = finish = None
    if task.reductions:
        avals = [graph.avals[v] for v in task.reductions]
        acc_dtypes = [accumulator_dtype(a.dtype, c) for a, c in zip(avals, combine)]
        init_acc = jax.jit(
            lambda: tuple(jnp.full(a.shape, _IDENTITY[c], d) for a, c, d in zip(avals, combine, acc_dtypes)),
            out_shardings=acc_sh,
        )
        if any(d != a.dtype for a, d in zip(avals, acc_dtypes)):
            finish = jax.jit(lambda acc: tuple(x.astype(a.dtype) for x, a in zip(acc, avals)), out_shardings=acc_sh)
    typed = lambda v, sh, dtype=None: jax.ShapeDtypeStruct(  # noqa: E731
        graph.avals[v].shape, dtype or graph.avals[v].dtype, sharding=sh)
    acc_types = tuple(typed(v, sh, accumulator_dtype(graph.avals[v].dtype, c)) for v, sh, c in zip(task.reductions, acc_sh, combine))
    arg_types = (acc_types, *map(typed, task.inputs, in_sh))
    return Program(task, mesh, fn, in_sh, acc_sh, init_acc, finish, arg_types)
