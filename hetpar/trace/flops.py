"""FLOPs and bytes per operator, counted the way XLA's HloCostAnalysis counts them.

Why XLA's conventions and not "true" arithmetic: the predictor is calibrated against
compiled programs, and `jax.jit(f).lower(*args).cost_analysis()["flops"]` is the one
count that exists for any JAX program. Every figure below was measured primitive by
primitive against it (jax 0.12, CPU lowering):

- matmuls and convolutions are analytic (2 FLOPs per multiply-add; a convolution
  counts only the taps that touch real input, not padding);
- elementwise arithmetic, comparisons, converts and bit operations: one FLOP per
  output element;
- transcendentals that XLA keeps as one HLO op (exp, log, tanh, rsqrt, sqrt, erf,
  sin, cos, pow, ...): zero; XLA reports them under "transcendentals", not "flops";
- functions JAX or CHLO expand into polynomials (logistic, erfc, erf_inv, lgamma,
  sinh, ...): the FLOPs of their expansion, per element;
- reductions: one application of the reducer per folded element (in - out);
- data movement (reshape, broadcast, transpose, slice, gather, scatter, pad,
  concatenate, iota, dynamic_slice, ...): zero, but for the index checks JAX adds
  around some gathers and scatters.

Loops: XLA counts a while loop's body once whatever its trip count; hetpar wants the
work a step does, so `scan` counts its body times its length (what XLA reports for
the unrolled scan). A `while` loop's trip count is unknown before it runs: it counts
its body and condition once, as XLA does, and so underestimates loops that run many
times. `cond` counts its most expensive branch, as XLA does.

XLA also simplifies before it counts: an elementwise op on constants is folded away,
as is `x + 0`, `x * 1` and the like. `op_costs` applies those rules to the operators
of a graph; `op_flops`, which sees only shapes, cannot, and neither can the costing
of loop bodies, which sees no literal values (a body using softplus counts ~1.5%
more than XLA's unrolled loop; a scanned transformer block, 0.02%).

Some lowerings differ by backend; the figures here are the CPU ones, which is where
hetpar traces and plans (cumsum is an associative scan on TPU, ragged_dot a native
grouped matmul on recent GPUs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from hetpar.trace import jaxpr_ir
from hetpar.trace.opgraph import OpGraph

# One FLOP per output element: HLO elementwise ops that are not transcendental.
_ONE_PER_ELEMENT = frozenset(
    {
        "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "floor", "ceil",
        "round", "is_finite", "square", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor",
        "not", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
        "reduce_precision", "bitcast_convert_type", "imag", "real", "conj", "complex", "mulhi"
    }
)
# Zero FLOPs: one HLO transcendental op each, which XLA counts as "transcendentals".
_TRANSCENDENTAL = frozenset(
    {
        "exp", "log", "log1p", "expm1", "tanh", "rsqrt", "sqrt", "cbrt", "erf", "sin", "cos", "tan", "atan",
        "atan2"
    }
)
# Primitives expanded into several HLO ops: (FLOPs per element in float32, extra FLOPs
# per element for 16-bit floats, which are computed in float32 between two converts).
_EXPANDED: dict[str, tuple[float, float]] = {
    "exp2": (1, 0),  # exp(x * ln 2)
    "log2": (1, 0),  # log(x) / ln 2
    "one_minus_square": (3, 0),  # tanh's derivative
    "logistic": (3, 0),  # 1 / (1 + exp(-x))
    "asin": (3, 0),
    "acos": (3, 0),
    "asinh": (11, 0),
    "acosh": (7, 0),
    "atanh": (6, 0),
    "sinh": (10, 2),
    "cosh": (3, 2),
    "nextafter": (24, 0),
    "erfc": (62, 2),
    "erf_inv": (37, 2),
    "lgamma": (292, 2),
    "digamma": (75, 2),
    "bessel_i0e": (83, 2),
    "bessel_i1e": (83, 2),
    "igamma": (427, 3),
    "igammac": (427, 3),
    "igamma_grad_a": (578, 3),
    "random_gamma_grad": (575, 3),
    "polygamma": (262, 3),
    "zeta": (121, 3),
}
# FLOPs of one application of a reduction's combiner. argmax/argmin reduce (value,
# index) pairs with a NaN-aware comparator: 9 FLOPs for floats, 7 for integers.
_REDUCERS: dict[str, float] = dict.fromkeys(
    ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"), 1.0
)
# Cumulative reductions, lowered on CPU/GPU to a reduce_window over the whole axis
# (TPU uses an associative scan instead and would count less).
_CUMULATIVE: dict[str, float] = {"cumsum": 1, "cumprod": 1, "cummax": 1, "cummin": 1, "cumlogsumexp": 8}
_REDUCE_WINDOW: dict[str, float] = {"reduce_window_sum": 1, "reduce_window_max": 1, "reduce_window_min": 1}
# Scatters that combine with the old value: one FLOP per update element. A plain
# `scatter` (set) only moves data.
_COMBINING_SCATTER = ("scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max")
# Data movement: free. Anything unknown is free as well; this set names the common
# cases so that a reader need not wonder.
_DATA_MOVEMENT = frozenset(
    {
        "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
        "dynamic_update_slice", "concatenate", "pad", "rev", "split", "iota", "copy", "copy_p",
        "top_k", "stop_gradient", "optimization_barrier", "sharding_constraint",
        "random_wrap", "random_unwrap"
    }
)
# Ops that keep a splat constant a splat (constant folding sees through them).
_SPLAT_PRESERVING = frozenset(
    {
        "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice", "rev", "copy",
        "copy_p", "convert_element_type"
    }
)

# Operators XLA runs as matmul kernels: what the efficiency curve (solver.efficiency) prices.
MATMUL_OPS = frozenset({"dot_general", "conv_general_dilated"})


@dataclass(frozen=True)
class OpCost:
    """What one operator costs: FLOPs as XLA counts them, and bytes read and written."""

    flops: float
    bytes_in: int
    bytes_out: int


def _size(aval: Any) -> int:
    return math.prod(int(d) for d in getattr(aval, "shape", ()))


def _nbytes(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    return _size(aval) * (getattr(dtype, "itemsize", 0) if dtype is not None else 0)


def _is_16bit_float(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize == 2


def _is_integer(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    try:
        return np.dtype(dtype).kind in "iub"
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def op_bytes(in_avals: Sequence[Any], out_avals: Sequence[Any]) -> tuple[int, int]:
    """(bytes read, bytes written) by an operator, assuming each operand is read once."""
    return sum(map(_nbytes, in_avals)), sum(map(_nbytes, out_avals))


def op_flops(name: str, in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """FLOPs of one operator from its shapes, as XLA's HloCostAnalysis counts them.

    Unknown primitives count zero: most primitives JAX adds are data movement, and a
    missing FLOP count is less harmful to the plan than an invented one."""
    if name in _DATA_MOVEMENT:
        return 0.0
    rule = _RULES.get(name)
    if rule is not None:
        return float(rule(in_avals, out_avals, params))
    out = _size(out_avals[0]) if out_avals else 0
    if name in _ONE_PER_ELEMENT:
        return float(out)
    if name in _EXPANDED:
        per_element, half_extra = _EXPANDED[name]
        return (per_element + (half_extra if _is_16bit_float(out_avals[0]) else 0)) * out
    if name in _REDUCERS:
        return _REDUCERS[name] * (_size(in_avals[0]) - out)
    if name in _CUMULATIVE:
        return _CUMULATIVE[name] * out * (_axis_len(in_avals[0], params["axis"]) - 1)
    if name in _REDUCE_WINDOW:
        return _REDUCE_WINDOW[name] * out * (math.prod(params["window_dimensions"]) - 1)
    return 0.0  # transcendentals, data movement, unknown


def _axis_len(aval: Any, axis: int) -> int:
    return int(aval.shape[axis]) if aval.shape else 1


def _dot_general(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """2 x batch x M x N x K: every output element is a K-long multiply-add."""
    (lhs_contract, _), _ = params["dimension_numbers"]
    k = math.prod(int(in_avals[0].shape[d]) for d in lhs_contract)
    return 2.0 * _size(out_avals[0]) * k


def _conv(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """2 x (multiply-adds that touch real input), as HloCostAnalysis::GetConvolutionFlops:
    taps that land on padding or between dilated input elements are not counted."""
    lhs, rhs, out = in_avals[0].shape, in_avals[1].shape, out_avals[0].shape
    dn = params["dimension_numbers"]
    taps = 1
    for i in range(len(dn.lhs_spec) - 2):
        taps *= _valid_taps(
            size=int(lhs[dn.lhs_spec[2 + i]]),
            kernel=int(rhs[dn.rhs_spec[2 + i]]),
            out=int(out[dn.out_spec[2 + i]]),
            stride=params["window_strides"][i],
            low=params["padding"][i][0],
            lhs_dilation=params["lhs_dilation"][i],
            rhs_dilation=params["rhs_dilation"][i],
        )
    in_features_per_group = int(rhs[dn.rhs_spec[1]])
    out_features = int(out[dn.out_spec[1]])
    batch = int(lhs[dn.lhs_spec[0]]) // params.get("batch_group_count", 1)
    return 2.0 * batch * out_features * in_features_per_group * taps


def _valid_taps(size: int, kernel: int, out: int, stride: int, low: int, lhs_dilation: int, rhs_dilation: int) -> int:
    """(output position, kernel position) pairs along one spatial axis that read a real
    input element."""
    count = 0
    for k in range(kernel):
        for o in range(out):
            pos = o * stride - low + k * rhs_dilation
            if pos % lhs_dilation == 0 and 0 <= pos // lhs_dilation < size:
                count += 1
    return count


def _convert(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """A convert to the same dtype (a weak-type change) emits no HLO op."""
    return 0.0 if in_avals[0].dtype == out_avals[0].dtype else float(_size(out_avals[0]))


def _select_n(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """A boolean predicate is one select; an integer one picks among n cases with a tree
    of n - 1 compare-and-selects."""
    cases = len(in_avals) - 1
    per_element = 1 if in_avals[0].dtype == np.bool_ else 2 * (cases - 1)
    return float(per_element * _size(out_avals[0]))


def _integer_pow(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """JAX lowers x**y by repeated squaring: one multiply per squaring and per set bit
    after the first, plus a division for negative y."""
    y = int(params["y"])
    if y == 0:
        return 0.0
    magnitude = abs(y)
    muls = magnitude.bit_length() - 1 + magnitude.bit_count() - 1 + (1 if y < 0 else 0)
    return float(muls * _size(out_avals[0]))


def _pow(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """A transcendental; an integer exponent is first converted to float (one FLOP)."""
    return float(_size(out_avals[0])) if _is_integer(in_avals[1]) else 0.0


def _arg_reduce(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    per_fold = 7 if _is_integer(in_avals[0]) else 9
    return float(per_fold * (_size(in_avals[0]) - _size(out_avals[0])))


def _sort(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """n log2 n over all elements of the first operand, whatever the sorted axis."""
    n = _size(in_avals[0])
    return float(n * max(n - 1, 0).bit_length())


def _reduce_window(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """A generic (possibly variadic) reduce_window: its reducer once per folded element."""
    window = math.prod(params["window_dimensions"])
    return _size(out_avals[0]) * (window - 1) * _jaxpr_flops(params["jaxpr"])


def _select_and_scatter_add(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """Max-pool's gradient: per source element, window - 1 selects and one add."""
    return float(_size(in_avals[0]) * math.prod(params["window_dimensions"]))


