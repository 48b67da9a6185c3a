"""ZeRO-2's reduce-scatter, written out where XLA would not write it.

A gradient is a reduction over the batch (a matmul contracting the examples, or a
sum over them), and the batch is split over the stage's `data` axis, so each device
holds a partial sum. When the plan lays the gradient out sharded over `data` (ZeRO-2
and up, see `hetpar.shard.zero`), the partial sums should be reduce-scattered: each
device receives only its shard, summed. XLA's SPMD partitioner instead all-reduces
the whole gradient and slices it; its GPU pipeline later fuses the pair into a
reduce-scatter, its CPU pipeline does not. So for the common case (operands split
over `data` along the examples alone, gradient laid out over `data` alone) the
operator runs per device under `shard_map`, followed by an explicit
`psum_scatter`; any other case keeps the plain sharding constraint, which is correct
on every backend.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from hetpar.compile.layouts import DATA_AXIS as DATA
from hetpar.trace import jaxpr_ir
from hetpar.trace.microbatch import MicrobatchAnalysis
from hetpar.trace.opgraph import Op, OpGraph

Scatter = tuple[tuple[PartitionSpec, ...], PartitionSpec, int]  # operand specs, result spec, scattered dimension


def scatter_ops(ops: list[Op], reductions: list[int], graph: OpGraph, analysis: MicrobatchAnalysis,
                specs: dict[int, tuple], mesh: Mesh) -> dict[int, Scatter]:
    """Operator index -> how to run it as a local reduction and a reduce-scatter, for
    each operator of `ops` that makes one of `reductions` laid out over `data`."""
    dp = mesh.shape.get(DATA, 1)
    out: dict[int, Scatter] = {}
    for op in ops:
        if len(op.outputs) != 1 or op.outputs[0] not in reductions or dp == 1:
            continue
        spec = tuple(specs.get(op.outputs[0], ()))
        if DATA not in spec or any(a not in (None, DATA) for a in spec):
            continue
        reduced = _reduced_examples(op, graph, analysis)
        if reduced is None or any(graph.avals[v].shape[d] % dp for v, d in zip(op.inputs, reduced)):
            continue
        operand_specs = tuple(
            PartitionSpec(*(DATA if k == d else None for k in range(len(graph.avals[v].shape))))
            for v, d in zip(op.inputs, reduced)
        )
        out[op.index] = (operand_specs, PartitionSpec(*spec), spec.index(DATA))
    return out


def _reduced_examples(op: Op, graph: OpGraph, analysis: MicrobatchAnalysis) -> tuple[int, ...] | None:
    """Each operand's example dimension, where the operator sums over it (a matmul
    contracting both operands' examples together, or a sum over them); else None."""
    axes = [analysis.batch_axis.get(v) for v in op.inputs]
    if any(a is None for a in axes):
        return None
    if op.name == "reduce_sum" and axes[0] in op.params["axes"]:
        return (axes[0],)
    if op.name == "dot_general":
        (lc, rc), _ = op.params["dimension_numbers"]
        pairs = list(zip(lc, rc))
        if (axes[0], axes[1]) in pairs:
            return (axes[0], axes[1])
    return None


def reduce_scatter(op: Op, args: list[Any], mesh: Mesh, how: Scatter) -> list[Any]:
    """`op` on each device's examples, its partial sums reduce-scattered over `data`."""
    operand_specs, out_spec, dim = how

    def local(*xs: Any) -> Any:
        (partial,) = jaxpr_ir.bind(op, list(xs))
        return jax.lax.psum_scatter(partial, DATA, scatter_dimension=dim, tiled=True)

    return [jax.shard_map(local, mesh=mesh, in_specs=operand_specs, out_specs=out_spec)(*args)]
