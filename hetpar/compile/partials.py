"""Data-parallel reductions summed once per step, not once per microbatch.

A stage mesh splits each microbatch's examples over its `data` axis, so an operator
that sums over the examples (a weight gradient's matmul, a bias gradient's sum, an
embedding gradient's scatter-add, the loss sum) leaves each device a partial sum.
Written plainly, XLA's partitioner all-reduces that partial inside the program, so a
stage with m microbatches all-reduces its gradients m times, where the plan prices
once (`solver.cost.stage_costs`). Here such an operator runs on each data shard's
examples separately: its operands' example axis is split into (D, examples / D)
with the D axis laid over `data`, the operator is vmapped over D, and its result is
a stack of D partial sums, one per data shard, laid out over `data`: no collective.
Accumulators hold the stacks across microbatches, and the sum over the stack (the
one all-reduce) happens when the reduction is finished: in the fused update program
of the stage's last microbatch, or in `Program.finish`.

On a hybrid-sharded stage (`StagePlan.zero_group`: the data axis is `replica` x
`zero`) a reduction ZeRO shards over `zero` is deferred too, as a stack of one
partial per replica laid over `replica`, each a shard over its node's `zero` group:
a microbatch reduces within the node only, and the finished sum is the step's one
all-reduce across nodes, of a node's shard (what `solver.cost` prices).

Only "sum" reductions of the ordinary split are deferred. Left on their per-microbatch
path: reductions laid out over `data` (ZeRO-2/3 gradients, reduce-scattered per
microbatch so the accumulator stays a shard: the memory ZeRO is chosen for); max/min;
steps marked with `hetpar.value_and_grad` (their reductions are markers after the
summing operators); a microbatch the data axis does not divide; and a step of one
microbatch, which all-reduces once anyway (programs.py leaves partials out there:
the per-shard stacks make the program slower than XLA's own partitioning).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from hetpar.compile.layouts import DATA_AXIS as DATA, REPLICA_AXIS, ZERO_AXIS, data_size, spec_sharding

from hetpar.trace import jaxpr_ir
from hetpar.trace.microbatch import MicrobatchAnalysis
from hetpar.trace.opgraph import Op, OpGraph

Partial = tuple[int | None, ...]  # per operand: its example axis, or None where it has none


def partial_ops(ops: list[Op], reductions: list[int], graph: OpGraph, analysis: MicrobatchAnalysis,
                specs: dict[int, tuple], mesh: Mesh, skip: set[int]) -> dict[int, Partial]:
    """Operator index -> its operands' example axes, for each operator of `ops` that
    makes one of `reductions` and can leave it as per-data-shard partial sums.
    `skip`: operators already handled otherwise (ZeRO-2's explicit reduce-scatter)."""
    dp = data_size(mesh)
    if dp == 1 or analysis.marked or analysis.single:
        return {}
    out: dict[int, Partial] = {}
    for op in ops:
        if op.index in skip or len(op.outputs) != 1:
            continue
        v = op.outputs[0]
        if v not in reductions or analysis.reductions.get(v) != "sum" or DATA in tuple(specs.get(v, ())) \
                or ZERO_AXIS in tuple(specs.get(v, ())) and REPLICA_AXIS not in mesh.shape:
            continue
        axes = tuple(analysis.batch_axis.get(x) for x in op.inputs)
        if all(a is None for a in axes) or any(
                a is not None and graph.avals[x].shape[a] % dp for x, a in zip(op.inputs, axes)):
            continue
        out[op.index] = axes
    return out


def stack_axis(mesh: Mesh, spec: tuple) -> tuple[str, int]:
    """The axis a reduction's stack of partials lies over, and the stack's size: every
    data-parallel device (`data`), or for a reduction a hybrid stage shards over
    `zero`, its replicas (`replica`), each partial a shard of its node's group."""
    if ZERO_AXIS in tuple(spec) and REPLICA_AXIS in mesh.shape:
        return REPLICA_AXIS, mesh.shape[REPLICA_AXIS]
    return DATA, data_size(mesh)


def stacked_spec(spec: tuple, ndim: int, axis: str = DATA) -> tuple:
    """The layout of a reduction's stack of partials: the stack axis over `axis`
    (`stack_axis`), the reduction's own layout (without the data axis, which the
    stack now uses; a hybrid stage's `zero` shards kept) after it."""
    return (axis, *_without_data(spec, ndim, keep={ZERO_AXIS} if axis == REPLICA_AXIS else set()))


def _without_data(spec: tuple, ndim: int, keep: set[str] | None = None) -> list:
    """`spec` padded to `ndim` entries, with `data` (on a hybrid mesh `replica` and
    `zero`, but those in `keep`) taken out of every entry."""
    entries = [*tuple(spec)[:ndim], *[None] * max(0, ndim - len(tuple(spec)))]
    data = {DATA, REPLICA_AXIS, ZERO_AXIS} - (keep or set())  # a hybrid mesh's data axis is `replica` x `zero`
    return [None if a in data or (isinstance(a, tuple) and data & set(a)) else a for a in entries]


def partial_sums(op: Op, args: list[Any], axes: Partial, operand_specs: list[tuple], out_spec: tuple,
                 mesh: Mesh, dp: int, axis: str = DATA) -> Any:
    """`op` on each data shard's examples: a stack of `dp` partial results (axis 0)
    whose sum is `op`'s result. `operand_specs` are the operands' layouts, kept on their
    other dimensions; `out_spec` is the result's. `axis` `replica` (`stack_axis`): `dp`
    is the replica count, and each replica's examples stay split over its `zero` group."""
    split = []
    for x, a, spec in zip(args, axes, operand_specs):
        if a is None:
            split.append(x)
            continue
        shape = (*x.shape[:a], dp, x.shape[a] // dp, *x.shape[a + 1:])
        own = _without_data(spec, x.ndim)
        inner = ZERO_AXIS if axis == REPLICA_AXIS else own[a]
        layout = (*own[:a], axis, inner, *own[a + 1:])
        y = x.reshape(shape)
        split.append(jax.lax.with_sharding_constraint(y, spec_sharding(mesh, y, layout)))
    stack = jax.vmap(lambda *xs: jaxpr_ir.bind(op, list(xs))[0], in_axes=axes)(*split)
    return jax.lax.with_sharding_constraint(stack, spec_sharding(mesh, stack, stacked_spec(out_spec, stack.ndim - 1, axis)))
