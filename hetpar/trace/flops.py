"""FLOPs and bytes per operator, counted the way XLA's HloCostAnalysis counts them.

Matching XLA's conventions (checked primitive by primitive against
`jax.jit(f).lower(...).cost_analysis()`) lets the predictor be calibrated against
compiled programs: matmuls and convolutions are analytic, elementwise arithmetic is
one FLOP per output element, transcendentals (exp, tanh, ...) count zero FLOPs (XLA
reports them separately), reductions count one FLOP per folded element, data
movement counts nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from hetpar.trace import jaxpr_ir
from hetpar.trace.opgraph import OpGraph

# One FLOP per output element.
_ELEMENTWISE = frozenset(
    "add sub mul div rem max min neg abs sign floor ceil round is_finite square clamp select_n "
    "convert_element_type eq ne lt le gt ge and or xor not shift_left shift_right_logical "
    "shift_right_arithmetic add_any reduce_precision exp2 population_count clz imag real conj "
    "complex nextafter copysign".split()
)
# Zero FLOPs: XLA counts these as transcendentals, not flops.
_TRANSCENDENTAL = frozenset(
    "exp log log1p expm1 tanh rsqrt sqrt cbrt erf erfc erf_inv sin cos tan asin acos atan atan2 "
    "sinh cosh asinh acosh atanh pow lgamma digamma igamma igammac bessel_i0e bessel_i1e".split()
)
# Extra FLOPs per output element of primitives that XLA lowers to a few arithmetic ops.
_PER_ELEMENT = {"logistic": 3.0, "erf_inv": 37.0, "nextafter": 24.0, "rem": 1.0}
_REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor".split())


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes_in: int
    bytes_out: int


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _nbytes(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    return _size(aval) * (dtype.itemsize if dtype is not None else 0)


def op_flops(name: str, in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    out = _size(out_avals[0]) if out_avals else 0
    if name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        k = math.prod(in_avals[0].shape[d] for d in lhs_contract)
        return 2.0 * out * k
    if name == "conv_general_dilated":
        return _conv_flops(in_avals[0].shape, in_avals[1].shape, out_avals[0].shape, params)
    if name in _ELEMENTWISE:
        return float(out)
    if name in _TRANSCENDENTAL:
        return 0.0
    if name in _PER_ELEMENT:
        return _PER_ELEMENT[name] * out
    if name == "integer_pow":
        return float(max(abs(params["y"]) - 1, 1)) * out
    if name in _REDUCTIONS:
        return float(_size(in_avals[0]) - out)
    if name in ("argmax", "argmin"):
        return 8.0 * _size(in_avals[0])  # a variadic (value, index) reduction
    if name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        axis_len = in_avals[0].shape[params["axis"]] if in_avals[0].shape else 1
        return float(out * (axis_len - 1))  # lowered to a naive reduce-window
    if name in ("scatter-add", "scatter_add", "scatter-mul", "scatter_mul"):
        return float(_size(in_avals[2]))
    if name == "scan":
        return params["length"] * _jaxpr_flops(params["jaxpr"])
    if name == "while":
        return _jaxpr_flops(params["body_jaxpr"])  # trip count unknown: counted once, as XLA does
    if name == "cond":
        return max(_jaxpr_flops(b) for b in params["branches"])
    return 0.0  # data movement: reshape, broadcast, transpose, slice, gather, concatenate, ...


def _conv_flops(lhs: tuple, rhs: tuple, out: tuple, params: dict) -> float:
    """2 x (multiply-adds that touch real input, not padding), as XLA counts."""
    dn = params["dimension_numbers"]
    lhs_spatial, rhs_spatial, out_spatial = dn.lhs_spec[2:], dn.rhs_spec[2:], dn.out_spec[2:]
    taps = 1
    for i in range(len(rhs_spatial)):
        size = (lhs[lhs_spatial[i]] - 1) * params["lhs_dilation"][i] + 1
        kernel, stride = rhs[rhs_spatial[i]], params["window_strides"][i]
        low = params["padding"][i][0]
        rate, lhs_rate = params["rhs_dilation"][i], params["lhs_dilation"][i]
        taps *= sum(
            1
            for o in range(out[out_spatial[i]])
            for k in range(kernel)
            if 0 <= o * stride + k * rate - low < size and (o * stride + k * rate - low) % lhs_rate == 0
        )
    batch, out_features = out[dn.out_spec[0]], out[dn.out_spec[1]]
    in_features_per_group = rhs[dn.rhs_spec[1]]
    groups = params.get("batch_group_count", 1)
    return 2.0 * batch * out_features * in_features_per_group * taps / groups


def _jaxpr_flops(jaxpr: Any) -> float:
    return sum(op_flops(*eqn) for eqn in jaxpr_ir.jaxpr_ops(jaxpr_ir.open_jaxpr(jaxpr)))


def op_costs(graph: OpGraph) -> list[OpCost]:
    """Cost of every operator of `graph`, by op index."""
    costs = []
    for op in graph.ops:
        ins = [graph.avals[v] for v in op.inputs]
        outs = [graph.avals[v] for v in op.outputs]
        costs.append(OpCost(op_flops(op.name, ins, outs, op.params), sum(map(_nbytes, ins)), sum(map(_nbytes, outs))))
    return costs


def graph_flops(graph: OpGraph) -> float:
    return sum(c.flops for c in op_costs(graph))