def _select_and_gather_add(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """Max-pool's forward-mode derivative: a reduce_window over (value, tangent) pairs,
    3 FLOPs per folded element."""
    return 3.0 * _size(out_avals[0]) * (math.prod(params["window_dimensions"]) - 1)


def _threefry(key: Any) -> bool:
    """Threefry keys are hashed with HLO arithmetic; XLA counts nothing for the
    rng_bit_generator behind "rbg" keys."""
    return "fry" in str(getattr(key, "dtype", ""))


def _random_bits(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """Threefry over an iota of counters (its rounds are a while loop XLA counts once).
    Exact for one key; a batch of keys (vmap) counts 10-15% more than XLA."""
    if not _threefry(in_avals[0]):
        return 0.0
    per_element = 27 + 2 * len(params["shape"]) + (1 if params["bit_width"] < 32 else 0)
    return float(per_element * _size(out_avals[0]) + 10)


def _random_split(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    return float(28 * _size(out_avals[0]) + 9) if _threefry(in_avals[0]) else 0.0


def _random_fold_in(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    return float(27 * _size(out_avals[0]) + 8) if _threefry(in_avals[0]) else 0.0


def _reduce(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """A generic (possibly variadic) reduce: its reducer once per folded element."""
    return (_size(in_avals[0]) - _size(out_avals[0])) * _jaxpr_flops(params["jaxpr"])


def _polynomial(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """Horner's rule, a multiply and an add per coefficient after the first. Past the
    unroll threshold JAX loops, and XLA counts the loop body (threshold steps) once."""
    coefficients = len(in_avals) - 1
    steps = coefficients - 1
    threshold = params.get("unroll") or 8
    return 2.0 * (steps if coefficients <= threshold else threshold) * _size(out_avals[0])


def _gather(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """Free, except in FILL_OR_DROP mode (jnp.take, take_along_axis): JAX masks out-of-
    bounds rows, with 4d - 1 ops per d-long index and a select per output element."""
    if _mode(params) != "FILL_OR_DROP":
        return 0.0
    indices = in_avals[1]
    d = int(indices.shape[-1]) if indices.shape else 1
    return float(_size(out_avals[0]) + _size(indices) // max(d, 1) * (4 * d - 1))


def _scatter_clip(in_avals: Sequence[Any]) -> float:
    """XLA drops out-of-bounds updates natively; CLIP mode clamps every index first."""
    return float(_size(in_avals[1]))


def _scatter(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    return _scatter_clip(in_avals) if _mode(params) == "CLIP" else 0.0


def _combining_scatter(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """One FLOP per update element (operand, indices, updates) to combine it."""
    return _size(in_avals[2]) + _scatter(in_avals, out_avals, params)


def _mode(params: dict) -> str:
    mode = params.get("mode")
    return getattr(mode, "name", str(mode))


def _ragged_dot(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """As the CPU lowering does it: one dense matmul per group over a masked copy of
    the left operand (a GPU with a native grouped matmul does 1/groups of this)."""
    dims = params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), _ = dims.dot_dimension_numbers
    k = math.prod(int(in_avals[0].shape[d]) for d in lhs_contract)
    groups = math.prod(int(in_avals[1].shape[d]) for d in dims.rhs_group_dimensions)
    return 2.0 * _size(out_avals[0]) * k * groups + 4.0 * _size(in_avals[0]) * groups + groups**2


def _scan(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """The body times the trip count: what XLA reports once the scan is unrolled."""
    return params["length"] * _jaxpr_flops(params["jaxpr"])


def _while(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """Body and condition once: the trip count is unknown until the loop runs, and XLA
    makes the same choice. Underestimates loops that iterate many times."""
    return _jaxpr_flops(params["body_jaxpr"]) + _jaxpr_flops(params["cond_jaxpr"])


def _cond(in_avals: Sequence[Any], out_avals: Sequence[Any], params: dict) -> float:
    """The most expensive branch: the one that bounds the step time."""
    return max(_jaxpr_flops(branch) for branch in params["branches"])


def _call(param: str) -> Callable[[Sequence[Any], Sequence[Any], dict], float]:
    """A call-like primitive inside a loop body (the top level has them inlined)."""
    return lambda in_avals, out_avals, params: _jaxpr_flops(params[param])


_RULES: dict[str, Callable[[Sequence[Any], Sequence[Any], dict], float]] = {
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "convert_element_type": _convert,
    "select_n": _select_n,
    "integer_pow": _integer_pow,
    "pow": _pow,
    "argmax": _arg_reduce,
    "argmin": _arg_reduce,
    "sort": _sort,
    "reduce_window": _reduce_window,
    "reduce": _reduce,
    "polynomial": _polynomial,
    "gather": _gather,
    "scatter": _scatter,
    **dict.fromkeys(_COMBINING_SCATTER, _combining_scatter),
    "ragged_dot_general": _ragged_dot,
    "select_and_scatter_add": _select_and_scatter_add,
    "select_and_gather_add": _select_and_gather_add,
    "random_bits": _random_bits,
    "random_split": _random_split,
    "random_fold_in": _random_fold_in,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    **{name: _call(param) for name, param in jaxpr_ir._INLINED.items()},
}


def _jaxpr_flops(jaxpr: Any) -> float:
    """FLOPs of a nested jaxpr (a loop body, a branch, a reducer)."""
    return sum(op_flops(*eqn) for eqn in jaxpr_ir.jaxpr_ops(jaxpr_ir.open_jaxpr(jaxpr)))


# --- what XLA folds before it counts ---------------------------------------------
#
# Constants here are literals and captured arrays, and what elementwise ops make of
# them; iota is not one (XLA counts ops on iotas). A constant that enters a nested
# `jax.jit` as an argument is opaque to XLA, but the boundary is gone once calls are
# inlined, so such ops are folded here and counted by XLA: x + minval inside
# jax.random.uniform is the one case seen, one FLOP per element of a dropout mask.

_VARIES = object()  # a constant whose elements are not all equal, or unreadable


def _splat_value(value: Any) -> Any:
    """The one value every element of a constant holds, else _VARIES."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):  # PRNG keys and other extended dtypes
        return _VARIES
    if arr.size == 0 or arr.dtype == object:
        return _VARIES
    first = arr.reshape(-1)[0]
    return first.item() if np.all(arr == first) else _VARIES


def _is(value: Any, target: float) -> bool:
    return value is not None and value is not _VARIES and value == target


def _folds_to_identity(name: str, inputs: Sequence[int], values: Sequence[Any], integer: bool) -> bool:
    """x + 0, x - 0, x * 1, b & True, b | False, x ^ 0, select(p, x, x), and integer
    x * 0: the simplifier replaces these by an operand or a constant before counting.
    (x / 1, x * 0 for floats and select on a constant predicate are kept.)"""
    if name in ("add", "add_any"):
        return any(_is(v, 0) for v in values)
    if name == "sub":
        return _is(values[1], 0)
    if name == "mul":
        return any(_is(v, 1) for v in values) or (integer and any(_is(v, 0) for v in values))
    if name == "and":
        return any(v is True for v in values)
    if name in ("or", "xor"):
        return any(_is(v, 0) for v in values)
    if name == "select_n":
        return len(set(inputs[1:])) == 1
    return False


def _foldable(name: str) -> bool:
    """Elementwise ops and data movement: XLA evaluates them when all inputs are
    constants (reductions, matmuls and iota it leaves alone)."""
    return (
        name in _ONE_PER_ELEMENT
        or name in _TRANSCENDENTAL
        or name in _EXPANDED
        or name in _SPLAT_PRESERVING
        or name in ("integer_pow", "pow", "select_n", "convert_element_type")
    )


def _constant_folding(graph: OpGraph) -> list[bool]:
    """Per op, whether XLA folds it away before counting."""
    known: dict[int, Any] = {vid: _splat_value(value) for vid, value in graph.constants.items()}
    folded = []
    for op in graph.ops:
        values = [known.get(v) for v in op.inputs]
        if _foldable(op.name) and values and None not in values and len(op.outputs) == 1:
            known[op.outputs[0]] = values[0] if op.name in _SPLAT_PRESERVING else _VARIES
            folded.append(True)
            continue
        integer = any(_is_integer(graph.avals[v]) for v in op.outputs)
        folded.append(_folds_to_identity(op.name, op.inputs, values, integer))
    return folded


def op_costs(graph: OpGraph) -> list[OpCost]:
    """Cost of every operator of `graph`, by op index; operators XLA folds away (an
    elementwise op on constants, x + 0, ...) cost no FLOPs."""
    folded = _constant_folding(graph)
    costs = []
    for op, gone in zip(graph.ops, folded):
        ins = [graph.avals[v] for v in op.inputs]
        outs = [graph.avals[v] for v in op.outputs]
        flops = 0.0 if gone else op_flops(op.name, ins, outs, op.params)
        costs.append(OpCost(flops, *op_bytes(ins, outs)))
    return costs


def graph_flops(graph: OpGraph) -> float:
    """Total FLOPs of a traced step, comparable to XLA's cost analysis of its jit."""
    return sum(c.flops for c in op_costs(graph))
